"""Gemma 2 and Gemma 3 text (Gemma2ForCausalLM, Gemma3ForCausalLM), written for the engine like llmd.model.llama,
whose pieces it reuses (linear layers, RoPE, the paged-attention seam).

What differs from Llama, following transformers' modeling_gemma2/3 (the reference the tests compare against):
- embeddings are multiplied by sqrt(hidden_size), as a tensor in the model's dtype;
- RMSNorm multiplies by (1 + weight), in fp32, before casting back (GemmaRMSNorm);
- four norms per layer: input, post-attention, pre-feedforward, post-feedforward (sandwich norms);
- GeGLU: down(gelu_tanh(gate(x)) * up(x));
- attention scale query_pre_attn_scalar ** -0.5; optional soft-capping of the attention scores (Gemma 2) and of the
  final logits (Gemma 2): x -> cap * tanh(x / cap);
- layers alternate sliding-window and global attention (config.layer_types: Gemma 2 1:1, Gemma 3 5:1), with the
  window config.sliding_window; Gemma 3 has q/k RMSNorm and a separate RoPE base for its sliding layers
  (rope_local_theta, never scaled), the global layers taking rope_theta and rope_scaling.

Which path runs what: on the CPU, Gemma 3 with int8/int4/GGUF weights runs its layers as one C call
(kernels/cpu_stack.c through llmd.model.cpu_stack: the same kernel calls as these modules, so bit for bit the same;
tests/test_gemma.py holds it); Gemma 2 (soft-capped attention), fp weights and CUDA run these modules. Each projection
is its own kernel as for Llama (C kernels on the CPU for int8/int4/GGUF weights); GeGLU is one C call on the CPU. Attention without soft-capping (Gemma 3) takes the default backend with the layer's
window (llmd.model.attention: the C kernels on the CPU, which read only the window's blocks). Soft-capped attention
(Gemma 2) has no kernel: `windowed_attention` below computes it in torch, per sequence, so a sequence's result never
depends on the rest of the batch. That path reads per-step lengths from the host, so Gemma decode steps are not
captured in CUDA graphs.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import cpu_ops
from . import cpu_stack
from .attention import AttentionMetadata, KVCache, gather_context, paged_attention, window_start, write_kv
from .config import ModelConfig
from .linear import fuse_linears, make_linear
from .llama import RotaryEmbedding, apply_rope

SLIDING, FULL = "sliding_attention", "full_attention"
# queries per block in windowed_attention: bounds the score matrix at [heads, QUERY_BLOCK, window + QUERY_BLOCK]
QUERY_BLOCK = 256


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), in fp32, cast back to x's dtype (Gemma3RMSNorm). `weight` keeps the checkpoint's
    name and value; the fp32 multiplier 1 + weight is computed once after loading (`prepare`)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps
        self.scale: torch.Tensor | None = None

    def prepare(self) -> None:
        self.scale = (1.0 + self.weight.detach().float()).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.scale
        if scale is None or scale.device != x.device:
            self.prepare()
            scale = self.scale
        if x.dtype == torch.float32:
            # (a strided q/k of a prefill chunk is copied first, so that the C call computes it, as in the C stack)
            y = cpu_ops.rms_norm(x if x.is_contiguous() else x.contiguous(), scale, self.eps)  # one C call on the CPU, the same sums as F.rms_norm
            return y if y is not None else F.rms_norm(x, scale.shape, scale, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * scale).to(x.dtype)


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(x / cap) * cap


def windowed_attention(
    q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata, scale: float, window: int | None,
    softcap: float | None, only: list[int],
) -> torch.Tensor:
    """Attention of the sequences `only` (K/V already in the cache), as transformers' eager attention computes it:
    scores = q k^T * scale, soft-capped, masked causally and to the last `window` positions (key j is seen by query i
    when i - window < j <= i), softmax in fp32, times V. Rows of other sequences are left uninitialised.
    q [T, heads, d] -> [T, heads, d]."""
    out = torch.empty_like(q)
    starts = [0]
    for n in meta.query_lens_list:
        starts.append(starts[-1] + n)
    heads = q.shape[1]
    for i in only:
        q_len, s_len = meta.query_lens_list[i], meta.seq_lens_list[i]
        # from the block holding the first position any query sees: earlier blocks may already be reused
        base = window_start(s_len, q_len, window) // meta.block_size * meta.block_size
        k_all, v_all = gather_context(kv_cache, meta.block_tables[i], s_len, q.dtype, base)
        group = heads // k_all.shape[1]
        for b in range(0, q_len, QUERY_BLOCK):
            e = min(q_len, b + QUERY_BLOCK)
            first_q, last_q = s_len - q_len + b, s_len - q_len + e - 1  # positions of the block's queries
            lo = 0 if window is None else max(0, first_q - window + 1)
            k, v = k_all[lo - base : last_q + 1 - base], v_all[lo - base : last_q + 1 - base]
            if group > 1:
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            qs = q[starts[i] + b : starts[i] + e].transpose(0, 1)  # [heads, n, d]
            scores = torch.matmul(qs, k.permute(1, 2, 0)) * scale  # [heads, n, keys]
            if softcap is not None:
                scores = soft_cap(scores, softcap)
            q_pos = torch.arange(first_q, last_q + 1, device=q.device).unsqueeze(1)
            k_pos = torch.arange(lo, last_q + 1, device=q.device).unsqueeze(0)
            masked = k_pos > q_pos
            if window is not None:
                masked |= k_pos <= q_pos - window
            scores = scores.masked_fill(masked, float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            out[starts[i] + b : starts[i] + e] = torch.matmul(probs, v.transpose(0, 1)).transpose(0, 1)
    return out


def gemma_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata, scale: float,
    window: int | None, softcap: float | None,
) -> torch.Tensor:
    """Write K/V, then attend: without soft-capping, the default backend with this layer's window (every path takes
    `window=`); with it, `windowed_attention` for every sequence."""
    if softcap is None:
        return paged_attention(q, k, v, kv_cache, meta, scale, window=window)
    write_kv(k, v, kv_cache, meta.slot_mapping)
    return windowed_attention(q, kv_cache, meta, scale, window, softcap,
                              [i for i, n in enumerate(meta.query_lens_list) if n])


class GemmaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.layer_type = (config.layer_types or [FULL] * config.num_hidden_layers)[layer_idx]
        self.window = config.layer_window(layer_idx)  # None: a global layer
        self.softcap = config.attn_logit_softcapping
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = d = config.head_dim
        self.scale = float(config.query_pre_attn_scalar or d) ** -0.5
        hidden, q_size, kv_size = config.hidden_size, self.num_heads * d, self.num_kv_heads * d
        self.q_proj = make_linear(hidden, q_size, bias=config.attention_bias)
        self.k_proj = make_linear(hidden, kv_size, bias=config.attention_bias)
        self.v_proj = make_linear(hidden, kv_size, bias=config.attention_bias)
        self.o_proj = make_linear(q_size, hidden, bias=config.attention_bias)
        if config.qk_norm:
            self.q_norm: GemmaRMSNorm | None = GemmaRMSNorm(d, config.rms_norm_eps)
            self.k_norm: GemmaRMSNorm | None = GemmaRMSNorm(d, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.qkv_proj: nn.Module | None = None  # set by fuse_projections, replacing q/k/v_proj
        self.split_sizes = [q_size, kv_size, kv_size]

    def fuse_projections(self) -> None:
        fused = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
        if fused is not None:
            self.qkv_proj = fused
            del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        t, d, heads, kv_heads = x.shape[0], self.head_dim, self.num_heads, self.num_kv_heads
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(x)
            q, k, v = qkv.split(self.split_sizes, dim=-1)
        else:
            qkv = None
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k, v = q.reshape(t, heads, d), k.reshape(t, kv_heads, d), v.reshape(t, kv_heads, d)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # fresh contiguous tensors: rotated in place on the CPU
            if not cpu_ops.rope_(q.view(t, -1), cos, sin, heads, d):
                q = apply_rope(q, cos, sin)
            if not cpu_ops.rope_(k.view(t, -1), cos, sin, kv_heads, d):
                k = apply_rope(k, cos, sin)
        elif qkv is None or not cpu_ops.rope_(qkv, cos, sin, heads + kv_heads, d):  # q and k side by side
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = gemma_attention(q, k, v, kv_cache, meta, self.scale, self.window, self.softcap)
        return self.o_proj(out.reshape(t, self.num_heads * d))


class GemmaMLP(nn.Module):
    """GeGLU: down(gelu_tanh(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.intermediate_size = n = config.intermediate_size
        self.gate_proj = make_linear(config.hidden_size, n, bias=config.mlp_bias)
        self.up_proj = make_linear(config.hidden_size, n, bias=config.mlp_bias)
        self.down_proj = make_linear(n, config.hidden_size, bias=config.mlp_bias)
        self.gate_up_proj: nn.Module | None = None  # set by fuse_projections, replacing gate/up_proj

    def fuse_projections(self) -> None:
        fused = fuse_linears([self.gate_proj, self.up_proj])
        if fused is not None:
            self.gate_up_proj = fused
            del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate_up = self.gate_up_proj(x)
            h = cpu_ops.gelu_mul(gate_up, self.intermediate_size)  # one C call on the CPU
            if h is not None:
                return self.down_proj(h)
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = GemmaAttention(config, layer_idx)
        self.mlp = GemmaMLP(config)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(self, x: torch.Tensor, cos: dict[str, torch.Tensor], sin: dict[str, torch.Tensor],
                kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        """cos/sin: the RoPE tables per layer type (GemmaRotaryEmbedding); this layer takes its own."""
        kind = self.self_attn.layer_type
        h = self.self_attn(self.input_layernorm(x), cos[kind], sin[kind], kv_cache, meta)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


class GemmaRotaryEmbedding(nn.Module):
    """RoPE tables per layer type: global layers rope_theta (+ rope_scaling), sliding layers rope_local_theta."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.full = RotaryEmbedding(config)
        local_theta = config.rope_local_theta or config.rope_theta
        same = local_theta == config.rope_theta and config.rope_scaling is None
        self.sliding = None if same else RotaryEmbedding(
            dataclasses.replace(config, rope_theta=local_theta, rope_scaling=None))

    def init_buffers(self, device: torch.device | str) -> None:
        self.full.init_buffers(device)
        if self.sliding is not None:
            self.sliding.init_buffers(device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[dict, dict]:
        cos, sin = self.full(positions, dtype)
        local_cos, local_sin = (cos, sin) if self.sliding is None else self.sliding(positions, dtype)
        return {FULL: cos, SLIDING: local_cos}, {FULL: sin, SLIDING: local_sin}


class GemmaModel(nn.Module):
    """The `model.` part of a HF checkpoint."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = GemmaRotaryEmbedding(config)


class GemmaCausalLM(nn.Module):
    """Decoder + LM head, the interface of llmd.model.llama.CausalLM: forward(input_ids[T], positions[T], kv_caches,
    meta) -> final hidden states [T, hidden]; compute_logits(hidden) -> fp32 logits (soft-capped where configured)."""

    graph_blocker = "Gemma's windowed / soft-capped attention reads per-step lengths on the host"
    cpu_stack_kind = "gemma"  # llmd.model.cpu_stack builds Gemma 3's layers as one C call
    awq_calibration = False  # llmd.model.awq assumes Llama's norms: int4 is quantized weight by weight (loader)

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = GemmaModel(config)
        self.lm_head = None if config.tie_word_embeddings else make_linear(config.hidden_size, config.vocab_size)
        # sqrt(hidden) as transformers holds it (an fp32 tensor), cast to the activations' dtype when used
        self.embed_scale = torch.tensor(config.hidden_size ** 0.5)
        self._cpu_stack = None  # llmd.model.cpu_stack: the layers as one C call (False: not applicable)

    def init_buffers(self, device: torch.device | str) -> None:
        self.model.rotary_emb.init_buffers(device)
        self.embed_scale = torch.tensor(self.config.hidden_size ** 0.5, device=device)

    def fuse_projections(self) -> None:
        """After loading: q/k/v and gate/up become one matmul each, and every norm computes its 1 + weight."""
        for layer in self.model.layers:
            layer.self_attn.fuse_projections()
            layer.mlp.fuse_projections()
        for module in self.modules():
            if isinstance(module, GemmaRMSNorm):
                module.prepare()

    def _apply(self, fn, recurse=True):
        result = super()._apply(fn, recurse)
        self._cpu_stack = None  # a move or cast changes the weights' addresses
        for module in self.modules():
            if isinstance(module, GemmaRMSNorm):
                module.scale = None  # a move or cast: recomputed from the weight on next use
        return result

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        return x * self.embed_scale.to(device=x.device, dtype=x.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed(input_ids)
        cos, sin = self.model.rotary_emb(positions, x.dtype)
        if x.is_cpu and cpu_stack.run_layers(self, x, cos[FULL], sin[FULL], kv_caches, meta,
                                             local=(cos[SLIDING], sin[SLIDING])):  # in place, one C call
            return self.model.norm(x)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv_cache, meta)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] fp32, soft-capped by final_logit_softcapping (Gemma 2) in the model's dtype,
        as transformers does."""
        if self.lm_head is None:
            logits = F.linear(hidden, self.model.embed_tokens.weight)
        else:
            logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = soft_cap(logits, cap)
        return logits.float()
