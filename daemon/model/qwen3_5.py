"""Qwen3.5 / Qwen3.6 text (Qwen3_5ForCausalLM, and the text model of Qwen3_5ForConditionalGeneration) and
Qwen3.5-MoE (Qwen3_5MoeForCausalLM), written for the engine like llmd.model.llama, whose pieces it reuses (linear
layers, RoPE, the MLP, the MoE block, the paged-attention seam).

A hybrid: most layers are Gated DeltaNet layers (`linear_attention`: a recurrent state per sequence, held in the
engine's state pool, llmd.model.recurrent), every fourth one a gated full-attention layer (`full_attention`: paged KV
like any model). Following transformers' modeling_qwen3_5 (the reference the tests compare against):
- RMSNorms multiply by (1 + weight) in fp32 (as Gemma's: llmd.model.gemma.GemmaRMSNorm), q/k norms included;
- attention: q_proj yields, per head, the query and a gate; the output is o_proj(attention * sigmoid(gate)); RoPE on
  the first quarter of head_dim (partial rotary), multimodal: positions may come as [3, T], a token's (t, h, w)
  components (an image's tokens: its grid, llmd.engine.sequence.rope_positions), frequency i taking h where
  i % 3 == 1 and i < 3 * mrope_section[1], w where i % 3 == 2 and i < 3 * mrope_section[2], else t (interleaved, as
  transformers' Qwen3_5TextRotaryEmbedding); a text token's three are equal, which is plain RoPE of [T] positions;
- Gated DeltaNet: in_proj_qkv -> short causal conv (SiLU) -> q, k, v; beta = sigmoid(in_proj_b), the log decay
  g = -exp(A_log) * softplus(in_proj_a + dt_bias); the gated delta rule (llmd.model.recurrent.gated_delta_rule); a
  gated RMSNorm (norm(o) * weight * silu(z), z = in_proj_z) per value head; out_proj. Each q/k head serves
  consecutive value heads, or every Hk-th one in a GGUF file (llama.cpp's converter reorders the value heads; the
  model follows that order, RecurrentConfig.tiled_value_heads, so no packed weight is rearranged);
- Qwen3.5-MoE: config.moe set, every layer's MLP is llmd.model.moe.SparseMoE (softmax top-k renormalised, a shared
  expert scaled by sigmoid(shared_expert_gate)), as Qwen2-MoE's; but for MoEConfig.dense_layers (Qwen3-Next's
  mlp_only_layers: llmd.model.qwen3_next, which reuses these layers).
An image-text checkpoint's names (`model.language_model.*`) are read as the text model's, and its vision tower
(`model.visual.*`: llmd.model.vision.qwen3_5 reads it) and multi-token-prediction head (`mtp.*`) are left unread here
(`adapt_checkpoint`); the MTP draft reads the head on demand (llmd.model.qwen3_5_mtp).
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionMetadata, KVCache, paged_attention
from .config import ModelConfig
from .gemma import GemmaRMSNorm
from .linear import make_linear
from .llama import MLP, CausalLM, RotaryEmbedding, partial_rope
from .llama import packed_modules as llama_packed_modules
from .moe import SparseMoE
from .recurrent import RecurrentState, StateMetadata, causal_conv1d, gated_delta_rule
from .weights import text_model_tensors

_UNREAD_PREFIXES = ("model.visual.", "mtp.", "model.mtp.")


class MultimodalRotaryEmbedding(RotaryEmbedding):
    """RotaryEmbedding of [T] positions, or of [3, T] (t, h, w) positions with the frequencies interleaved by
    config.mrope_section (module docstring)."""

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.register_buffer("components", self._components(), persistent=False)

    def _components(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Which position component (0: t, 1: h, 2: w) each rotary frequency takes."""
        section, half = self.config.mrope_section or [0, 0, 0], self.config.rotary_dim // 2
        rows = [1 if i % 3 == 1 and i < 3 * section[1] else 2 if i % 3 == 2 and i < 3 * section[2] else 0
                for i in range(half)]
        return torch.tensor(rows, dtype=torch.long, device=device)

    def init_buffers(self, device: torch.device | str) -> None:
        super().init_buffers(device)
        self.components = self._components(device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().forward(positions, dtype)
        # each frequency's angle from its own component: the same products as for [T] positions when they agree
        freqs = positions.float().unsqueeze(-1) * self.inv_freq  # [3, T, d/2]
        freqs = freqs.gather(0, self.components.expand(1, positions.shape[1], -1))[0]
        cos, sin = freqs.cos() * self.attention_scaling, freqs.sin() * self.attention_scaling
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
        return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)


class GatedAttention(nn.Module):
    """Full attention whose output is gated per channel by sigmoid(gate), the gate coming from q_proj's rows."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                                            config.head_dim)
        self.rotary_dim = config.rotary_dim
        self.scale = self.head_dim ** -0.5
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = make_linear(config.hidden_size, 2 * q + 2 * kv, bias=config.attention_bias)
        self.o_proj = make_linear(q, config.hidden_size, bias=config.attention_bias)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        t, h, kvh, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        q_gate = qkv[:, : 2 * h * d].view(t, h, 2 * d)
        q, gate = q_gate[..., :d], q_gate[..., d:].reshape(t, h * d)
        k = qkv[:, 2 * h * d : (2 * h + kvh) * d].view(t, kvh, d)
        v = qkv[:, (2 * h + kvh) * d :].view(t, kvh, d)
        q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        q, k = partial_rope(q, cos, sin, self.rotary_dim), partial_rope(k, cos, sin, self.rotary_dim)
        out = paged_attention(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(t, h * d) * torch.sigmoid(gate))


class GatedRMSNorm(nn.Module):
    """RMSNorm of each value head, times weight, times silu(gate): cast to the input's dtype before the weight."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * h * F.silu(gate.float())).to(x.dtype)


class DepthwiseConv(nn.Module):
    """The short causal convolution's weights, [channels, 1, K] as the checkpoint's conv1d.weight (and its bias)."""

    def __init__(self, channels: int, kernel: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))
        self.bias = nn.Parameter(torch.empty(channels)) if bias else None


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        r = config.recurrent
        assert r is not None and r.kind == "gated_delta"
        self.num_k_heads, self.num_v_heads, self.k_dim, self.v_dim = r.num_key_heads, r.num_heads, r.key_head_dim, \
            r.head_dim
        self.tiled = r.tiled_value_heads and r.num_heads != r.num_key_heads
        key, value = self.num_k_heads * self.k_dim, self.num_v_heads * self.v_dim
        self.in_proj_qkv = make_linear(config.hidden_size, 2 * key + value)
        self.in_proj_z = make_linear(config.hidden_size, value)
        self.in_proj_b = make_linear(config.hidden_size, self.num_v_heads)
        self.in_proj_a = make_linear(config.hidden_size, self.num_v_heads)
        self.conv1d = DepthwiseConv(r.conv_channels, r.conv_kernel)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.v_dim, config.rms_norm_eps)
        self.out_proj = make_linear(value, config.hidden_size)

    def forward(self, x: torch.Tensor, state: RecurrentState, meta: StateMetadata) -> torch.Tensor:
        t, key = x.shape[0], self.num_k_heads * self.k_dim
        qkv = causal_conv1d(self.in_proj_qkv(x), self.conv1d.weight[:, 0], None, state.conv, meta)
        q = qkv[:, :key].view(t, self.num_k_heads, self.k_dim)
        k = qkv[:, key : 2 * key].view(t, self.num_k_heads, self.k_dim)
        v = qkv[:, 2 * key :].reshape(t, self.num_v_heads, self.v_dim)
        if self.tiled:  # value head j reads q/k head j % Hk: the q/k heads repeated whole, one per value head
            rep = self.num_v_heads // self.num_k_heads
            q, k = q.repeat(1, rep, 1), k.repeat(1, rep, 1)
        beta = torch.sigmoid(self.in_proj_b(x))
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        out = gated_delta_rule(q, k, v, g, beta, state.ssm, meta)
        out = self.norm(out, self.in_proj_z(x).view(t, self.num_v_heads, self.v_dim))
        return self.out_proj(out.reshape(t, self.num_v_heads * self.v_dim))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.recurrent = config.is_recurrent(layer_idx)
        if self.recurrent:
            self.linear_attn = GatedDeltaNet(config)
        else:
            self.self_attn = GatedAttention(config, layer_idx)
        moe = config.moe
        if moe is not None and moe.is_sparse(layer_idx):  # llmd.model.moe
            shared = MLP(config, moe.shared_intermediate_size) if moe.shared_intermediate_size else None
            self.mlp: nn.Module = SparseMoE(config, shared)
        else:
            self.mlp = MLP(config)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, cache, meta: AttentionMetadata):
        h = self.input_layernorm(x)
        if self.recurrent:
            x = x + self.linear_attn(h, cache, meta.state)
        else:
            x = x + self.self_attn(h, cos, sin, cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen35Model(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = MultimodalRotaryEmbedding(config)


class Qwen35CausalLM(nn.Module):
    """Decoder + LM head with llmd.model.llama.CausalLM's interface; kv_caches holds a KV cache for each attention
    layer and a RecurrentState for each Gated DeltaNet layer (meta.state says the step's slots)."""

    graph_blocker = "the recurrent layers' state is not captured in CUDA graphs yet"
    awq_calibration = False  # llmd.model.awq assumes Llama's layers
    checkpoint_parts = CausalLM.checkpoint_parts
    route = CausalLM.route
    covers = CausalLM.covers
    compute_logits = CausalLM.compute_logits
    embed = CausalLM.embed

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = Qwen35Model(config)
        self.lm_head = None if config.tie_word_embeddings else make_linear(config.hidden_size, config.vocab_size)
        self.packed_modules = packed_modules(config)

    def init_buffers(self, device: torch.device | str) -> None:
        self.model.rotary_emb.init_buffers(device)

    def adapt_checkpoint(self, tensors: Iterable, source: object = None) -> Iterator:
        """An image-text checkpoint read as its text model: `model.language_model.X` is `model.X`; the vision tower
        and the multi-token-prediction head are skipped."""
        return text_model_tensors(tensors, {"model.language_model.": "model."}, _UNREAD_PREFIXES)

    def run_layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, caches: list,
                   meta: AttentionMetadata) -> torch.Tensor:
        for layer, cache in zip(self.model.layers, caches, strict=True):
            x = layer(x, cos, sin, cache, meta)
        return x

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                meta: AttentionMetadata) -> torch.Tensor:
        x, cos, sin = self.embed(input_ids, positions, meta)
        return self.model.norm(self.run_layers(x, cos, sin, kv_caches, meta))


def packed_modules(config: ModelConfig) -> dict[str, tuple[str, slice]]:
    """Llama's (gate_proj, up_proj into gate_up_proj, a shared expert's likewise), but q_proj holds queries and
    gates: q_proj, k_proj, v_proj into qkv_proj at twice the query rows."""
    q, kv = 2 * config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    return {**llama_packed_modules(config),
            "self_attn.q_proj": ("self_attn.qkv_proj", slice(0, q)),
            "self_attn.k_proj": ("self_attn.qkv_proj", slice(q, q + kv)),
            "self_attn.v_proj": ("self_attn.qkv_proj", slice(q + kv, q + 2 * kv))}
