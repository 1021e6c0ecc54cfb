"""ModelConfig: the few hyperparameters our decoder needs, read from a Hugging Face config.json (or built by the GGUF
loader from its metadata).

Both config.json dialects are accepted: the classic one (`rope_theta` + `rope_scaling`, as on the hub) and the
transformers >= 5 one (`rope_parameters` holding `rope_theta` and the scaling keys).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ModelFileError, UnsupportedArchitecture
from .pooling import DEFAULT_POOLING, POOLING_KINDS, hf_folder_pooling, matryoshka_dimensions

# HF architecture name -> the variant switches of our one decoder implementation. attention_bias None means "read
# config.json's attention_bias"; True/False is what transformers hard-codes for that architecture.
SUPPORTED_ARCHITECTURES: dict[str, dict[str, bool | None]] = {
    "LlamaForCausalLM": {"attention_bias": None, "qk_norm": False},
    "MistralForCausalLM": {"attention_bias": False, "qk_norm": False},
    "Qwen2ForCausalLM": {"attention_bias": True, "qk_norm": False},
    "Qwen3ForCausalLM": {"attention_bias": None, "qk_norm": True},
    # Phi-3/3.5/4: a Llama decoder whose checkpoint stores qkv_proj and gate_up_proj fused (as llama.py declares
    # them), with longrope scaling and, on some, partial rotary
    "Phi3ForCausalLM": {"attention_bias": False, "qk_norm": False},
    # Gemma 2 / Gemma 3 text: their own model class (llmd.model.gemma); the Gemma-only fields come from gemma_fields
    "Gemma2ForCausalLM": {"attention_bias": None, "qk_norm": False},
    "Gemma3ForCausalLM": {"attention_bias": None, "qk_norm": True},
    # mixtures of experts: the Llama decoder with an MoE block (llmd.model.moe) in place of some or all MLPs; the
    # block's settings come from moe_fields
    "MixtralForCausalLM": {"attention_bias": False, "qk_norm": False},
    "Qwen2MoeForCausalLM": {"attention_bias": True, "qk_norm": False},
    "Qwen3MoeForCausalLM": {"attention_bias": None, "qk_norm": True},
    "Glm4MoeForCausalLM": {"attention_bias": None, "qk_norm": None},  # qk_norm: config.json's use_qk_norm
    # gpt-oss: biases on q/k/v/o, attention sinks, alternating window (128) and full layers, YaRN; experts with
    # biases and a clamped SwiGLU (llmd.model.gpt_oss)
    "GptOssForCausalLM": {"attention_bias": True, "qk_norm": False},
    # hybrids: recurrent layers (a state per sequence, llmd.model.recurrent) between full-attention layers. Qwen3.5 /
    # Qwen3.6: Gated DeltaNet and gated attention (llmd.model.qwen3_5); its image-text checkpoints load as text.
    # Qwen3.5-MoE: the same layers with the MoE block (routed experts and a gated shared expert) as every MLP
    "Qwen3_5ForCausalLM": {"attention_bias": None, "qk_norm": True},
    "Qwen3_5MoeForCausalLM": {"attention_bias": None, "qk_norm": True},
    # Qwen3-Next: the same layers, the linear-attention projections stored fused (llmd.model.qwen3_next), MoE MLPs
    "Qwen3NextForCausalLM": {"attention_bias": None, "qk_norm": True},
    # Qwen3-VL's text model (llmd.model.qwen3_vl): Qwen3's layers (Qwen3-MoE's in Qwen3-VL-MoE) with multimodal RoPE
    # and DeepStack; transformers has no CausalLM of it, its text model's class names it
    "Qwen3VLTextModel": {"attention_bias": None, "qk_norm": True},
    "Qwen3VLMoeTextModel": {"attention_bias": None, "qk_norm": True},
    # Gemma 4 text (llmd.model.gemma4): per-layer embeddings, KV shared across layers, per-layer head shapes, an MoE
    # block beside the MLP (26B-A4B); its fields come from gemma4_fields
    "Gemma4ForCausalLM": {"attention_bias": None, "qk_norm": True},
    # Mamba2 hybrids (llmd.model.mamba2): Granite 4 (Mamba2 and attention layers, each with an MLP or MoE after it,
    # Granite's multipliers) and Nemotron-H (one mixer per layer: Mamba2, attention, a squared-ReLU MLP or, in
    # Nemotron 3, squared-ReLU experts)
    "GraniteMoeHybridForCausalLM": {"attention_bias": None, "qk_norm": False},
    "NemotronHForCausalLM": {"attention_bias": False, "qk_norm": False},
}
# image-text architectures whose text model is served (the tower is left unread) -> that text architecture
TEXT_ARCHITECTURES = {"Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
                      "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
                      "Gemma4ForConditionalGeneration": "Gemma4ForCausalLM",
                      "Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
                      "Mistral3ForConditionalGeneration": "MistralForCausalLM",
                      "Qwen3VLForConditionalGeneration": "Qwen3VLTextModel",
                      "Qwen3VLMoeForConditionalGeneration": "Qwen3VLMoeTextModel"}
# text_config keys an image-text config.json may leave out (the hub's Gemma 3 4B-27B do): transformers' defaults
_TEXT_CONFIG_DEFAULTS = {"Gemma3ForConditionalGeneration": {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131_072}}
# architectures whose config.json sliding_window applies unless use_sliding_window says otherwise
_WINDOW_BY_DEFAULT = ("MistralForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM", "GptOssForCausalLM")

# rope_scaling types we implement exactly as transformers does; anything else is refused rather than silently wrong.
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "longrope", "yarn")
_ROPE_TYPE_ALIASES = {"su": "longrope"}  # Phi-3's first configs named longrope "su"


ROUTERS = ("softmax", "sigmoid", "softmax_topk")
ACTIVATIONS = ("silu", "swiglu_clamped", "gelu_tanh", "relu2")


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts block (llmd.model.moe.SparseMoE): which experts a token takes and how they mix.

    router: "softmax" (probabilities over all experts, the top k taken: Qwen, Mixtral), "sigmoid" (independent scores,
    the top k taken by score + selection bias, weighted by the score alone: GLM-4.5, DeepSeek-V3, Nemotron-H),
    "softmax_topk" (the top k logits, then a softmax over those k: gpt-oss)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    router: str = "softmax"
    renormalize: bool = True  # the k weights divided by their sum
    scaling: float = 1.0  # the k weights multiplied by this (routed_scaling_factor)
    selection_bias: bool = False  # a learned per-expert bias added to the scores for the choice only
    groups: int = 1  # experts in `groups` groups; only the best `groups_kept` (by their top two scores) are eligible
    groups_kept: int = 1
    shared_intermediate_size: int = 0  # a shared expert every token takes (0: none)
    shared_gate: bool = False  # Qwen2-MoE: the shared expert's output scaled by sigmoid(x . w)
    dense_layers: tuple[int, ...] = ()  # layers that keep a dense MLP of the model's intermediate_size
    router_bias: bool = False  # a bias on the router's logits (gpt-oss)
    expert_bias: bool = False  # biases on every expert's projections (gpt-oss)
    # silu: silu(gate) * up; swiglu_clamped (gpt-oss): gate clamped above, up clamped both ways at swiglu_limit,
    # gate * sigmoid(swiglu_alpha * gate) * (up + 1); gelu_tanh (Gemma 4): gelu_tanh(gate) * up; relu2 (Nemotron-H):
    # relu(up)^2, no gate (the experts' gate_up projection holds the up rows alone)
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # Nemotron-H's latent experts: the routed experts' input projected from hidden to latent_size before them, their
    # weighted sum back to hidden after (the router and the shared expert read the hidden state); 0: none
    latent_size: int = 0

    def __post_init__(self) -> None:
        if self.router not in ROUTERS:
            raise ModelFileError("config", f"router {self.router!r} is not one of {', '.join(ROUTERS)}")
        if self.activation not in ACTIVATIONS:
            raise ModelFileError("config", f"expert activation {self.activation!r} is not one of "
                                           f"{', '.join(ACTIVATIONS)}")
        if not 0 < self.top_k <= self.num_experts:
            raise ModelFileError("config", f"{self.top_k} experts per token does not fit {self.num_experts} experts")
        if self.intermediate_size < 1:
            raise ModelFileError("config", f"expert intermediate size {self.intermediate_size} must be positive")
        if self.latent_size < 0:
            raise ModelFileError("config", f"expert latent size {self.latent_size} must not be negative")
        if self.groups < 1 or self.num_experts % self.groups or not 0 < self.groups_kept <= self.groups \
                or self.top_k > self.groups_kept * (self.num_experts // self.groups):
            raise ModelFileError("config", f"expert groups {self.groups} (keeping {self.groups_kept}) do not fit "
                                           f"{self.num_experts} experts and top {self.top_k}")

    def is_sparse(self, layer_idx: int) -> bool:
        return layer_idx not in self.dense_layers

    @property
    def gated(self) -> bool:
        """Whether the activation joins a gate and an up projection (every one but relu2)."""
        return self.activation != "relu2"

    @property
    def gate_up_rows(self) -> int:
        """The rows of one expert's gate_up projection: gate then up, or (ungated) up alone."""
        return (2 if self.gated else 1) * self.intermediate_size


RECURRENT_KINDS = ("gated_delta", "mamba2")
# layer_types entries that are recurrent layers (every other layer attends, but for the mixerless ones)
RECURRENT_LAYER_TYPES = ("linear_attention", "mamba")
# layer_types entries whose layer keeps no cache at all (Nemotron-H's MLP-only and experts-only layers)
MIXERLESS_LAYER_TYPES = ("mlp", "moe")


@dataclass(frozen=True)
class RecurrentConfig:
    """The recurrent layers of a hybrid model (llmd.model.recurrent): their kind and sizes.

    gated_delta (Qwen3.5 / Qwen3-Next): q/k heads `num_key_heads` of `key_head_dim`, value heads `num_heads` of
    `head_dim`; the state is [num_heads, key_head_dim, head_dim] per layer. Each q/k head serves num_heads /
    num_key_heads value heads: consecutive ones as Hugging Face orders them (value head j reads key head j // ratio),
    or, `tiled_value_heads`, every num_key_heads-th one as llama.cpp's GGUF files reorder them (j reads j % Hk).
    mamba2 (Granite 4, Nemotron-H): `num_heads` heads of `head_dim`, B/C of `state_size` in `n_groups` groups; the
    state is [num_heads, head_dim, state_size]."""

    kind: str
    conv_kernel: int
    num_heads: int
    head_dim: int
    num_key_heads: int = 0
    key_head_dim: int = 0
    state_size: int = 0
    n_groups: int = 1
    tiled_value_heads: bool = False
    # mamba2: biases on the conv and on in_proj / out_proj; dt clamped to dt_limit after its softplus
    conv_bias: bool = False
    proj_bias: bool = False
    dt_limit: tuple[float, float] = (0.0, math.inf)

    def __post_init__(self):
        if self.kind not in RECURRENT_KINDS:
            raise ModelFileError("config", f"recurrent kind {self.kind!r} is not one of {RECURRENT_KINDS}")
        sizes = [self.conv_kernel, self.num_heads, self.head_dim]
        sizes += [self.num_key_heads, self.key_head_dim] if self.kind == "gated_delta" else [self.state_size]
        if any(int(n) < 1 for n in sizes):
            raise ModelFileError("config", f"recurrent layer sizes must be positive: {self}")
        if self.kind == "gated_delta" and self.num_heads % self.num_key_heads:
            raise ModelFileError("config", f"{self.num_heads} value heads are not a multiple of "
                                           f"{self.num_key_heads} key heads")
        if self.kind == "mamba2" and (self.n_groups < 1 or self.num_heads % self.n_groups):
            raise ModelFileError("config", f"{self.num_heads} Mamba2 heads do not split into {self.n_groups} groups")

    @property
    def conv_channels(self) -> int:
        """Channels of the short convolution: q, k, v (gated delta) or x, B, C (Mamba2)."""
        if self.kind == "gated_delta":
            return 2 * self.num_key_heads * self.key_head_dim + self.num_heads * self.head_dim
        return self.num_heads * self.head_dim + 2 * self.n_groups * self.state_size

    @property
    def state_shape(self) -> tuple[int, int, int]:
        if self.kind == "gated_delta":
            return (self.num_heads, self.key_head_dim, self.head_dim)
        return (self.num_heads, self.head_dim, self.state_size)


@dataclass(frozen=True)
class Gemma4Fields:
    """What Gemma 4 text adds (llmd.model.gemma4)."""

    per_layer_input_size: int = 0  # per-layer embeddings: each layer's slice of a second table (0: none)
    per_layer_vocab: int = 0
    k_eq_v: bool = False  # full-attention layers take V from the K projection (no v_proj)
    double_wide_mlp: bool = False  # the KV-sharing layers' MLPs are twice as wide
    rope_proportion: float = 1.0  # full-attention layers: the share of head_dim's frequencies that turn
    pad_token_id: int = 0  # an image token's per-layer embedding is the pad token's (transformers' Gemma4Model)


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None  # None: same as num_attention_heads
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # e.g. {"rope_type": "llama3", "factor": 8.0, ...}; None for plain RoPE
    # GGUF llama3 scaling: llama.cpp's per-frequency divisors (the rope_freqs tensor) [rotary_dim / 2]
    rope_freq_factors: list[float] | None = None
    partial_rotary_factor: float = 1.0  # the share of head_dim that RoPE rotates (Phi-4-mini: 0.75)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2)
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    mlp_bias: bool = False
    torch_dtype: str | None = None  # dtype the checkpoint was saved in, for display only
    pooling: str = "mean"  # how embeddings are pooled (llmd.model.pooling): mean | last | cls
    matryoshka_dimensions: list[int] | None = None  # sizes an embedding may be cut to (None: the full size only)
    # Sliding-window attention: a query at position p sees keys in (p - sliding_window, p]. layer_types (as
    # transformers names them: "sliding_attention" / "full_attention", one per layer) says which layers use it;
    # None with a sliding_window: every layer does (Mistral).
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    # Gemma 2 / 3 (llmd.model.gemma); the defaults leave every other family as it is.
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap) before the softmax
    final_logit_softcapping: float | None = None  # the same on the output logits
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (None: head_dim ** -0.5)
    rope_local_theta: float | None = None  # RoPE base of the sliding layers, which never take rope_scaling
    moe: MoEConfig | None = None  # a mixture of experts in place of (some) MLPs; None: dense
    attention_out_bias: bool = False  # a bias on o_proj too (gpt-oss)
    # gpt-oss: a learned logit per attention head that joins each query's softmax denominator (llama.Attention.sinks)
    attention_sinks: bool = False
    # hybrids: layer_types names the recurrent layers ("linear_attention", "mamba"); they hold no KV cache
    recurrent: RecurrentConfig | None = None
    attention_output_gate: bool = False  # Qwen3.5: q_proj also yields a per-head gate, sigmoid(gate) * attention
    # Qwen3.5's multimodal RoPE: how many of the rotary frequencies take a token's (t, h, w) position components,
    # interleaved (llmd.model.qwen3_5.MultimodalRotaryEmbedding); None: one position per token
    mrope_section: list[int] | None = None
    # Qwen3-VL's DeepStack (llmd.model.qwen3_vl): an image brings this many more feature rows per token, added to the
    # outputs of the first this-many decoder layers at its tokens (its embeddings are [tokens, hidden * (1 + this)])
    deepstack_layers: int = 0
    # Per-layer attention shapes (Gemma 4's global layers: wider heads, fewer KV heads); None: head_dim and
    # num_key_value_heads on every layer
    layer_head_dims: list[int] | None = None
    layer_kv_heads: list[int] | None = None
    # KV sharing (Gemma 4): per layer, the layer whose cached K/V it attends over; a layer that reads another's
    # stores none of its own. None: every layer reads its own.
    kv_sources: list[int] | None = None
    gemma4: Gemma4Fields | None = None
    uses_rope: bool = True  # False: attention without positions (Granite 4's "nope", Nemotron-H)
    # Granite: embeddings times embedding_multiplier, each residual branch times residual_multiplier, attention
    # scores scaled by attention_multiplier (None: head_dim ** -0.5), logits divided by logits_scaling
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitecture(unsupported_message(self.architecture))
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelFileError(
                "config", f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.rope_scaling is not None:
            rope_type = rope_type_of(self.rope_scaling)
            if rope_type == "default":
                self.rope_scaling = None
            elif rope_type not in SUPPORTED_ROPE_TYPES:
                raise UnsupportedArchitecture(
                    f"{self.architecture} with rope scaling type {rope_type!r} is not supported "
                    f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
                )
            else:
                self.rope_scaling = {**self.rope_scaling, "rope_type": rope_type}
        half = self.rotary_dim // 2
        if not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ModelFileError("config", f"partial_rotary_factor {self.partial_rotary_factor} gives a rotary "
                                           f"dimension of {self.rotary_dim} for head_dim {self.head_dim}")
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != half:
            raise ModelFileError("config", f"{len(self.rope_freq_factors)} RoPE frequency factors for a rotary "
                                           f"dimension of {self.rotary_dim} (expected {half})")
        if self.rope_scaling is not None and self.rope_scaling["rope_type"] == "yarn":
            self.rope_scaling = _yarn(self.rope_scaling, self.max_position_embeddings)
        if self.rope_scaling is not None and self.rope_scaling["rope_type"] == "longrope":
            for key in ("short_factor", "long_factor"):
                n = len(self.rope_scaling.get(key) or [])
                if n != half:
                    raise ModelFileError("config", f"longrope {key} has {n} values for a rotary dimension of "
                                                   f"{self.rotary_dim} (expected {half})")
        if self.sliding_window is not None and int(self.sliding_window) < 1:
            raise ModelFileError("config", f"sliding_window {self.sliding_window} must be a positive token count")
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise ModelFileError("config", f"layer_types has {len(self.layer_types)} entries for "
                                 f"{self.num_hidden_layers} layers")
        if not 0 <= self.deepstack_layers <= self.num_hidden_layers:
            raise ModelFileError("config", f"{self.deepstack_layers} DeepStack layers (deepstack_visual_indexes) for "
                                           f"{self.num_hidden_layers} decoder layers")
        self.eos_token_ids = [int(i) for i in self.eos_token_ids]
        if self.pooling not in POOLING_KINDS:
            self.pooling = DEFAULT_POOLING

    def layer_window(self, layer_idx: int) -> int | None:
        """The sliding window of layer `layer_idx`'s attention, or None where it attends to the whole context."""
        if self.sliding_window is None:
            return None
        if self.layer_types is not None and self.layer_types[layer_idx] != "sliding_attention":
            return None
        return int(self.sliding_window)

    @property
    def layer_windows(self) -> list[int | None]:
        return [self.layer_window(i) for i in range(self.num_hidden_layers)]

    @property
    def rotary_dim(self) -> int:
        """How many leading dimensions of each head RoPE rotates (the rest pass through), as transformers rounds it."""
        assert self.head_dim is not None
        return int(self.head_dim * self.partial_rotary_factor)

    def is_recurrent(self, layer_idx: int) -> bool:
        """Whether layer layer_idx is a recurrent layer (a state per sequence, no KV cache)."""
        return self.recurrent is not None and self.layer_types is not None \
            and self.layer_types[layer_idx] in RECURRENT_LAYER_TYPES

    def is_mixerless(self, layer_idx: int) -> bool:
        """Whether layer layer_idx has no mixer that keeps a cache (Nemotron-H's MLP-only and MoE layers)."""
        return self.layer_types is not None and self.layer_types[layer_idx] in MIXERLESS_LAYER_TYPES

    def layer_head_dim(self, layer_idx: int) -> int:
        assert self.head_dim is not None
        return self.head_dim if self.layer_head_dims is None else self.layer_head_dims[layer_idx]

    def layer_num_kv_heads(self, layer_idx: int) -> int:
        assert self.num_key_value_heads is not None
        return self.num_key_value_heads if self.layer_kv_heads is None else self.layer_kv_heads[layer_idx]

    def kv_source(self, layer_idx: int) -> int:
        """The layer whose cached K/V layer layer_idx attends over (itself unless it shares another's)."""
        return layer_idx if self.kv_sources is None else self.kv_sources[layer_idx]

    @property
    def kv_layers(self) -> list[int]:
        """The layers that keep K/V in the paged cache: all but a hybrid's recurrent and mixerless layers and the
        layers that read another layer's K/V."""
        return [i for i in range(self.num_hidden_layers)
                if not self.is_recurrent(i) and not self.is_mixerless(i) and self.kv_source(i) == i]

    @property
    def num_kv_layers(self) -> int:
        return len(self.kv_layers)

    @property
    def kv_bytes_per_token(self) -> int:
        """K+V elements per token over the layers with a KV cache (multiply by the cache dtype's size)."""
        return sum(2 * self.layer_num_kv_heads(i) * self.layer_head_dim(i) for i in self.kv_layers)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], generation_config: dict[str, Any] | None = None) -> "ModelConfig":
        """Build from a parsed config.json (and optionally generation_config.json, whose eos ids are merged in)."""
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else _arch_from_model_type(cfg.get("model_type"))
        if arch in TEXT_ARCHITECTURES and isinstance(cfg.get("text_config"), dict):
            # an image-text checkpoint: its text model, whose settings are text_config's (Ministral 3's is no
            # MistralForCausalLM: its own, refused below)
            top = {k: cfg[k] for k in ("tie_word_embeddings", "eos_token_id", "bos_token_id") if k in cfg}
            if arch in ("Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration"):
                vision = cfg.get("vision_config")
                top["llmd_deepstack"] = vision.get("deepstack_visual_indexes", [8, 16, 24]) \
                    if isinstance(vision, dict) else []
            text_arch = TEXT_ARCHITECTURES[arch]
            if cfg["text_config"].get("model_type") == "ministral3":
                text_arch = "Ministral3ForCausalLM"
            cfg, arch = {**_TEXT_CONFIG_DEFAULTS.get(arch, {}), **top, **cfg["text_config"],
                         "architectures": [text_arch], "llmd_pooling": cfg.get("llmd_pooling", "mean")}, text_arch
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitecture(unsupported_message(arch))
        family = FAMILY_FIELDS.get(arch)
        if family in (None, moe_fields, qwen3_5_fields, qwen3_vl_fields) and cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedArchitecture(f"{arch} with hidden_act {cfg.get('hidden_act')!r} is not supported (only silu)")

        rope_params = dict(cfg.get("rope_parameters") or {})
        rope_theta = float(cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0)))
        rope_scaling = cfg.get("rope_scaling") or None
        if rope_scaling is None and rope_params:
            rest = {k: v for k, v in rope_params.items() if k not in ("rope_theta", "partial_rotary_factor")}
            rope_scaling = rest if rope_type_of(rest) != "default" else None
        partial = float(cfg.get("partial_rotary_factor") or rope_params.get("partial_rotary_factor") or 1.0)

        max_pos = int(cfg.get("max_position_embeddings", 2048))
        if rope_scaling is not None and rope_type_of(rope_scaling) == "longrope":
            rope_scaling = _longrope(rope_scaling, cfg, max_pos)
        if rope_scaling is not None and rope_type_of(rope_scaling) == "yarn":
            # the pretraining context as transformers standardizes it: config.json's own key first, then the
            # scaling's, else max_position_embeddings
            original = cfg.get("original_max_position_embeddings") or rope_scaling.get(
                "original_max_position_embeddings") or max_pos
            rope_scaling = {**rope_scaling, "original_max_position_embeddings": original}
        # Mistral's config has sliding_window (null in v0.2+: full attention); Qwen2 has one too but uses it only
        # with use_sliding_window (off in every released checkpoint), as transformers does.
        window = cfg.get("sliding_window")
        uses_window = cfg.get("use_sliding_window", arch in _WINDOW_BY_DEFAULT)
        sliding_window = int(window) if uses_window and window and int(window) < max_pos else None
        layer_types = cfg.get("layer_types")  # per layer, where the config names them (transformers >= 4.5x)
        if not (isinstance(layer_types, list) and all(isinstance(t, str) for t in layer_types)):
            layer_types = None

        switches = SUPPORTED_ARCHITECTURES[arch]
        extra = family(arch, cfg) if family is not None else {}
        fields = dict(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(extra["intermediate_size"] if "intermediate_size" in extra else
                                  cfg["intermediate_size"]),
            num_hidden_layers=int(extra.get("num_hidden_layers") or cfg["num_hidden_layers"]),
            num_attention_heads=int(cfg["num_attention_heads"]),
            num_key_value_heads=cfg.get("num_key_value_heads"),
            head_dim=cfg.get("head_dim"),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rope_freq_factors=cfg.get("llmd_rope_freq_factors"),
            partial_rotary_factor=partial,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(
                cfg.get("attention_bias", False) if switches["attention_bias"] is None else switches["attention_bias"]
            ),
            qk_norm=bool(cfg.get("use_qk_norm", False) if switches["qk_norm"] is None else switches["qk_norm"]),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_merge_eos(cfg.get("eos_token_id"), (generation_config or {}).get("eos_token_id")),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            pooling=str(cfg.get("llmd_pooling", "mean")),
            matryoshka_dimensions=matryoshka_dimensions(cfg, int(cfg["hidden_size"])),
            sliding_window=sliding_window,
            layer_types=layer_types,
        )
        return cls(**{**fields, **extra})

    @classmethod
    def from_hf_folder(cls, folder: str | Path) -> "ModelConfig":
        folder = Path(folder)
        cfg = read_json(folder / "config.json")
        gen_path = folder / "generation_config.json"
        gen = read_json(gen_path) if gen_path.exists() else None
        try:
            return cls.from_hf_config({**cfg, "llmd_pooling": hf_folder_pooling(folder)}, gen)
        except ModelFileError as e:  # a bad value (ModelConfig names it "config"): name the file
            raise ModelFileError(folder / "config.json", e.problem) from None
        except UnsupportedArchitecture as e:
            raise UnsupportedArchitecture(f"{folder / 'config.json'}: {e}") from None
        except (KeyError, TypeError, ValueError) as e:
            raise ModelFileError(folder / "config.json", f"missing or bad value: {e!r}") from None


def gemma_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The Gemma 2 / Gemma 3 text fields of a config.json, with transformers' defaults for absent keys.

    Both rope dialects: the classic keys (rope_theta, rope_local_base_freq, rope_scaling) and transformers >= 5's
    rope_parameters per layer type ({"full_attention": {...}, "sliding_attention": {...}}). Scaling applies to the
    full-attention layers only."""
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UnsupportedArchitecture(f"{arch} with hidden activation {act!r} is not supported (only gelu_pytorch_tanh)")
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedArchitecture(f"{arch} with use_bidirectional_attention (an embedding model) is not supported")
    gemma2 = arch == "Gemma2ForCausalLM"
    layers = int(cfg["num_hidden_layers"])
    layer_types = cfg.get("layer_types")
    if not layer_types:
        pattern = 2 if gemma2 else int(cfg.get("sliding_window_pattern") or 6)
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if len(layer_types) != layers or any(t not in ("sliding_attention", "full_attention") for t in layer_types):
        raise ModelFileError("config", f"layer_types {layer_types!r} is not one of sliding_attention / "
                                       f"full_attention per layer ({layers} layers)")
    window = cfg.get("sliding_window", 4096)
    params = cfg.get("rope_parameters") or {}
    per_type = isinstance(params.get("full_attention"), dict) or isinstance(params.get("sliding_attention"), dict)
    full = dict(params.get("full_attention") or {}) if per_type else dict(params)
    local = dict(params.get("sliding_attention") or {}) if per_type else {}
    theta = float(cfg.get("rope_theta", full.get("rope_theta", 10000.0 if gemma2 else 1_000_000.0)))
    scaling = cfg.get("rope_scaling") or {k: v for k, v in full.items() if k != "rope_theta"} or None
    if scaling is not None and rope_type_of(scaling) == "default":
        scaling = None
    local_theta = theta if gemma2 else float(cfg.get("rope_local_base_freq", local.get("rope_theta", 10000.0)))
    if local and rope_type_of(local) != "default":
        raise UnsupportedArchitecture(f"{arch} with rope scaling {rope_type_of(local)!r} on its sliding layers is "
                                      "not supported")
    return {
        "layer_types": list(layer_types),
        "sliding_window": int(window) if window else None,
        "attn_logit_softcapping": _opt_float(cfg.get("attn_logit_softcapping", 50.0 if gemma2 else None)),
        "final_logit_softcapping": _opt_float(cfg.get("final_logit_softcapping", 30.0 if gemma2 else None)),
        "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar", 256)),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "rope_local_theta": local_theta,
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
        "head_dim": int(cfg.get("head_dim") or 256),
    }


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


def moe_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The MoEConfig of a mixture-of-experts config.json, with transformers' defaults for absent keys."""
    layers = int(cfg["num_hidden_layers"])
    if arch == "MixtralForCausalLM":  # every layer sparse; the experts are intermediate_size wide
        moe = MoEConfig(_first(cfg, "num_local_experts", "num_experts", default=8), int(cfg.get("num_experts_per_tok", 2)),
                        int(cfg["intermediate_size"]))
    elif arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        step = int(cfg.get("decoder_sparse_step", 1) or 1)
        only = {int(i) for i in cfg.get("mlp_only_layers") or []}
        experts = _first(cfg, "num_experts", "num_local_experts", default=60 if arch == "Qwen2MoeForCausalLM" else 128)
        dense = tuple(i for i in range(layers) if i in only or experts == 0 or (i + 1) % step)
        moe = MoEConfig(experts, int(cfg.get("num_experts_per_tok", 4 if arch == "Qwen2MoeForCausalLM" else 8)),
                        int(cfg.get("moe_intermediate_size", 1408 if arch == "Qwen2MoeForCausalLM" else 768)),
                        renormalize=bool(cfg.get("norm_topk_prob", arch == "Qwen3MoeForCausalLM")),
                        shared_intermediate_size=int(cfg.get("shared_expert_intermediate_size", 5632)
                                                     if arch == "Qwen2MoeForCausalLM" else 0),
                        shared_gate=arch == "Qwen2MoeForCausalLM", dense_layers=dense)
    elif arch == "GptOssForCausalLM":  # the top-k logits softmaxed; biased router and experts; clamped SwiGLU
        moe = MoEConfig(_first(cfg, "num_local_experts", "num_experts", default=128),
                        int(cfg.get("num_experts_per_tok", 4)), int(cfg["intermediate_size"]), router="softmax_topk",
                        router_bias=True, expert_bias=True, activation="swiglu_clamped",
                        swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
                        swiglu_limit=float(cfg.get("swiglu_limit", 7.0)))
        layers_types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                                  for i in range(layers)]
        return {"moe": moe, "attention_out_bias": True, "attention_sinks": True, "layer_types": list(layers_types),
                "sliding_window": int(cfg.get("sliding_window") or 128)}
    else:  # Glm4MoeForCausalLM: sigmoid scores with a selection bias, shared experts, the first layers dense
        inter = int(cfg.get("moe_intermediate_size", 1408))
        moe = MoEConfig(_first(cfg, "n_routed_experts", "num_local_experts", default=128),
                        int(cfg.get("num_experts_per_tok", 8)), inter,
                        router="sigmoid", renormalize=bool(cfg.get("norm_topk_prob", True)),
                        scaling=float(cfg.get("routed_scaling_factor", 1.0)), selection_bias=True,
                        groups=int(cfg.get("n_group", 1)), groups_kept=int(cfg.get("topk_group", 1)),
                        shared_intermediate_size=inter * int(cfg.get("n_shared_experts", 1)),
                        dense_layers=tuple(range(min(layers, int(cfg.get("first_k_dense_replace", 1))))))
    out: dict[str, Any] = {"moe": moe}
    if arch == "Glm4MoeForCausalLM" and "partial_rotary_factor" not in cfg \
            and "partial_rotary_factor" not in (cfg.get("rope_parameters") or {}):
        out["partial_rotary_factor"] = 0.5  # transformers' default for GLM-4.5
    return out


def _first(cfg: dict[str, Any], *keys: str, default: int) -> int:
    """The first of `keys` config.json has (the hub's names and transformers 5's differ), as an int."""
    return int(next((cfg[k] for k in keys if cfg.get(k) is not None), default))


def qwen3_5_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5 / Qwen3.6 text: Gated DeltaNet layers (three to one) between gated full-attention layers with partial
    rotary (a quarter of head_dim), with transformers' defaults for absent keys. Qwen3.5-MoE: every MLP is the MoE
    block (softmax top-k renormalised, a shared expert behind a sigmoid gate), whose settings have no dense MLP width.
    Qwen3-Next: the same, but one position per token (no mrope_section), the MoE block Qwen2-MoE's (norm_topk_prob,
    and dense MLPs of intermediate_size on mlp_only_layers and where (i + 1) % decoder_sparse_step; no experts: all
    dense).
    `llmd_tiled_value_heads` (not a config.json key): a GGUF file's value-head order (RecurrentConfig)."""
    layers = int(cfg["num_hidden_layers"])
    layer_types = cfg.get("layer_types")
    if not layer_types:
        interval = int(cfg.get("full_attention_interval", 4))
        layer_types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
    if len(layer_types) != layers or any(t not in ("linear_attention", "full_attention") for t in layer_types):
        raise ModelFileError("config", f"layer_types {layer_types!r} is not one of linear_attention / "
                                       f"full_attention per layer ({layers} layers)")
    params = cfg.get("rope_parameters") or {}
    partial = cfg.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 0.25
    recurrent = RecurrentConfig("gated_delta", int(cfg.get("linear_conv_kernel_dim", 4)),
                                num_heads=int(cfg.get("linear_num_value_heads", 32)),
                                head_dim=int(cfg.get("linear_value_head_dim", 128)),
                                num_key_heads=int(cfg.get("linear_num_key_heads", 16)),
                                key_head_dim=int(cfg.get("linear_key_head_dim", 128)),
                                tiled_value_heads=bool(cfg.get("llmd_tiled_value_heads", False)))
    scaling = cfg.get("rope_scaling") or {k: v for k, v in params.items() if k not in (
        "rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved")} or None
    if scaling is not None and rope_type_of(scaling) == "default":
        scaling = None
    section = mrope_section(cfg, [11, 11, 10])
    out = {"layer_types": list(layer_types), "recurrent": recurrent, "attention_output_gate": True,
           "partial_rotary_factor": float(partial), "head_dim": int(cfg.get("head_dim") or 256),
           "rope_scaling": scaling, "mrope_section": list(section)}
    if arch == "Qwen3NextForCausalLM":
        out["mrope_section"] = None
        experts, step = int(cfg.get("num_experts", 512)), int(cfg.get("decoder_sparse_step", 1) or 1)
        only = {int(i) for i in cfg.get("mlp_only_layers") or []}
        if experts > 0:
            out["moe"] = MoEConfig(experts, int(cfg.get("num_experts_per_tok", 10)),
                                   int(cfg.get("moe_intermediate_size", 512)),
                                   renormalize=bool(cfg.get("norm_topk_prob", True)),
                                   shared_intermediate_size=int(cfg.get("shared_expert_intermediate_size", 512)),
                                   shared_gate=True,
                                   dense_layers=tuple(i for i in range(layers) if i in only or (i + 1) % step))
    if arch == "Qwen3_5MoeForCausalLM":
        shared = int(cfg.get("shared_expert_intermediate_size", 512))
        out["moe"] = MoEConfig(int(cfg.get("num_experts", 256)), int(cfg.get("num_experts_per_tok", 8)),
                               int(cfg.get("moe_intermediate_size", 512)), shared_intermediate_size=shared,
                               shared_gate=True)
        out["intermediate_size"] = shared  # no dense MLP: the shared expert's width stands in
    return out


def mrope_section(cfg: dict[str, Any], default: list[int]) -> list[int]:
    """A multimodal-RoPE config's mrope_section (rope_parameters', or the hub's rope_scaling's), checked."""
    params = cfg.get("rope_parameters") or {}
    section = params.get("mrope_section") or (cfg.get("rope_scaling") or {}).get("mrope_section") or default
    if not isinstance(section, list) or len(section) != 3 or \
            not all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= 4096 for n in section):
        raise ModelFileError("config", f"mrope_section {section!r} is not three counts of rotary frequencies")
    return list(section)


def qwen3_vl_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-VL's text model: Qwen3's (or Qwen3-MoE's) layers, RoPE over the whole head with the frequencies
    interleaved t, h, w by mrope_section (always interleaved: transformers' Qwen3VLTextRotaryEmbedding), and the
    DeepStack layer count (`llmd_deepstack`: the vision_config's deepstack_visual_indexes, carried by
    from_hf_config). transformers' defaults for absent keys."""
    deepstack = cfg.get("llmd_deepstack") or []
    if not isinstance(deepstack, list):
        raise ModelFileError("config", f"deepstack_visual_indexes {deepstack!r} is not a list of block numbers")
    scaling = cfg.get("rope_scaling") or {k: v for k, v in (cfg.get("rope_parameters") or {}).items() if k not in (
        "rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved")} or None
    if scaling is not None and rope_type_of(scaling) != "default":
        raise UnsupportedArchitecture(f"{arch} with rope scaling {rope_type_of(scaling)!r} is not supported")
    out: dict[str, Any] = {"mrope_section": mrope_section(cfg, [24, 20, 20]), "deepstack_layers": len(deepstack),
                           "rope_scaling": None, "head_dim": int(cfg.get("head_dim") or 128)}
    if "rope_theta" not in cfg and "rope_theta" not in (cfg.get("rope_parameters") or {}):
        out["rope_theta"] = 500000.0  # Qwen3VLTextConfig's default_theta
    if arch == "Qwen3VLMoeTextModel":  # Qwen3-MoE's block, Qwen3VLMoeTextConfig's defaults, top-k always renormalised
        defaults = {"num_experts_per_tok": 4, "moe_intermediate_size": 1408}
        out["moe"] = moe_fields("Qwen3MoeForCausalLM", {**defaults, **cfg, "norm_topk_prob": True, "num_experts": _first(
            cfg, "num_experts", "num_local_experts", default=60)})["moe"]
    return out


def gemma4_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 4 text: sliding (local) and full (global) layers, the global ones with their own head shape
    (per_layer_config, or global_head_dim / num_global_key_value_heads) and proportional RoPE; the last
    num_kv_shared_layers layers reading the K/V of the last earlier layer of their kind; per-layer embeddings; an MoE
    block beside the MLP (enable_moe_block)."""
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UnsupportedArchitecture(f"{arch} with hidden activation {act!r} is not supported (only gelu_pytorch_tanh)")
    if cfg.get("use_bidirectional_attention") not in (None, "vision"):  # "vision": images both ways (vision.gemma4)
        raise UnsupportedArchitecture(f"{arch} with use_bidirectional_attention "
                                      f"{cfg['use_bidirectional_attention']!r} is not supported")
    layers = int(cfg["num_hidden_layers"])
    types = list(cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention"
                                            for i in range(layers)])
    if len(types) != layers or any(t not in ("sliding_attention", "full_attention") for t in types):
        raise ModelFileError("config", f"layer_types {types!r} is not one of sliding_attention / full_attention per "
                                       f"layer ({layers} layers)")
    types[-1] = "full_attention"  # as transformers forces it
    head_dim, kv_heads = int(cfg.get("head_dim") or 256), int(cfg.get("num_key_value_heads") or 1)
    k_eq_v = bool(cfg.get("attention_k_eq_v", False))
    overrides = {int(k): v for k, v in (cfg.get("per_layer_config") or {}).items()}
    if not overrides:
        global_kv = cfg.get("num_global_key_value_heads") if k_eq_v else None
        over = {"head_dim": int(cfg.get("global_head_dim") or 512)}
        if global_kv:
            over["num_key_value_heads"] = int(global_kv)
        overrides = {i: over for i, t in enumerate(types) if t == "full_attention"}
    head_dims = [int(overrides.get(i, {}).get("head_dim", head_dim)) for i in range(layers)]
    kv = [int(overrides.get(i, {}).get("num_key_value_heads", kv_heads)) for i in range(layers)]
    shared = int(cfg.get("num_kv_shared_layers") or 0)
    first_shared = layers - shared
    if not 0 <= shared < layers:
        raise ModelFileError("config", f"num_kv_shared_layers {shared} must leave at least one of {layers} layers "
                                       "computing its own K/V")
    sources = list(range(layers))
    for i in range(first_shared, layers):
        earlier = [j for j in range(first_shared) if types[j] == types[i]]
        if not earlier:
            raise ModelFileError("config", f"layer {i} shares the K/V of an earlier {types[i]} layer, and there is "
                                           "none")
        sources[i] = earlier[-1]
    params = cfg.get("rope_parameters") or {}
    full, local = dict(params.get("full_attention") or {}), dict(params.get("sliding_attention") or {})
    for kind, p in (("full_attention", full), ("sliding_attention", local)):
        if str(p.get("rope_type", "default")) not in ("default", "proportional") or float(p.get("factor", 1.0)) != 1:
            raise UnsupportedArchitecture(f"{arch} with rope {p!r} on its {kind} layers is not supported")
    moe = None
    if cfg.get("enable_moe_block"):
        moe = MoEConfig(int(cfg["num_experts"]), int(cfg["top_k_experts"]), int(cfg["moe_intermediate_size"]),
                        activation="gelu_tanh")
    per_layer = int(cfg.get("hidden_size_per_layer_input", 256) or 0)  # transformers' default when absent
    return {
        "layer_types": types,
        "sliding_window": int(cfg.get("sliding_window") or 512),
        "final_logit_softcapping": _opt_float(cfg.get("final_logit_softcapping")),
        "rope_theta": float(full.get("rope_theta", 1_000_000.0)),
        "rope_scaling": None,
        "rope_local_theta": float(local.get("rope_theta", 10_000.0)),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
        "head_dim": head_dim,
        "num_key_value_heads": kv_heads,
        "layer_head_dims": head_dims if len(set(head_dims)) > 1 else None,
        "layer_kv_heads": kv if len(set(kv)) > 1 else None,
        "kv_sources": sources if shared else None,
        "moe": moe,
        "gemma4": Gemma4Fields(per_layer, int(cfg.get("vocab_size_per_layer_input") or 262_144) if per_layer else 0,
                               k_eq_v, bool(cfg.get("use_double_wide_mlp", False)),
                               float(full.get("partial_rotary_factor", 1.0)), int(cfg.get("pad_token_id") or 0)),
    }


def granite_hybrid_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Granite 4 (GraniteMoeHybridForCausalLM): Mamba2 and attention layers (layer_types, or the older
    layers_block_type: "mamba" / "attention", transformers 5's "linear_attention" / "full_attention"), each followed
    by a shared MLP of shared_intermediate_size (our intermediate_size) and, with num_local_experts, a mixture of
    experts of intermediate_size whose top-k logits are softmaxed; Granite's multipliers; RoPE only when
    position_embedding_type is "rope". transformers' defaults for absent keys."""
    layers = int(cfg["num_hidden_layers"])
    names = {"mamba": "mamba", "linear_attention": "mamba", "attention": "full_attention",
             "full_attention": "full_attention"}
    given = cfg.get("layer_types") or cfg.get("layers_block_type") or ["mamba"] * layers
    if not isinstance(given, list) or len(given) != layers or any(t not in names for t in given):
        raise ModelFileError("config", f"layer_types {given!r} is not one of mamba / attention per layer "
                                       f"({layers} layers)")
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedArchitecture(f"{arch} with hidden_act {cfg.get('hidden_act')!r} is not supported (only silu)")
    hidden, expand = int(cfg["hidden_size"]), int(cfg.get("mamba_expand", 2))
    heads = int(cfg.get("mamba_n_heads", 128))
    head_dim = cfg.get("mamba_d_head", "auto")
    head_dim = expand * hidden // heads if head_dim in (None, "auto") else int(head_dim)
    if heads * head_dim != expand * hidden:
        raise ModelFileError("config", f"mamba_n_heads {heads} x mamba_d_head {head_dim} is not mamba_expand "
                                       f"{expand} x hidden_size {hidden}")
    recurrent = RecurrentConfig("mamba2", int(cfg.get("mamba_d_conv", 4)), num_heads=heads, head_dim=head_dim,
                                state_size=int(cfg.get("mamba_d_state", 256)),
                                n_groups=int(cfg.get("mamba_n_groups", 1)),
                                conv_bias=bool(cfg.get("mamba_conv_bias", True)),
                                proj_bias=bool(cfg.get("mamba_proj_bias", False)),
                                dt_limit=_dt_limit(cfg.get("time_step_limit")))
    experts = int(cfg.get("num_local_experts", 8) or 0)
    moe = MoEConfig(experts, int(cfg.get("num_experts_per_tok", 2)), int(cfg["intermediate_size"]),
                    router="softmax_topk") if experts else None
    multiplier = cfg.get("attention_multiplier", 1.0)
    return {"layer_types": [names[t] for t in given], "recurrent": recurrent, "moe": moe,
            "intermediate_size": int(cfg.get("shared_intermediate_size", 1024)),
            "uses_rope": cfg.get("position_embedding_type") == "rope",
            "embedding_multiplier": float(cfg.get("embedding_multiplier", 1.0)),
            "residual_multiplier": float(cfg.get("residual_multiplier", 1.0)),
            "attention_multiplier": None if multiplier is None else float(multiplier),
            "logits_scaling": float(cfg.get("logits_scaling", 1.0))}


# Nemotron-H's pattern characters (hybrid_override_pattern) and layer type names -> ours
_NEMOTRON_LAYERS = {"M": "mamba", "*": "full_attention", "-": "mlp", "E": "moe", "mamba": "mamba",
                    "linear_attention": "mamba", "attention": "full_attention", "full_attention": "full_attention",
                    "mlp": "mlp", "moe": "moe"}


def nemotron_h_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Nemotron-H: one mixer per layer, as its pattern says (hybrid_override_pattern "M-M*E...": M Mamba2, * attention
    without positions, - a squared-ReLU MLP, E a mixture of experts; or transformers 5's layers_block_type list), whose
    length is the layer count (as transformers takes it). The experts (Nemotron 3 Nano / Super): sigmoid scores with
    e_score_correction_bias choosing the top k within the best n_group groups (topk_group kept), weighted by the
    score, renormalised (norm_topk_prob) and times routed_scaling_factor; squared-ReLU experts without a gate of
    moe_intermediate_size, working in moe_latent_size where set; a squared-ReLU shared expert of
    moe_shared_expert_intermediate_size. transformers' defaults for absent keys."""
    pattern = cfg.get("hybrid_override_pattern") or cfg.get("layers_block_type") or cfg.get("layer_types")
    if isinstance(pattern, str):
        pattern = list(pattern)
    if not isinstance(pattern, list) or not pattern or any(t not in _NEMOTRON_LAYERS for t in pattern):
        raise ModelFileError("config", f"layer pattern {pattern!r} is not a list of M (mamba), * (attention), "
                                       "- (mlp), E (moe) layers")
    types = [_NEMOTRON_LAYERS[t] for t in pattern]
    for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        if cfg.get(key, want) != want:
            raise UnsupportedArchitecture(f"{arch} with {key} {cfg.get(key)!r} is not supported (only {want})")

    def first(*keys: str, default: Any) -> Any:  # the current key, then its older spelling
        return next((cfg[k] for k in keys if cfg.get(k) is not None), default)

    recurrent = RecurrentConfig("mamba2", int(first("conv_kernel", "mamba_d_conv", default=4)),
                                num_heads=int(cfg.get("mamba_num_heads", 128)),
                                head_dim=int(cfg.get("mamba_head_dim", 64)),
                                state_size=int(cfg.get("ssm_state_size", 128)),
                                n_groups=int(first("n_groups", "mamba_n_groups", default=8)),
                                conv_bias=bool(first("use_conv_bias", "mamba_conv_bias", default=True)),
                                proj_bias=bool(cfg.get("use_bias", False)),
                                dt_limit=_dt_limit(first("time_step_limit", "mamba_dt_limit", default=None)))
    moe = None
    if "moe" in types:
        inter = int(first("moe_intermediate_size", default=7688))
        moe = MoEConfig(int(first("n_routed_experts", "num_local_experts", "num_experts", default=8)),
                        int(first("num_experts_per_tok", default=2)), inter, router="sigmoid",
                        renormalize=bool(first("norm_topk_prob", default=True)),
                        scaling=float(first("routed_scaling_factor", default=1.0)), selection_bias=True,
                        groups=int(first("n_group", default=1)), groups_kept=int(first("topk_group", default=1)),
                        shared_intermediate_size=int(first("moe_shared_expert_intermediate_size",
                                                           "shared_expert_intermediate_size", default=7688)),
                        activation="relu2", latent_size=int(first("moe_latent_size", default=0)))
    return {"layer_types": types, "num_hidden_layers": len(types), "recurrent": recurrent, "uses_rope": False,
            "head_dim": int(cfg.get("head_dim") or 128), "rms_norm_eps": float(cfg.get("layer_norm_epsilon", 1e-5)),
            "num_key_value_heads": int(cfg.get("num_key_value_heads") or 8), "moe": moe}


def _dt_limit(value: Any) -> tuple[float, float]:
    """time_step_limit as config.json holds it ([low, high], infinity as JSON's Infinity or transformers 5's
    {"__float__": "Infinity"}; absent: no limit)."""
    if value is None:
        return (0.0, math.inf)
    try:
        low, high = (float(v["__float__"]) if isinstance(v, dict) else float(v) for v in value)
    except (TypeError, ValueError, KeyError):
        raise ModelFileError("config", f"time_step_limit {value!r} is not a pair of numbers") from None
    if not low <= high:
        raise ModelFileError("config", f"time_step_limit {value!r} is empty")
    return (low, high)


# HF architecture -> its extra ModelConfig fields from config.json (families whose layers differ from Llama's)
FAMILY_FIELDS = {"Qwen3VLTextModel": qwen3_vl_fields, "Qwen3VLMoeTextModel": qwen3_vl_fields,
                 "Gemma4ForCausalLM": gemma4_fields, "Qwen3_5ForCausalLM": qwen3_5_fields,
                 "Qwen3_5MoeForCausalLM": qwen3_5_fields, "Qwen3NextForCausalLM": qwen3_5_fields,
                 "GraniteMoeHybridForCausalLM": granite_hybrid_fields,
                 "NemotronHForCausalLM": nemotron_h_fields, "Gemma2ForCausalLM": gemma_fields,
                 "Gemma3ForCausalLM": gemma_fields,
                 "MixtralForCausalLM": moe_fields, "Qwen2MoeForCausalLM": moe_fields,
                 "Qwen3MoeForCausalLM": moe_fields, "Glm4MoeForCausalLM": moe_fields, "GptOssForCausalLM": moe_fields}


def rope_type_of(scaling: dict) -> str:
    rope_type = str(scaling.get("rope_type") or scaling.get("type") or "default")
    return _ROPE_TYPE_ALIASES.get(rope_type, rope_type)


def _longrope(scaling: dict, cfg: dict[str, Any], max_pos: int) -> dict:
    """longrope's parameters completed as transformers completes them: the pretraining context from the scaling dict
    or config.json, and the cos/sin scale sqrt(1 + ln(s) / ln(original)) for s = context / original."""
    original = int(scaling.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
                   or max_pos)
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        factor = float(scaling.get("factor") or max_pos / original)
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {**scaling, "rope_type": "longrope", "original_max_position_embeddings": original,
            "attention_factor": float(attention_factor)}


def _yarn(scaling: dict, max_pos: int) -> dict:
    """YaRN's parameters checked and completed as transformers' _compute_yarn_parameters completes them: factor
    (None: max_position_embeddings / original), beta_fast and beta_slow (a missing or zero value: 32 and 1), truncate
    (default true) and the cos/sin scale attention_factor (given, else mscale(factor, mscale) / mscale(factor,
    mscale_all_dim) when both are set, else mscale(factor), with mscale(s, m) = 0.1 * m * ln(s) + 1 for s > 1)."""

    def number(key: str, value: Any) -> float:
        try:
            x = float(value)
        except (TypeError, ValueError):
            x = math.nan
        if not (math.isfinite(x) and x > 0):
            raise ModelFileError("config", f"yarn rope scaling {key} {value!r} must be a positive number")
        return x

    if scaling.get("original_max_position_embeddings") is None:
        raise ModelFileError("config", "yarn rope scaling lacks original_max_position_embeddings (the pretraining "
                                       "context)")
    original = int(number("original_max_position_embeddings", scaling["original_max_position_embeddings"]))
    factor = scaling.get("factor")
    factor = max_pos / original if factor is None else number("factor", factor)

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is not None:
        attention_factor = number("attention_factor", attention_factor)
    elif scaling.get("mscale") and scaling.get("mscale_all_dim"):
        attention_factor = mscale(float(scaling["mscale"])) / mscale(float(scaling["mscale_all_dim"]))
    else:
        attention_factor = mscale()
    return {**scaling, "rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original,
            "attention_factor": attention_factor, "beta_fast": float(scaling.get("beta_fast") or 32),
            "beta_slow": float(scaling.get("beta_slow") or 1), "truncate": bool(scaling.get("truncate", True))}


def unsupported_message(arch: str | None) -> str:
    return f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise ModelFileError(path, "file not found")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFileError(path, f"not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ModelFileError(path, "expected a JSON object")
    return data


def _arch_from_model_type(model_type: str | None) -> str | None:
    by_type = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
               "gemma3_text": "Gemma3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
               "qwen3_moe": "Qwen3MoeForCausalLM", "glm4_moe": "Glm4MoeForCausalLM", "gpt_oss": "GptOssForCausalLM",
               "qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5": "Qwen3_5ForConditionalGeneration",
               "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
               "qwen3_next": "Qwen3NextForCausalLM",
               "gemma4_text": "Gemma4ForCausalLM", "gemma4": "Gemma4ForConditionalGeneration",
               "granitemoehybrid": "GraniteMoeHybridForCausalLM", "nemotron_h": "NemotronHForCausalLM",
               "gemma3": "Gemma3ForConditionalGeneration", "mistral3": "Mistral3ForConditionalGeneration",
               "qwen3_vl": "Qwen3VLForConditionalGeneration", "qwen3_vl_text": "Qwen3VLTextModel",
               "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration", "qwen3_vl_moe_text": "Qwen3VLMoeTextModel"}
    return by_type.get(model_type or "", model_type)


def _merge_eos(*values: Any) -> list[int]:
    ids: list[int] = []
    for value in values:
        for i in value if isinstance(value, list) else [value]:
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    return ids
