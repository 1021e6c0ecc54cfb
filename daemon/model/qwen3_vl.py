"""Qwen3-VL's text model (the language model of Qwen3VLForConditionalGeneration and, with Qwen3-MoE's blocks,
Qwen3VLMoeForConditionalGeneration), written for the engine as llmd.model.llama's CausalLM, whose Qwen3 layers it runs
(q/k RMSNorm; the MoE block where config.moe says). Following transformers' modeling_qwen3_vl (Qwen3VLTextModel, the
reference tests/test_vision_qwen3_vl.py compares against), it adds two things:
- multimodal RoPE over the whole head: positions may come as [3, T], a token's (t, h, w) (an image's tokens: its grid,
  llmd.engine.sequence.rope_positions), the frequencies interleaved by mrope_section as Qwen3.5's
  (llmd.model.qwen3_5.MultimodalRotaryEmbedding);
- DeepStack: an image's embeddings carry, after its input embeddings, config.deepstack_layers more feature rows
  ([tokens, hidden * (1 + deepstack_layers)], llmd.model.vision.qwen3_5); the k-th is added to the output of decoder
  layer k at the image's tokens. The step's rows are those of its own tokens (the runner slices an image's rows by the
  chunk, llmd.engine.runner), so chunked prefill adds exactly the features of the tokens it computes, and a prefix
  hit, which skips the image's tokens, reads their K/V as computed with the features.
Checkpoint names: `model.language_model.X` (or `language_model.model.X`) is `model.X`; the tower (`model.visual.*`)
is left to llmd.model.vision.qwen3_5. Qwen3-VL-MoE's fused experts (`mlp.experts.gate_up_proj`, `down_proj`) are
stored [experts, in, out] on the hub and [experts, out, in] by transformers 5: one whose shape is not the model's is
transposed, as transformers' own conversion does (so a square one is taken as it is, there too).
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from .attention import AttentionMetadata, KVCache
from .config import ModelConfig
from .llama import IMAGE_TEXT_RENAMES, CausalLM
from .qwen3_5 import MultimodalRotaryEmbedding
from .weights import text_model_tensors

_UNREAD = ("model.visual.", "visual.")


class Qwen3VLCausalLM(CausalLM):
    """CausalLM with multimodal RoPE and DeepStack (module docstring)."""

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.model.rotary_emb = MultimodalRotaryEmbedding(config)

    def adapt_checkpoint(self, tensors: Iterable, source: object = None) -> Iterator:
        moe = self.config.moe
        for item in text_model_tensors(tensors, IMAGE_TEXT_RENAMES, _UNREAD):
            if hasattr(item, "name"):  # a GGUF file's tensor (llama.cpp's converter stacks the experts its way)
                yield item
                continue
            name, tensor = item
            if moe is not None and name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
                hidden, wide = self.config.hidden_size, moe.intermediate_size
                out, into = (2 * wide, hidden) if name.endswith("gate_up_proj") else (hidden, wide)
                if tuple(tensor.shape) == (moe.num_experts, into, out) != (moe.num_experts, out, into):
                    tensor = tensor.transpose(1, 2).contiguous()
            yield name, tensor

    def run_layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_caches: list[KVCache],
                   meta: AttentionMetadata) -> torch.Tensor:
        rows, features = self.deepstack(meta)
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches, strict=True)):
            x = layer(x, cos, sin, kv_cache, meta)
            if i < len(features):
                x = x.index_add(0, rows, features[i].to(x.dtype))
        return x

    def deepstack(self, meta: AttentionMetadata | None) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """The step's image rows and, per DeepStack layer, their features [rows, hidden] (none: no image here)."""
        if meta is None or meta.input_embeds is None or not self.config.deepstack_layers:
            return None, []
        rows, embeds = meta.input_embeds
        hidden = self.config.hidden_size
        return rows, [embeds[:, hidden * (k + 1) : hidden * (k + 2)] for k in range(self.config.deepstack_layers)]
