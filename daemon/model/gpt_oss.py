"""gpt-oss (20b, 120b): the Llama decoder of llmd.model.llama with its quirks switched on by the config
(llmd.model.config.moe_fields): biases on q/k/v/o, a learned attention sink per head, window (128) and full layers
alternating, YaRN RoPE, and the MoE block (llmd.model.moe) with a biased router whose top-k logits are softmaxed and
biased experts with a clamped SwiGLU.

What this file adds is the Hugging Face checkpoint's own layout of the experts, turned into the block's on the way in
(`adapt_checkpoint`): gate_up_proj is [E, hidden, 2 * inter] with gate and up interleaved column by column, down_proj
[E, inter, hidden]. A GGUF file needs nothing: llama.cpp's converter already wrote [E, out, in] with gate and up
apart (ffn_gate_exps, ffn_up_exps).
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from .llama import CausalLM


def deinterleave(t: torch.Tensor) -> torch.Tensor:
    """[E, 2I, ...] with gate and up interleaved along dim 1 (gate at even rows) -> gate rows first, then up."""
    return torch.cat((t[:, 0::2], t[:, 1::2]), dim=1).contiguous()


class GptOssCausalLM(CausalLM):
    """CausalLM with gpt-oss's checkpoint layout adapted as it streams in."""

    def adapt_checkpoint(self, tensors: Iterable) -> Iterator:
        for item in tensors:
            if not isinstance(item, tuple):  # a packed GGUF tensor: already in the block's layout
                yield item
                continue
            name, t = item
            if name.endswith(".experts.gate_up_proj"):  # [E, hidden, 2I] interleaved -> [E, 2I, hidden], gate first
                yield name, deinterleave(t.transpose(1, 2))
            elif name.endswith(".experts.gate_up_proj_bias"):
                yield name, deinterleave(t)
            elif name.endswith(".experts.down_proj"):  # [E, I, hidden] -> [E, hidden, I]
                yield name, t.transpose(1, 2).contiguous()
            else:
                yield item
