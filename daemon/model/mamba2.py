"""Mamba2 hybrids: Granite 4 (GraniteMoeHybridForCausalLM) and Nemotron-H (NemotronHForCausalLM), written for the
engine like llmd.model.qwen3_5. Both mix Mamba2 layers (a recurrent state per sequence in the engine's state pool,
llmd.model.recurrent) with attention layers (paged KV, no positions unless Granite's position_embedding_type is
"rope"); they differ only in how a layer wraps its mixer. Following transformers' modeling_granitemoehybrid and
modeling_nemotron_h (the references the tests compare against):
- Mamba2 mixer: in_proj -> [z | x B C | dt]; a short causal conv (with bias, SiLU) over x B C; the selective scan
  (llmd.model.recurrent.mamba2_scan: dt = softplus(dt + dt_bias), A = -exp(A_log), a D skip); the gated RMSNorm
  norm(y * silu(z)) over n_groups slices of the channels (recurrent.grouped_gated_rms_norm); out_proj.
- Granite layer: x + m * mixer(norm(x)), then x + m * (shared_mlp + MoE)(norm(x)), m the residual multiplier; the
  embeddings times embedding_multiplier, attention scaled by attention_multiplier, logits divided by logits_scaling.
  The checkpoint's input_linear / output_linear (shared MLP and experts, gate rows then up rows) and router.layer
  are read as the MLP's and llmd.model.moe's names (`adapt_checkpoint`).
- Nemotron-H layer: x + mixer(norm(x)), the mixer Mamba2, attention, a squared-ReLU MLP (up, down) or (Nemotron 3)
  llmd.model.moe's block with squared-ReLU experts without a gate, latent where the config says, and a squared-ReLU
  shared expert; the last two keep no cache (ModelConfig.is_mixerless). RMSNorms multiply by their weight in fp32.
  Its `backbone.` names are read as `model.`, an MoE layer's `mixer.` as `mlp.` (transformers 5's stacked
  `experts.up_proj` as gate_up_proj), and the multi-token-prediction head (`mtp.*`) is left unread.
A tensor of a layer kind its layer is not (the config's layer pattern against the checkpoint) is refused by name.
"""

from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ModelFileError
from .attention import AttentionMetadata, KVCache, paged_attention
from .config import ModelConfig
from .linear import make_linear
from .llama import MLP, CausalLM, RMSNorm, RotaryEmbedding
from .moe import SparseMoE
from .ops import TORCH_OPS, Ops
from .qwen3_5 import DepthwiseConv
from .recurrent import RecurrentState, StateMetadata, causal_conv1d, grouped_gated_rms_norm, mamba2_scan

_LAYER_TENSOR = re.compile(r"^model\.layers\.(\d+)\.([A-Za-z_]+)\.([A-Za-z_0-9]+)")
_MAMBA_PARTS = ("in_proj", "conv1d", "A_log", "D", "dt_bias", "norm", "out_proj")
_ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")
# Nemotron-H's MoE mixer parts (read under mlp.), and transformers 5's stacked experts ([E, out, in], no gate)
_MOE_MIXER = re.compile(r"^(model\.layers\.\d+)\.mixer\."
                        r"(gate|experts|shared_experts|fc1_latent_proj|fc2_latent_proj)\.")
_STACKED_UP = re.compile(r"\.mlp\.experts\.up_proj$")


class GatedGroupRMSNorm(nn.Module):
    def __init__(self, size: int, groups: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.groups, self.eps = groups, eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return grouped_gated_rms_norm(y, z, self.weight, self.groups, self.eps)


class Mamba2Mixer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        r = config.recurrent
        assert r is not None and r.kind == "mamba2"
        self.r = r
        self.inner = r.num_heads * r.head_dim
        self.in_proj = make_linear(config.hidden_size, self.inner + r.conv_channels + r.num_heads, bias=r.proj_bias)
        self.conv1d = DepthwiseConv(r.conv_channels, r.conv_kernel, bias=r.conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(r.num_heads))
        self.A_log = nn.Parameter(torch.zeros(r.num_heads))
        self.D = nn.Parameter(torch.ones(r.num_heads))
        self.norm = GatedGroupRMSNorm(self.inner, r.n_groups, config.rms_norm_eps)
        self.out_proj = make_linear(self.inner, config.hidden_size, bias=r.proj_bias)

    def forward(self, x: torch.Tensor, state: RecurrentState, meta: StateMetadata) -> torch.Tensor:
        r, t = self.r, x.shape[0]
        bc = r.n_groups * r.state_size
        z, xbc, dt = self.in_proj(x).split([self.inner, r.conv_channels, r.num_heads], dim=-1)
        xbc = causal_conv1d(xbc, self.conv1d.weight[:, 0], self.conv1d.bias, state.conv, meta)
        xs, b, c = xbc.split([self.inner, bc, bc], dim=-1)
        y = mamba2_scan(xs.reshape(t, r.num_heads, r.head_dim), dt, self.dt_bias, -self.A_log.float().exp(),
                        b.reshape(t, r.n_groups, r.state_size), c.reshape(t, r.n_groups, r.state_size), self.D,
                        state.ssm, meta, r.dt_limit)
        return self.out_proj(self.norm(y.reshape(t, self.inner), z))


class Attention(nn.Module):
    """Grouped-query attention over the paged KV, rotated by RoPE only where the model has positions."""

    ops: Ops = TORCH_OPS

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                                            config.head_dim)
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        self.scale = config.attention_multiplier if config.attention_multiplier is not None else d ** -0.5
        self.rope = config.uses_rope
        self.qkv_proj = make_linear(config.hidden_size, (h + 2 * kvh) * d, bias=config.attention_bias)
        self.o_proj = make_linear(h * d, config.hidden_size, bias=config.attention_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        t, h, kvh, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        v = qkv[:, (h + kvh) * d :].view(t, kvh, d)
        if self.rope:  # q and k side by side: rotated as one [t, h + kvh, d] view
            q, k = self.ops.rope(qkv, cos, sin, h + kvh, d).split([h, kvh], dim=1)
        else:
            q, k = qkv[:, : h * d].view(t, h, d), qkv[:, h * d : (h + kvh) * d].view(t, kvh, d)
        out = paged_attention(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(t, h * d))


class ReluSquaredMLP(nn.Module):
    """Nemotron-H's MLP: down(relu(up(x))^2), intermediate_size wide unless given (a shared expert's)."""

    def __init__(self, config: ModelConfig, intermediate_size: int | None = None):
        super().__init__()
        inter = intermediate_size or config.intermediate_size
        self.up_proj = make_linear(config.hidden_size, inter, bias=config.mlp_bias)
        self.down_proj = make_linear(inter, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.relu(self.up_proj(x)).square())


class Fp32WeightRMSNorm(RMSNorm):
    """Nemotron-H's RMSNorm: the weight multiplies the fp32 normalised input before the cast (the same in fp32)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return super().forward(x)
        h = x.float()
        return (self.weight.float() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps))).to(x.dtype)


class GraniteLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.recurrent = config.is_recurrent(layer_idx)
        if self.recurrent:
            self.mamba = Mamba2Mixer(config)
        else:
            self.self_attn = Attention(config)
        self.shared_mlp = MLP(config)  # intermediate_size: Granite's shared_intermediate_size
        self.mlp = SparseMoE(config) if config.moe is not None else None  # the checkpoint's block_sparse_moe
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.multiplier = config.residual_multiplier

    def forward(self, x, cos, sin, cache, meta: AttentionMetadata):
        h = self.input_layernorm(x)
        h = self.mamba(h, cache, meta.state) if self.recurrent else self.self_attn(h, cos, sin, cache, meta)
        x = x + h * self.multiplier
        h = self.post_attention_layernorm(x)
        out = self.shared_mlp(h) if self.mlp is None else self.mlp(h) + self.shared_mlp(h)
        return x + out * self.multiplier


class NemotronHLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        assert config.layer_types is not None
        self.kind = config.layer_types[layer_idx]
        self.norm = Fp32WeightRMSNorm(config.hidden_size, config.rms_norm_eps)
        if self.kind == "mamba":
            self.mixer: nn.Module = Mamba2Mixer(config)
        elif self.kind == "mlp":
            self.mixer = ReluSquaredMLP(config)
        elif self.kind == "moe":  # named mlp, as llmd.model.moe's names go (NemotronHCausalLM.renamed)
            assert config.moe is not None
            self.mlp = SparseMoE(config, shared=ReluSquaredMLP(config, config.moe.shared_intermediate_size))
        else:
            self.mixer = Attention(config)

    def forward(self, x, cos, sin, cache, meta: AttentionMetadata):
        h = self.norm(x)
        if self.kind == "mamba":
            return x + self.mixer(h, cache, meta.state)
        if self.kind == "mlp":
            return x + self.mixer(h)
        if self.kind == "moe":
            return x + self.mlp(h)
        return x + self.mixer(h, cos, sin, cache, meta)


class HybridModel(nn.Module):
    def __init__(self, config: ModelConfig, layer: type[nn.Module]):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layer(config, i) for i in range(config.num_hidden_layers))
        norm = Fp32WeightRMSNorm if layer is NemotronHLayer else RMSNorm
        self.norm = norm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config) if config.uses_rope else None


class Mamba2HybridLM(nn.Module):
    """Decoder + LM head with llmd.model.llama.CausalLM's interface; kv_caches holds per layer a KV cache (attention),
    a RecurrentState (Mamba2; meta.state says the step's slots) or None (a mixerless layer)."""

    graph_blocker = "the recurrent layers' state is not captured in CUDA graphs yet"
    awq_calibration = False  # llmd.model.awq assumes Llama's layers
    layer_class: type[nn.Module] = GraniteLayer
    checkpoint_parts = CausalLM.checkpoint_parts
    route = CausalLM.route
    covers = CausalLM.covers

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = HybridModel(config, self.layer_class)
        self.lm_head = None if config.tie_word_embeddings else make_linear(config.hidden_size, config.vocab_size)
        self.packed_modules = packed_modules(config, "mixer" if self.layer_class is NemotronHLayer else "self_attn")

    def init_buffers(self, device: torch.device | str) -> None:
        if self.model.rotary_emb is not None:
            self.model.rotary_emb.init_buffers(device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                meta: AttentionMetadata) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        if self.config.embedding_multiplier != 1.0:
            x = x * self.config.embedding_multiplier
        cos = sin = None
        if self.model.rotary_emb is not None:
            cos, sin = self.model.rotary_emb(positions, x.dtype)
        for layer, cache in zip(self.model.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, cache, meta)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = CausalLM.compute_logits(self, hidden)
        return logits if self.config.logits_scaling == 1.0 else logits / self.config.logits_scaling

    def adapt_checkpoint(self, tensors: Iterable, source: object = None) -> Iterator:
        """The checkpoint's names read as this model's (`renamed`), each layer's tensors checked against the kind
        the config's layer pattern gives that layer."""
        for item in tensors:
            name = item.name if hasattr(item, "name") else item[0]
            new = self.renamed(name)
            if new is None:
                continue
            self.check_layer_kind(new, name, source)
            if new != name:
                if hasattr(item, "name"):
                    item.name = new
                else:
                    item = (new, item[1])
            yield item

    def renamed(self, name: str) -> str | None:
        """Granite: the shared MLP's and the experts' input_linear / output_linear, and the router's layer."""
        for old, new in ((".shared_mlp.input_linear.", ".shared_mlp.gate_up_proj."),
                         (".shared_mlp.output_linear.", ".shared_mlp.down_proj."),
                         (".block_sparse_moe.input_linear.weight", ".mlp.experts.gate_up_proj.weight"),
                         (".block_sparse_moe.output_linear.weight", ".mlp.experts.down_proj.weight"),
                         (".block_sparse_moe.router.layer.", ".mlp.gate.")):
            name = name.replace(old, new)
        return name

    def check_layer_kind(self, name: str, original: str, source: object) -> None:
        m = _LAYER_TENSOR.match(name)
        if m is None or int(m.group(1)) >= self.config.num_hidden_layers:
            return
        layer, module, part = int(m.group(1)), m.group(2), m.group(3)
        found = self.tensor_kind(module, part)
        kind = (self.config.layer_types or [])[layer]
        if found is not None and found != kind:
            raise ModelFileError(source, f"tensor {original!r} belongs to a {found} layer, but the config's layer "
                                         f"pattern makes layer {layer} a {kind} layer")

    def tensor_kind(self, module: str, part: str) -> str | None:
        return {"mamba": "mamba", "self_attn": "full_attention"}.get(module)


class GraniteHybridCausalLM(Mamba2HybridLM):
    layer_class = GraniteLayer


class NemotronHCausalLM(Mamba2HybridLM):
    layer_class = NemotronHLayer

    def renamed(self, name: str) -> str | None:
        if name.startswith(("mtp.", "model.mtp.", "backbone.mtp.")):
            return None
        name = re.sub(r"^backbone\.", "model.", name)
        name = _MOE_MIXER.sub(r"\1.mlp.\2.", name)
        name = _STACKED_UP.sub(".mlp.experts.gate_up_proj.weight", name)
        return {"model.embeddings.weight": "model.embed_tokens.weight",
                "model.norm_f.weight": "model.norm.weight"}.get(name, name)

    def tensor_kind(self, module: str, part: str) -> str | None:
        if module == "mlp":
            return "moe"
        if module != "mixer":
            return None
        if part in _MAMBA_PARTS:
            return "mamba"
        return "full_attention" if part in _ATTENTION_PARTS else "mlp"


def packed_modules(config: ModelConfig, attention: str) -> dict[str, tuple[str, slice]]:
    """q_proj, k_proj, v_proj into qkv_proj (under `attention`: self_attn or Nemotron-H's mixer); a GGUF file's split
    shared-MLP gate and up into Granite's shared_mlp.gate_up_proj."""
    q, kv, inter = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim, \
        config.intermediate_size
    return {
        f"{attention}.q_proj": (f"{attention}.qkv_proj", slice(0, q)),
        f"{attention}.k_proj": (f"{attention}.qkv_proj", slice(q, q + kv)),
        f"{attention}.v_proj": (f"{attention}.qkv_proj", slice(q + kv, q + 2 * kv)),
        "shared_mlp.gate_proj": ("shared_mlp.gate_up_proj", slice(0, inter)),
        "shared_mlp.up_proj": ("shared_mlp.gate_up_proj", slice(inter, 2 * inter)),
    }
