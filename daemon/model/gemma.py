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

Which path runs what: these modules, with the ops of llmd.model.ops (RMSNorm, RoPE, GELU-tanh * up: C on the CPU)
and each quantized layer's kernel chosen at load, as for Llama. One exception, chosen once by the engine's runner: on
the CPU with int8/int4/GGUF weights, Gemma 2 and Gemma 3 run their layers as one C call (kernels/cpu_stack.c through
llmd.model.cpu_stack.CompiledCpuForward: the same kernel calls as these modules, so bit for bit the same;
tests/test_gemma.py and tests/test_cpu_stack.py hold it). fp weights and CUDA always run the modules.
Attention goes through the step's backend with the layer's window and softcap (llmd.model.attention_backends: the C
kernels on the CPU and the Triton kernels on CUDA take both).

Gemma 3's image-text checkpoints (Gemma3ForConditionalGeneration) load as their text model: `language_model.model.X`
(the hub's and transformers 5's names) or `model.language_model.X` (transformers 4's) is `model.X`; the vision tower
and projector are left to llmd.model.vision.gemma3 (`adapt_checkpoint`).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionMetadata, KVCache, paged_attention, with_image_embeds
from .config import ModelConfig
from .linear import make_linear
from .llama import CausalLM, RotaryEmbedding, packed_modules
from .ops import TORCH_OPS, Ops
from .weights import text_model_tensors

SLIDING, FULL = "sliding_attention", "full_attention"
# an image-text checkpoint's names: its text model's prefixes -> ours; the vision encoder's, unread here
_TEXT_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.",
                  "language_model.lm_head.": "lm_head."}
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), in fp32, cast back to x's dtype (Gemma3RMSNorm). `weight` keeps the checkpoint's
    name and value; the fp32 multiplier 1 + weight is computed once, on first use (`prepare`)."""

    ops: Ops = TORCH_OPS  # bound for the device when the model is prepared (llmd.model.ops)

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps
        self.scale: torch.Tensor | None = None

    def prepare(self) -> None:
        self.scale = (1.0 + self.weight.detach().float()).contiguous()

    def _apply(self, fn, recurse=True):
        self.scale = None  # a move or cast: recomputed from the weight on next use
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.scale
        if scale is None or scale.device != x.device:
            self.prepare()
            scale = self.scale
        if x.dtype == torch.float32:
            # (a strided q/k of a prefill chunk is copied first, so that the C op takes it, as the C layer stack does)
            return self.ops.rms_norm(x if x.is_contiguous() else x.contiguous(), scale, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * scale).to(x.dtype)


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(x / cap) * cap


class GemmaAttention(nn.Module):
    ops: Ops = TORCH_OPS

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
        self.qkv_proj = make_linear(hidden, q_size + 2 * kv_size, bias=config.attention_bias)
        self.o_proj = make_linear(q_size, hidden, bias=config.attention_bias)
        if config.qk_norm:
            self.q_norm: GemmaRMSNorm | None = GemmaRMSNorm(d, config.rms_norm_eps)
            self.k_norm: GemmaRMSNorm | None = GemmaRMSNorm(d, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        t, d, heads, kv_heads = x.shape[0], self.head_dim, self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x)
        v = qkv[:, (heads + kv_heads) * d :].view(t, kv_heads, d)
        if self.q_norm is None or self.k_norm is None:  # Gemma 2: q and k side by side, rotated as one view
            q, k = self.ops.rope(qkv, cos, sin, heads + kv_heads, d).split([heads, kv_heads], dim=1)
        else:  # Gemma 3: RMSNorm over each head of q and k before the rotation
            q = self.q_norm(qkv[:, : heads * d].view(t, heads, d)).view(t, -1)
            k = self.k_norm(qkv[:, heads * d : (heads + kv_heads) * d].view(t, kv_heads, d)).view(t, -1)
            q, k = self.ops.rope(q, cos, sin, heads, d), self.ops.rope(k, cos, sin, kv_heads, d)
        out = paged_attention(q, k, v, kv_cache, meta, self.scale, window=self.window, softcap=self.softcap)
        return self.o_proj(out.reshape(t, heads * d))


class GemmaMLP(nn.Module):
    """GeGLU: down(gelu_tanh(gate(x)) * up(x)), gate and up as one fused projection."""

    ops: Ops = TORCH_OPS

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.intermediate_size = n = config.intermediate_size
        self.gate_up_proj = make_linear(config.hidden_size, 2 * n, bias=config.mlp_bias)
        self.down_proj = make_linear(n, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.gelu_mul(self.gate_up_proj(x), self.intermediate_size))


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
    """Decoder + LM head, the interface of llmd.model.llama.CausalLM (fused q/k/v and gate/up routed from the
    checkpoint's names, embed / run_layers for the runner's compiled forward): forward(input_ids[T], positions[T],
    kv_caches, meta) -> final hidden states [T, hidden]; compute_logits(hidden) -> fp32 logits (soft-capped where
    configured)."""

    graph_blocker = "Gemma's windowed / soft-capped attention has no CUDA-graph-safe kernel yet"
    cpu_stack_kind = "gemma"  # llmd.model.cpu_stack builds Gemma 2's and 3's layers as one C call
    awq_calibration = False  # llmd.model.awq assumes Llama's norms: int4 is quantized weight by weight (loader)
    checkpoint_parts = CausalLM.checkpoint_parts
    route = CausalLM.route
    covers = CausalLM.covers

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = GemmaModel(config)
        self.lm_head = None if config.tie_word_embeddings else make_linear(config.hidden_size, config.vocab_size)
        self.packed_modules = packed_modules(config)
        # sqrt(hidden) as transformers holds it (an fp32 tensor), cast to the activations' dtype when used
        self.embed_scale = torch.tensor(config.hidden_size ** 0.5)

    def init_buffers(self, device: torch.device | str) -> None:
        self.model.rotary_emb.init_buffers(device)
        self.embed_scale = torch.tensor(self.config.hidden_size ** 0.5, device=device)

    def adapt_checkpoint(self, tensors: Iterable, source: object = None) -> Iterator:
        """An image-text checkpoint read as its text model (see the module docstring); any other as it is."""
        return text_model_tensors(tensors, _TEXT_PREFIXES, _VISION_PREFIXES)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata | None = None
              ) -> tuple[torch.Tensor, dict, dict]:
        """The scaled token embeddings [T, hidden] and the RoPE tables per layer type (GemmaRotaryEmbedding)."""
        x = self.model.embed_tokens(input_ids)
        x = with_image_embeds(x * self.embed_scale.to(device=x.device, dtype=x.dtype), meta)
        cos, sin = self.model.rotary_emb(positions, x.dtype)
        return x, cos, sin

    def run_layers(self, x: torch.Tensor, cos: dict, sin: dict, kv_caches: list[KVCache],
                   meta: AttentionMetadata) -> torch.Tensor:
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv_cache, meta)
        return x

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        x, cos, sin = self.embed(input_ids, positions, meta)
        return self.model.norm(self.run_layers(x, cos, sin, kv_caches, meta))

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
