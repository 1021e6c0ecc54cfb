"""One decoder implementation for Llama (2/3.x, SmolLM2), Mistral (sliding window), Qwen2 (qkv bias) and Qwen3
(q/k RMSNorm), written for the engine: the forward takes a flattened batch of tokens from many sequences with their
positions, and every layer's attention goes through `paged_attention`, which reads and writes the paged KV cache.

Parameter names follow Hugging Face (`model.layers.N.self_attn.q_proj.weight`, ...), so checkpoints load by name.
Numerics follow transformers (RMSNorm in fp32, rotate-half RoPE with cos/sin in fp32 then cast) so fp32 logits match.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import cpu_ops
from . import cpu_stack
from .attention import AttentionMetadata, KVCache, paged_attention
from .config import ModelConfig
from .linear import fuse_linears, make_linear


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            y = cpu_ops.rms_norm(x, self.weight, self.eps)  # one C call on the CPU
            # else torch's fused op, bit-identical to the steps below for fp32 (tested)
            return y if y is not None else F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in fp32 and cast back before the weight multiply, exactly as transformers does.
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_inv_freq(config: ModelConfig, device: torch.device | str | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] in fp32, with llama3 / linear scaling applied as transformers does."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    inv_freq = 1.0 / (config.rope_theta ** exponents)
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq
    rope_type = scaling.get("rope_type") or scaling.get("type")
    factor = float(scaling["factor"])
    if rope_type == "linear":
        return inv_freq / factor
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


class RotaryEmbedding(nn.Module):
    """cos/sin for arbitrary token positions (no precomputed table, so any position up to the model's limit works)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def init_buffers(self, device: torch.device | str) -> None:
        """Recompute the fp32 buffer after the module was built on the meta device and materialised."""
        self.inv_freq = rope_inv_freq(self.config, device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and a signed sin, [T, 1, head_dim] so they broadcast over heads: see apply_rope."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq.unsqueeze(0)  # [T, d/2]
        cos, sin = freqs.cos(), freqs.sin()
        cos = torch.cat((cos, cos), dim=-1)
        sin = torch.cat((-sin, sin), dim=-1)
        return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE, x * cos + rotate_half(x) * sin, with rotate_half's sign folded into the sin table
    (rotate_half(x) * sin == roll(x, d/2) * signed_sin exactly): fewer ops per layer on the decode path."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim ** -0.5
        self.window = config.layer_window(layer_idx)  # sliding window of this layer's attention (None: global)
        hidden, q_size, kv_size = config.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = make_linear(hidden, q_size, bias=config.attention_bias)
        self.k_proj = make_linear(hidden, kv_size, bias=config.attention_bias)
        self.v_proj = make_linear(hidden, kv_size, bias=config.attention_bias)
        self.o_proj = make_linear(q_size, hidden, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.qkv_proj: nn.Module | None = None  # set by fuse_projections, replacing q/k/v_proj
        self.split_sizes = [q_size, kv_size, kv_size]

    def fuse_projections(self) -> None:
        fused = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
        if fused is not None:
            self.qkv_proj = fused
            del self.q_proj, self.k_proj, self.v_proj

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.qkv_proj is not None:
            return self.qkv_proj(x).split(self.split_sizes, dim=-1)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        t = x.shape[0]
        heads, kv_heads, d = self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_proj is not None and self.q_norm is None:
            # q and k lie side by side in the fused output: rotate both as one [t, heads + kv_heads, d] view
            qkv = self.qkv_proj(x)
            qk = qkv[:, : (heads + kv_heads) * d].view(t, heads + kv_heads, d)
            if not cpu_ops.rope_(qkv, cos, sin, heads + kv_heads, d):  # in place on the CPU
                qk = apply_rope(qk, cos, sin)
            q, k = qk.split([heads, kv_heads], dim=1)
            v = qkv[:, (heads + kv_heads) * d :].view(t, kv_heads, d)
        else:
            q, k, v = self.project_qkv(x)
            q, k, v = q.view(t, heads, d), k.view(t, kv_heads, d), v.view(t, kv_heads, d)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = paged_attention(q, k, v, kv_cache, meta, self.scale, window=self.window)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_proj = make_linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.up_proj = make_linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = make_linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.gate_up_proj: nn.Module | None = None  # set by fuse_projections, replacing gate/up_proj
        self.intermediate_size = config.intermediate_size

    def fuse_projections(self) -> None:
        fused = fuse_linears([self.gate_proj, self.up_proj])
        if fused is not None:
            self.gate_up_proj = fused
            del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate_up = self.gate_up_proj(x)
            h = cpu_ops.silu_mul(gate_up, self.intermediate_size)  # one C call on the CPU
            if h is None:
                gate, up = gate_up.split(self.intermediate_size, dim=-1)
                h = F.silu(gate) * up
            return self.down_proj(h)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
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


class CausalLM(nn.Module):
    """Decoder + LM head. forward(input_ids[T], positions[T], kv_caches, meta) -> final hidden states [T, hidden]."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        # Tied embeddings: the head reuses embed_tokens.weight, so there is no separate lm_head parameter.
        self.lm_head = None if config.tie_word_embeddings else make_linear(config.hidden_size, config.vocab_size)
        self._cpu_stack = None  # llmd.model.cpu_stack: the layers as one C call (False: not applicable)

    def _apply(self, fn, recurse=True):
        self._cpu_stack = None  # a move or cast changes the weights' addresses
        return super()._apply(fn, recurse)

    def init_buffers(self, device: torch.device | str) -> None:
        self.model.rotary_emb.init_buffers(device)

    def fuse_projections(self) -> None:
        """After loading: q/k/v and gate/up become one matmul each (fewer, larger matmuls per layer), fp or
        quantized alike."""
        for layer in self.model.layers:
            layer.self_attn.fuse_projections()
            layer.mlp.fuse_projections()

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache], meta: AttentionMetadata
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(positions, x.dtype)
        if x.is_cpu and cpu_stack.run_layers(self, x, cos, sin, kv_caches, meta):  # in place, one C call
            return self.model.norm(x)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv_cache, meta)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] fp32. Call it only on the rows that are sampled (the last token of each sequence)."""
        if self.lm_head is None:
            return F.linear(hidden, self.model.embed_tokens.weight).float()
        return self.lm_head(hidden).float()


def build_model(config: ModelConfig) -> CausalLM:
    return CausalLM(config)
