"""gpt-oss (20b, 120b): the Llama decoder of llmd.model.llama with its quirks switched on by the config
(llmd.model.config.moe_fields): biases on q/k/v/o, a learned attention sink per head, window (128) and full layers
alternating, YaRN RoPE, and the MoE block (llmd.model.moe) with a biased router whose top-k logits are softmaxed and
biased experts with a clamped SwiGLU.

What this file adds is the Hugging Face checkpoint's own layout of the experts, turned into the block's on the way in
(`adapt_checkpoint`): gate_up_proj is [E, hidden, 2 * inter] with gate and up interleaved column by column, down_proj
[E, inter, hidden]; the released checkpoints hold them as MXFP4 instead (`*_blocks` [E, out, in/32, 16] and
`*_scales` [E, out, in/32], out interleaved the same way), which become GGUF MXFP4 rows (llmd.model.quant.mxfp4) kept
packed in the experts' layers (`packed_expert_types` tells the loader before any weight is read). A GGUF file needs
nothing: llama.cpp's converter already wrote [E, out, in] with gate and up apart (ffn_gate_exps, ffn_up_exps).
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from ..errors import ModelFileError
from .llama import CausalLM
from .quant.mxfp4 import mxfp4_blocks_from_hf

_MXFP4_SUFFIXES = ("_blocks", "_scales")


def packed_expert_types(names: Iterable[str]) -> dict[str, str]:
    """The experts' stacked weight names (llmd.model.moe) a checkpoint holds as MXFP4 -> "MXFP4"."""
    out = {}
    for name in names:
        if name.endswith(".experts.gate_up_proj_blocks"):
            prefix = name.removesuffix(".gate_up_proj_blocks")
            out[f"{prefix}.gate_proj.weight"] = out[f"{prefix}.up_proj.weight"] = "MXFP4"
        elif name.endswith(".experts.down_proj_blocks"):
            out[f"{name.removesuffix('_blocks')}.weight"] = "MXFP4"
    return out


def deinterleave(t: torch.Tensor) -> torch.Tensor:
    """[E, 2I, ...] with gate and up interleaved along dim 1 (gate at even rows) -> gate rows first, then up."""
    return torch.cat((t[:, 0::2], t[:, 1::2]), dim=1).contiguous()


class GptOssCausalLM(CausalLM):
    """CausalLM with gpt-oss's checkpoint layout adapted as it streams in."""

    packed_types = staticmethod(packed_expert_types)

    def adapt_checkpoint(self, tensors: Iterable, source: object = None) -> Iterator:
        halves: dict[str, dict[str, torch.Tensor]] = {}  # an MXFP4 weight's blocks or scales, until the other comes
        for item in tensors:
            if not isinstance(item, tuple):  # a packed GGUF tensor: already in the block's layout
                yield item
                continue
            name, t = item
            if name.endswith(_MXFP4_SUFFIXES) and ".experts." in name:
                weight, suffix = name[:-7], name[-7:]
                pair = halves.setdefault(weight, {})
                pair[suffix] = t
                if len(pair) == 2:
                    del halves[weight]
                    yield from self._mxfp4(weight, pair["_blocks"], pair["_scales"], source)
                continue
            if name.endswith(".experts.gate_up_proj"):  # [E, hidden, 2I] interleaved -> [E, 2I, hidden], gate first
                yield name, deinterleave(t.transpose(1, 2))
            elif name.endswith(".experts.gate_up_proj_bias"):
                yield name, deinterleave(t)
            elif name.endswith(".experts.down_proj"):  # [E, I, hidden] -> [E, hidden, I]
                yield name, t.transpose(1, 2).contiguous()
            else:
                yield item
        for weight, pair in halves.items():  # a weight whose other half never came
            missing = next(s for s in _MXFP4_SUFFIXES if s not in pair)
            raise ModelFileError(source, f"tensor {weight + missing!r} is missing (MXFP4 needs blocks and scales)")

    def _mxfp4(self, weight: str, blocks: torch.Tensor, scales: torch.Tensor, source: object) -> Iterator:
        """An expert weight's MXFP4 halves -> packed GGUF rows under the block's stacked names (RawTensor)."""
        from .gguf import RawTensor

        rows = mxfp4_blocks_from_hf(blocks, scales, weight, source)  # [E, out, row bytes]
        e, out, in_features = rows.shape[0], rows.shape[1], blocks.shape[-2] * 32
        prefix, _, proj = weight.rpartition(".")
        if proj == "down_proj":
            yield RawTensor(f"{weight}.weight", "MXFP4", (e, out, in_features), rows.reshape(e * out, -1).numpy())
            return
        rows = deinterleave(rows)
        half = out // 2
        for part, start in (("gate_proj", 0), ("up_proj", half)):
            data = rows[:, start:start + half].reshape(e * half, -1).numpy()
            yield RawTensor(f"{prefix}.{part}.weight", "MXFP4", (e, half, in_features), data)
