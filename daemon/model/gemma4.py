"""Gemma 4 text (Gemma4ForCausalLM, and the text model of Gemma4ForConditionalGeneration): E2B / E4B, 31B and the
26B-A4B mixture of experts, written for the engine like llmd.model.gemma, following transformers' modeling_gemma4
(the reference the tests compare against).

What differs from Gemma 3:
- RMSNorms multiply by weight (not 1 + weight); q and k are normed, v too (without a weight); attention scale 1;
- per-layer head shapes: the full-attention (global) layers have wider heads (global_head_dim) and, with
  attention_k_eq_v, fewer KV heads and no v_proj (V is the K projection before its norm); the engine keeps each
  layer's cache in its own shape (ModelConfig.layer_head_dim / layer_num_kv_heads);
- RoPE: sliding layers plain (rope_local_theta), global layers "proportional": the first rope_proportion of the
  frequencies of a full-width rotate-half RoPE turn (exponents over head_dim), the rest are zero (pass through);
- KV sharing: the last num_kv_shared_layers layers attend over the K/V of the last earlier layer of their kind and
  store none (ModelConfig.kv_sources: the engine gives them that layer's cache; paged_attention writes nothing);
  on E-models their MLPs are twice as wide (use_double_wide_mlp);
- per-layer embeddings (E-models): a second table [per-layer vocab, layers * P] whose row, scaled by sqrt(P), is added
  to a projection of the token's embedding (normed, scaled by hidden^-0.5), the sum times 2^-0.5 feeding each layer
  its P-wide slice: after the MLP, x += norm(proj(gelu(gate(x)) * slice)). The table stays in host memory on a GPU
  (llmd.model.host_table: looked up on the CPU, only the rows copied over);
- every layer's output is multiplied by its learned `layer_scalar`;
- 26B-A4B: beside the dense MLP, an MoE block (llmd.model.moe's Experts, GELU-tanh) routed from the layer's residual
  by a router of its own (RMSNorm without weight, times `scale` and hidden^-0.5, softmax, top k renormalised, times
  the chosen experts' per_expert_scale); each branch has its own norms and the two are summed;
- final logit soft-capping.

Which path runs what: these modules, with the ops of llmd.model.ops (RMSNorms, RoPE, GELU-tanh * up: C on the CPU
in fp32, V's weightless norm the C RMSNorm times ones), as for Gemma 3; on the CPU with int8/int4/GGUF weights the
dense models' layers (not 26B-A4B's) run as one C call instead (kernels/cpu_stack.c through
llmd.model.cpu_stack.CompiledCpuForward, from `embed` / `run_layers`: the same kernel calls as these modules, so bit
for bit the same; tests/test_cpu_stack.py holds it).

Gemma 4's image-text checkpoints (Gemma4ForConditionalGeneration) load as their text model: `model.language_model.X`
is `model.X`; the vision tower, audio tower and their embedders are left unread (`adapt_checkpoint`; the vision tower
is llmd.model.vision.gemma4's). An image's tokens read the tower's embeddings (their per-layer embeddings are the pad
token's, as transformers' Gemma4Model gives them); with use_bidirectional_attention "vision" they attend to each
other both ways in the sliding layers, within the window, and causally in the global layers (transformers'
create_masks_for_vision_model; `_image_metas`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionMetadata, KVCache, paged_attention, with_image_embeds
from .config import ModelConfig
from .gemma import soft_cap
from .host_table import HostEmbedding
from .linear import make_linear
from .llama import CausalLM
from .moe import Experts
from .ops import TORCH_OPS, Ops
from .weights import text_model_tensors

FULL = "full_attention"
_TEXT_PREFIX = "model.language_model."
_OTHER_PARTS = tuple(p + part for p in ("model.", "") for part in ("vision_tower.", "embed_vision.", "audio_tower.",
                                                                     "embed_audio."))


class Gemma4RMSNorm(nn.Module):
    """x / rms(x) * weight in fp32, cast back to x's dtype; without a weight (v_norm, the router's): x / rms(x), in
    fp32 the op's RMSNorm times ones (exactly x / rms(x) in the op's arithmetic, which the C layer stack repeats)."""

    ops: Ops = TORCH_OPS

    def __init__(self, size: int, eps: float, with_scale: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size)) if with_scale else None
        self.eps = eps
        self.size = size
        self._ones: torch.Tensor | None = None  # the weightless norm's multiplier (not a parameter: no checkpoint name)

    def ones(self, device: torch.device) -> torch.Tensor:
        if self._ones is None or self._ones.device != device:
            self._ones = torch.ones(self.size, device=device)
        return self._ones

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            weight = self.weight if self.weight is not None else self.ones(x.device)
            return self.ops.rms_norm(x if x.is_contiguous() else x.contiguous(), weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h if self.weight is None else h * self.weight.float()).to(x.dtype)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class Gemma4Rotary(nn.Module):
    """cos and a signed sin [T, 1, d] per layer kind: plain RoPE for the sliding layers, proportional for the global
    ones (see the module docstring)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.inv_freq: dict[str, torch.Tensor] = {}

    def init_buffers(self, device: torch.device | str) -> None:
        c = self.config
        assert c.gemma4 is not None and c.layer_types is not None
        for kind in set(c.layer_types):
            d = c.layer_head_dim(c.layer_types.index(kind))
            theta, share = (c.rope_theta, c.gemma4.rope_proportion) if kind == FULL else (c.rope_local_theta, 1.0)
            turning = int(share * d // 2)
            inv = 1.0 / (theta ** (torch.arange(0, 2 * turning, 2, dtype=torch.float32, device=device) / d))
            self.inv_freq[kind] = torch.cat((inv, torch.zeros(d // 2 - turning, device=device)))

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        out = {}
        for kind, inv in self.inv_freq.items():
            freqs = positions.float().unsqueeze(-1) * inv.to(positions.device).unsqueeze(0)
            cos, sin = freqs.cos(), freqs.sin()
            out[kind] = (torch.cat((cos, cos), -1).to(dtype).unsqueeze(1),
                         torch.cat((-sin, sin), -1).to(dtype).unsqueeze(1))
        return out


class Gemma4Attention(nn.Module):
    ops: Ops = TORCH_OPS

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        assert config.gemma4 is not None and config.layer_types is not None
        self.kind = config.layer_types[layer_idx]
        self.window = config.layer_window(layer_idx)
        self.num_heads, self.head_dim = config.num_attention_heads, config.layer_head_dim(layer_idx)
        self.num_kv_heads = config.layer_num_kv_heads(layer_idx)
        hidden, q, kv = config.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = make_linear(hidden, q, bias=config.attention_bias)
        self.q_norm = Gemma4RMSNorm(self.head_dim, config.rms_norm_eps)
        self.o_proj = make_linear(q, hidden, bias=config.attention_bias)
        self.shares_kv = config.kv_source(layer_idx) != layer_idx  # reads an earlier layer's K/V, stores none
        if not self.shares_kv:
            self.k_proj = make_linear(hidden, kv, bias=config.attention_bias)
            k_eq_v = config.gemma4.k_eq_v and self.kind == FULL
            self.v_proj = None if k_eq_v else make_linear(hidden, kv, bias=config.attention_bias)
            self.k_norm = Gemma4RMSNorm(self.head_dim, config.rms_norm_eps)
            self.v_norm = Gemma4RMSNorm(self.head_dim, config.rms_norm_eps, with_scale=False)

    def forward(self, x: torch.Tensor, rope: dict, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        t, d, heads, kv_heads = x.shape[0], self.head_dim, self.num_heads, self.num_kv_heads
        cos, sin = rope[self.kind]
        # (the normed q and k are new tensors: the C RoPE rotates them in place)
        q = self.ops.rope(self.q_norm(self.q_proj(x).view(t, heads, d)).view(t, heads * d), cos, sin, heads, d)
        k = v = None
        if not self.shares_kv:
            raw = self.k_proj(x).view(t, kv_heads, d)
            v = self.v_norm(raw if self.v_proj is None else self.v_proj(x).view(t, kv_heads, d))
            k = self.ops.rope(self.k_norm(raw).view(t, kv_heads * d), cos, sin, kv_heads, d)
        out = paged_attention(q, k, v, kv_cache, meta, 1.0, window=self.window)
        return self.o_proj(out.reshape(t, self.num_heads * d))


class Gemma4MLP(nn.Module):
    ops: Ops = TORCH_OPS

    def __init__(self, config: ModelConfig, intermediate: int):
        super().__init__()
        self.gate_proj = make_linear(config.hidden_size, intermediate)
        self.up_proj = make_linear(config.hidden_size, intermediate)
        self.down_proj = make_linear(intermediate, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.gelu_mul_pair(self.gate_proj(x), self.up_proj(x)))


class Gemma4Router(nn.Module):
    """Each token's top-k experts and weights, from the layer's residual (see the module docstring)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        moe = config.moe
        assert moe is not None
        self.top_k, self.root = moe.top_k, config.hidden_size ** -0.5
        self.norm = Gemma4RMSNorm(config.hidden_size, config.rms_norm_eps, with_scale=False)
        self.proj = make_linear(config.hidden_size, moe.num_experts)
        self.scale = nn.Parameter(torch.ones(config.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(moe.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(self.proj(self.norm(x) * self.scale * self.root), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[ids], ids


class Gemma4DecoderLayer(nn.Module):
    ops: Ops = TORCH_OPS

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        g, eps, hidden = config.gemma4, config.rms_norm_eps, config.hidden_size
        assert g is not None
        self.self_attn = Gemma4Attention(config, layer_idx)
        wide = g.double_wide_mlp and self.self_attn.shares_kv
        self.mlp = Gemma4MLP(config, config.intermediate_size * (2 if wide else 1))
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, Gemma4RMSNorm(hidden, eps))
        self.layer_scalar = nn.Parameter(torch.ones(1))
        self.has_moe = config.moe is not None
        if self.has_moe:
            self.router = Gemma4Router(config)
            self.experts = Experts(hidden, config.moe)
            self.post_feedforward_layernorm_1 = Gemma4RMSNorm(hidden, eps)
            self.post_feedforward_layernorm_2 = Gemma4RMSNorm(hidden, eps)
            self.pre_feedforward_layernorm_2 = Gemma4RMSNorm(hidden, eps)
        self.per_layer = g.per_layer_input_size
        if self.per_layer:
            self.per_layer_input_gate = make_linear(hidden, self.per_layer)
            self.per_layer_projection = make_linear(self.per_layer, hidden)
            self.post_per_layer_input_norm = Gemma4RMSNorm(hidden, eps)

    def forward(self, x: torch.Tensor, per_layer: torch.Tensor | None, rope: dict, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, kv_cache, meta))
        h = self.mlp(self.pre_feedforward_layernorm(x))
        if self.has_moe:
            weights, ids = self.router(x)
            routed = self.experts(self.pre_feedforward_layernorm_2(x), ids, weights)
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(routed)
        x = x + self.post_feedforward_layernorm(h)
        if self.per_layer:
            h = self.ops.gelu_mul_pair(self.per_layer_input_gate(x), per_layer)
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(h))
        return x * self.layer_scalar


class Gemma4Model(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        g = config.gemma4
        assert g is not None
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Gemma4DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Gemma4RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = Gemma4Rotary(config)
        if g.per_layer_input_size:
            width = config.num_hidden_layers * g.per_layer_input_size
            self.embed_tokens_per_layer = HostEmbedding(g.per_layer_vocab, width)  # stays in host memory
            self.per_layer_model_projection = make_linear(config.hidden_size, width)
            self.per_layer_projection_norm = Gemma4RMSNorm(g.per_layer_input_size, config.rms_norm_eps)


class Gemma4CausalLM(nn.Module):
    """Decoder + LM head with llmd.model.llama.CausalLM's interface; a KV-sharing layer's kv_caches entry is the
    cache of the layer it reads."""

    graph_blocker = "Gemma's windowed attention has no CUDA-graph-safe kernel yet"
    cpu_stack_kind = "gemma4"  # llmd.model.cpu_stack builds the dense layers as one C call
    runs_given_layers = True  # forward runs the first len(kv_caches) layers (a truncated draft: llmd.engine.spec_draft)
    awq_calibration = False
    checkpoint_parts = CausalLM.checkpoint_parts
    route = CausalLM.route
    covers = CausalLM.covers

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = Gemma4Model(config)
        self.lm_head = None if config.tie_word_embeddings else make_linear(config.hidden_size, config.vocab_size)
        self.packed_modules: dict = {}  # q/k/v and gate/up stay apart: their widths differ from layer to layer

    def init_buffers(self, device: torch.device | str) -> None:
        self.model.rotary_emb.init_buffers(device)

    def _apply(self, fn, recurse=True):
        result = super()._apply(fn, recurse)
        self.model.rotary_emb.init_buffers(self.model.norm.weight.device)  # (a packed embedding has no .weight)
        return result

    def adapt_checkpoint(self, tensors: Iterable, source: object = None) -> Iterator:
        """An image-text checkpoint read as its text model (see the module docstring); any other as it is, the
        KV-sharing layers' unread k/v weights left out."""
        return text_model_tensors(tensors, {_TEXT_PREFIX: "model."}, _OTHER_PARTS, skip=self._unread_kv)

    def _unread_kv(self, name: str) -> bool:
        """A KV-sharing layer's own k/v weights, which hub checkpoints carry and nothing reads."""
        parts = name.split(".")
        if len(parts) < 5 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
            return False
        layer = int(parts[2])
        return (layer < self.config.num_hidden_layers and self.config.kv_source(layer) != layer
                and parts[3] == "self_attn" and parts[4] in ("k_proj", "v_proj", "k_norm", "v_norm"))

    def per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """Each token's per-layer inputs [T, layers, P] (None without per-layer embeddings)."""
        g, m = self.config.gemma4, self.model
        if not g.per_layer_input_size:
            return None
        shape = (x.shape[0], self.config.num_hidden_layers, g.per_layer_input_size)
        table = m.embed_tokens_per_layer(input_ids) * torch.tensor(g.per_layer_input_size ** 0.5).to(x.dtype)
        proj = m.per_layer_model_projection(x) * self.config.hidden_size ** -0.5
        return (m.per_layer_projection_norm(proj.reshape(shape)) + table.reshape(shape)) * 2.0 ** -0.5

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata | None = None
              ) -> tuple[torch.Tensor, dict, torch.Tensor | None]:
        """The scaled token embeddings [T, hidden], the RoPE tables per layer kind (Gemma4Rotary) and the per-layer
        inputs [T, layers, P] (None without per-layer embeddings): what the layers take (run_layers, and the C layer
        stack of llmd.model.cpu_stack)."""
        x = self.model.embed_tokens(input_ids)
        x = with_image_embeds(x * torch.tensor(self.config.hidden_size ** 0.5).to(x.dtype), meta)
        if meta is not None and meta.input_embeds is not None and self.config.gemma4.per_layer_input_size:
            input_ids = input_ids.index_fill(0, meta.input_embeds[0], self.config.gemma4.pad_token_id)
        per_layer = self.per_layer_inputs(input_ids, x)
        return x, self.model.rotary_emb(positions, x.dtype), per_layer

    def run_layers(self, x: torch.Tensor, rope: dict, per_layer: torch.Tensor | None, kv_caches: list[KVCache],
                   meta: AttentionMetadata) -> torch.Tensor:
        """The first len(kv_caches) layers on x."""
        metas = _image_metas(meta)
        for i, (layer, cache) in enumerate(zip(self.model.layers[: len(kv_caches)], kv_caches, strict=True)):
            x = layer(x, None if per_layer is None else per_layer[:, i], rope, cache, metas[layer.self_attn.kind])
        return x

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        x, rope, per_layer = self.embed(input_ids, positions, meta)
        return self.model.norm(self.run_layers(x, rope, per_layer, kv_caches, meta))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] fp32, soft-capped by final_logit_softcapping in the model's dtype."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else None
        logits = F.linear(hidden, weight) if weight is not None else self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        return (soft_cap(logits, cap) if cap is not None else logits).float()


def _image_metas(meta: AttentionMetadata) -> dict:
    """The step's metadata for each kind of layer: where images' tokens see each other both ways (a chunk holding
    such an image, meta.bidirectional), the global layers see them causally and the sliding layers both ways within
    their window (bidirectional_in_window); otherwise the step's own."""
    if meta is None or not meta.bidirectional:
        return {FULL: meta, "sliding_attention": meta}
    causal, sliding = copy.copy(meta), copy.copy(meta)
    causal.bidirectional = None
    if meta.window_group is None:
        sliding.bidirectional_in_window = True
    else:
        sliding.window_group = copy.copy(meta.window_group)
        sliding.window_group.bidirectional_in_window = True
    return {FULL: causal, "sliding_attention": sliding}
