"""One decoder implementation for Llama (2/3.x, SmolLM2), Mistral (sliding window), Qwen2 (qkv bias), Qwen3
(q/k RMSNorm) and Phi-3/4 (longrope, partial rotary), with RoPE scaled as transformers scales it (llama3, linear,
longrope, yarn), written for the engine: the forward takes a flattened batch of
tokens from many sequences with their positions, and every layer's attention goes through `paged_attention`, which
reads and writes the paged KV cache through the step's attention backend (llmd.model.attention_backends, chosen once
by the engine's runner).

Parameter names follow Hugging Face (`model.layers.N.self_attn.o_proj.weight`, ...), so checkpoints load by name,
except that q/k/v and gate/up are declared fused, as `qkv_proj` and `gate_up_proj` (one matmul each):
`CausalLM.packed_modules` says which rows of them each checkpoint projection fills, and the loader routes them there
(llmd.model.weights.load_tensors, llmd.model.quant.quantizing_stream). A checkpoint that stores the fused
projections (Phi-3) loads them by name. Mistral 3's image-text checkpoints (Mistral3ForConditionalGeneration) load as
their Mistral text model: `language_model.model.X` / `model.language_model.X` is `model.X`, and the vision tower and
projector are left to llmd.model.vision.mistral3 (`adapt_checkpoint`).
Numerics follow transformers (RMSNorm in fp32, rotate-half RoPE with cos/sin in fp32 then cast) so fp32 logits match.

What runs: this file's modules, with the ops (RMSNorm, RoPE, SiLU * up: llmd.model.ops) and each quantized layer's
kernel (QuantizedLinear.prepare) chosen for the device when the model is loaded. One exception, chosen once by the
engine's runner: on the CPU with int8/int4 weights or packed GGUF weights (and fp32 activations, a KV cache the C
attention reads, no q/k norm), `kernels/cpu_stack.c` runs these layers, all of them in
one call per step (llmd.model.cpu_stack.CompiledCpuForward); `tests/test_cpu_stack.py` keeps it bit-identical to the
modules here. fp32 and bitsandbytes weights, Qwen3 and CUDA always run the modules.
"""

from __future__ import annotations

import math
from typing import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionMetadata, KVCache, paged_attention, with_image_embeds
from .config import ModelConfig
from .linear import make_linear
from .moe import SparseMoE, canonical_name, expert_parts, expert_route, stacked_covers
from .ops import TORCH_OPS, Ops, apply_rope
from .weights import text_model_tensors


class RMSNorm(nn.Module):
    ops: Ops = TORCH_OPS  # bound for the device when the model is prepared (llmd.model.ops)

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


def longrope_uses_long_factors(config: ModelConfig) -> bool:
    """longrope's factor set, chosen once for the context the model serves, as llama.cpp chooses it: the long factors
    when that context exceeds the pretraining one (Phi-3.5's 128k), the short ones otherwise.

    transformers decides by the sequence's current length instead, and its generate recomputes the whole cache with
    the long factors when a sequence crosses the pretraining length. So both agree on any sequence longer than the
    pretraining context (the long-context use), and on every sequence of a model served within it; a short sequence
    of a long-context model gets the long factors here, as in llama.cpp. A per-sequence switch would need the engine
    to recompute a crossing sequence's cache."""
    scaling = config.rope_scaling or {}
    return config.max_position_embeddings > int(scaling["original_max_position_embeddings"])


def rope_inv_freq(config: ModelConfig, device: torch.device | str | None = None) -> torch.Tensor:
    """Inverse frequencies [rotary_dim / 2] in fp32, scaled as transformers does (llama3, linear, longrope, yarn) or
    as llama.cpp does with a GGUF's per-frequency factors (rope_freqs)."""
    dim = config.rotary_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    scaling = config.rope_scaling
    if scaling and scaling["rope_type"] == "longrope":
        key = "long_factor" if longrope_uses_long_factors(config) else "short_factor"
        ext = torch.tensor(scaling[key], dtype=torch.float32, device=device)
        return 1.0 / (ext * config.rope_theta ** exponents)
    inv_freq = 1.0 / (config.rope_theta ** exponents)
    if config.rope_freq_factors is not None:  # llama.cpp: theta_i = pos * base^(-2i/d) / factor_i
        return inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float32, device=device)
    if not scaling:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    if scaling["rope_type"] == "yarn":
        return yarn_inv_freq(config, exponents, factor)
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated smoothly.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def yarn_inv_freq(config: ModelConfig, exponents: torch.Tensor, factor: float) -> torch.Tensor:
    """YaRN (config.rope_scaling completed by llmd.model.config): the frequencies that turn fewer than beta_slow times
    over the pretraining context are interpolated (divided by `factor`), those that turn more than beta_fast times
    kept, and a linear ramp over the dimensions between blends the two, as transformers computes it."""
    scaling = config.rope_scaling or {}
    dim, base = config.rotary_dim, config.rope_theta
    original = scaling["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:  # the dimension whose frequency turns `rotations` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(scaling["beta_fast"]), correction_dim(scaling["beta_slow"])
    if scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(exponents.device)
    pos_freqs = base ** exponents
    extrapolated = 1 - ramp  # the share of each dimension's frequency kept as it is
    return 1.0 / (factor * pos_freqs) * (1 - extrapolated) + 1.0 / pos_freqs * extrapolated


class RotaryEmbedding(nn.Module):
    """cos/sin for arbitrary token positions (no precomputed table, so any position up to the model's limit works).
    longrope's and yarn's cos and sin are scaled by their attention factor, as transformers does."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        scaling = config.rope_scaling or {}
        scaled = scaling.get("rope_type") in ("longrope", "yarn")
        self.attention_scaling = float(scaling.get("attention_factor", 1.0)) if scaled else 1.0
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def init_buffers(self, device: torch.device | str) -> None:
        """Recompute the fp32 buffer after the module was built on the meta device and materialised."""
        self.inv_freq = rope_inv_freq(self.config, device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and a signed sin, [T, 1, rotary_dim] so they broadcast over heads: see llmd.model.ops.apply_rope."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq.unsqueeze(0)  # [T, d/2]
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        cos = torch.cat((cos, cos), dim=-1)
        sin = torch.cat((-sin, sin), dim=-1)
        return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)


def partial_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """RoPE on the first `rotary_dim` dimensions of each head of x [T, heads, head_dim], the rest passed through, as
    transformers' Phi-3 applies a partial_rotary_factor (cos/sin are [T, 1, rotary_dim])."""
    return torch.cat((apply_rope(x[..., :rotary_dim], cos, signed_sin), x[..., rotary_dim:]), dim=-1)


class Attention(nn.Module):
    ops: Ops = TORCH_OPS

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.rotary_dim = config.rotary_dim  # < head_dim: partial rotary, the other dimensions pass through
        self.scale = self.head_dim ** -0.5
        hidden, q_size, kv_size = config.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = make_linear(hidden, q_size + 2 * kv_size, bias=config.attention_bias)
        self.o_proj = make_linear(q_size, hidden, bias=config.attention_out_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        # per-layer attention options (see paged_attention): Mistral's (or Qwen2's use_sliding_window) window
        self.window: int | None = config.layer_window(layer_idx)
        self.softcap: float | None = None
        # gpt-oss: each head's learned sink logit (checkpoint `model.layers.N.self_attn.sinks`), passed in fp32
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if config.attention_sinks else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        t = x.shape[0]
        heads, kv_heads, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        v = qkv[:, (heads + kv_heads) * d :].view(t, kv_heads, d)
        if self.rotary_dim < d:  # partial rotary (Phi-4-mini): the first rotary_dim dimensions of each head turn
            q = qkv[:, : heads * d].view(t, heads, d)
            k = qkv[:, heads * d : (heads + kv_heads) * d].view(t, kv_heads, d)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = partial_rope(q, cos, sin, self.rotary_dim), partial_rope(k, cos, sin, self.rotary_dim)
        elif self.q_norm is None:
            # q and k lie side by side in the fused output: rotate both as one [t, heads + kv_heads, d] view
            q, k = self.ops.rope(qkv, cos, sin, heads + kv_heads, d).split([heads, kv_heads], dim=1)
        else:  # Qwen3: RMSNorm over each head of q and k before the rotation
            q = self.q_norm(qkv[:, : heads * d].view(t, heads, d)).view(t, -1)
            k = self.k_norm(qkv[:, heads * d : (heads + kv_heads) * d].view(t, kv_heads, d)).view(t, -1)
            q, k = self.ops.rope(q, cos, sin, heads, d), self.ops.rope(k, cos, sin, kv_heads, d)
        sinks = None if self.sinks is None else self.sinks.float()
        out = paged_attention(q, k, v, kv_cache, meta, self.scale, window=self.window, softcap=self.softcap,
                              sinks=sinks)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    ops: Ops = TORCH_OPS

    def __init__(self, config: ModelConfig, intermediate_size: int | None = None):
        super().__init__()
        inter = intermediate_size or config.intermediate_size
        self.gate_up_proj = make_linear(config.hidden_size, 2 * inter, bias=config.mlp_bias)
        self.down_proj = make_linear(inter, config.hidden_size, bias=config.mlp_bias)
        self.intermediate_size = inter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_mul(self.gate_up_proj(x), self.intermediate_size))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        moe = config.moe
        if moe is not None and moe.is_sparse(layer_idx):  # a mixture of experts (llmd.model.moe)
            shared = MLP(config, moe.shared_intermediate_size) if moe.shared_intermediate_size else None
            self.mlp: nn.Module = SparseMoE(config, shared)
        else:
            self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, kv_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    """The `model.` part of a HF checkpoint: embeddings, layers, final norm."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


# an image-text checkpoint's names for its text model (as transformers 4 and 5 and the hub save them), and its parts
# that are not the text model's
IMAGE_TEXT_RENAMES = {"language_model.model.": "model.", "model.language_model.": "model.",
                      "language_model.lm_head.": "lm_head."}
IMAGE_TEXT_UNREAD = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


class CausalLM(nn.Module):
    """Decoder + LM head. forward(input_ids[T], positions[T], kv_caches, meta) -> final hidden states [T, hidden]."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        # Tied embeddings: the head reuses embed_tokens.weight, so there is no separate lm_head parameter.
        self.lm_head = None if config.tie_word_embeddings else make_linear(config.hidden_size, config.vocab_size)
        self.packed_modules = packed_modules(config)

    def init_buffers(self, device: torch.device | str) -> None:
        self.model.rotary_emb.init_buffers(device)

    def checkpoint_parts(self, module: str) -> list[tuple[str, object]]:
        """The checkpoint projections that fill module `module` (a full name), each with its rows: a fused
        module's parts in row order, an experts' projection its per-expert parts (llmd.model.moe), any other module
        itself."""
        experts = expert_parts(module, self.config.moe) if self.config.moe is not None else None
        if experts is not None:
            return experts
        parent, _, child = module.rpartition(".")
        grand, _, attr = parent.rpartition(".")
        parts = [(f"{grand}.{key}", rows) for key, (fused, rows) in self.packed_modules.items()
                 if fused == f"{attr}.{child}"]
        return parts or [(module, slice(None))]

    def route(self, name: str) -> tuple[str, object | None]:
        """Where a checkpoint tensor goes: (parameter name, its rows) for a part of a fused projection (q/k/v_proj,
        gate/up_proj), (parameter, index) for experts' weights (llmd.model.moe), else (name, None)."""
        if self.config.moe is not None:
            name = canonical_name(name)
            routed = expert_route(name, self.config.moe)
            if routed is not None:
                return routed
        module, _, leaf = name.rpartition(".")
        parent, _, child = module.rpartition(".")
        grand, _, attr = parent.rpartition(".")
        target = self.packed_modules.get(f"{attr}.{child}")
        if target is None:
            return name, None
        fused, rows = target
        return f"{grand}.{fused}.{leaf}", rows

    def covers(self, name: str) -> set[str]:
        """The checkpoint parts a tensor routed with rows fills: itself, or every expert's for a stacked one."""
        covered = stacked_covers(name, self.config.moe) if self.config.moe is not None else None
        return covered if covered is not None else {canonical_name(name) if self.config.moe else name}

    def adapt_checkpoint(self, tensors: Iterable, source: object = None) -> Iterator:
        """An image-text checkpoint (Mistral3ForConditionalGeneration) read as its text model: `language_model.model.X`
        (or `model.language_model.X`) is `model.X`, the tower and projector are left to llmd.model.vision; any other
        checkpoint as it is."""
        return text_model_tensors(tensors, IMAGE_TEXT_RENAMES, IMAGE_TEXT_UNREAD)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache], meta: AttentionMetadata
    ) -> torch.Tensor:
        x, cos, sin = self.embed(input_ids, positions, meta)
        return self.model.norm(self.run_layers(x, cos, sin, kv_caches, meta))

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The token embeddings [T, hidden] and the RoPE tables (cos, signed sin) of the positions."""
        x = with_image_embeds(self.model.embed_tokens(input_ids), meta)
        cos, sin = self.model.rotary_emb(positions, x.dtype)
        return x, cos, sin

    def run_layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_caches: list[KVCache],
                   meta: AttentionMetadata) -> torch.Tensor:
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv_cache, meta)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] fp32. Call it only on the rows that are sampled (the last token of each sequence)."""
        if self.lm_head is None:
            return F.linear(hidden, self.model.embed_tokens.weight).float()
        return self.lm_head(hidden).float()


def packed_modules(config: ModelConfig) -> dict[str, tuple[str, slice]]:
    """Checkpoint projection (relative to a decoder layer) -> (the fused module holding it, its rows there)."""
    q, kv, inter = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim, \
        config.intermediate_size
    parts = {
        "self_attn.q_proj": ("self_attn.qkv_proj", slice(0, q)),
        "self_attn.k_proj": ("self_attn.qkv_proj", slice(q, q + kv)),
        "self_attn.v_proj": ("self_attn.qkv_proj", slice(q + kv, q + 2 * kv)),
        "mlp.gate_proj": ("mlp.gate_up_proj", slice(0, inter)),
        "mlp.up_proj": ("mlp.gate_up_proj", slice(inter, 2 * inter)),
    }
    shared = config.moe.shared_intermediate_size if config.moe is not None else 0
    if shared:  # the MoE block's shared expert (mlp.shared_expert)
        parts["shared_expert.gate_proj"] = ("shared_expert.gate_up_proj", slice(0, shared))
        parts["shared_expert.up_proj"] = ("shared_expert.gate_up_proj", slice(shared, 2 * shared))
    return parts


def build_model(config: ModelConfig) -> CausalLM:
    return CausalLM(config)
