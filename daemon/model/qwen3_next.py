"""Qwen3-Next (Qwen3NextForCausalLM, Qwen3-Next-80B-A3B): llmd.model.qwen3_5's layers, read from its own checkpoint
layout. Following transformers' modeling_qwen3_next, the model is Qwen3.5-MoE's but for:
- the Gated DeltaNet input projections, stored fused and grouped by key head: `in_proj_qkvz` holds, for each of the
  Hk key heads in turn, its query rows, its key rows, then the rows of the Hv / Hk value heads it serves and their
  gate (z) rows; `in_proj_ba` likewise each key head's Hv / Hk beta rows then its alpha rows. `adapt_checkpoint`
  splits them, once at load, into the in_proj_qkv (all queries, all keys, all values), in_proj_z, in_proj_b and
  in_proj_a that Qwen3.5's layer takes; the value heads keep their order (consecutive per key head, as Qwen3.5's HF
  checkpoints), so nothing else moves;
- one position per token (plain partial RoPE, no multimodal sections) and the MoE block of Qwen2-MoE, whose layers
  may be dense (llmd.model.config.qwen3_5_fields).
The RMSNorms are Qwen3.5's: (1 + weight), but the gated norm by weight. The multi-token-prediction head (`mtp.*`) is
left unread. llama.cpp's `qwen3next` GGUF files (llmd.model.gguf_hybrid) come with q/k/v and z already apart and beta
and alpha still fused (ssm_ba, named in_proj_ba here): split the same way, packed blocks row by row.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable, Iterator

import torch

from ..errors import ModelFileError
from .config import ModelConfig
from .qwen3_5 import Qwen35CausalLM
from .weights import text_model_tensors

_UNREAD_PREFIXES = ("mtp.", "model.mtp.")
_QKVZ, _BA = ".linear_attn.in_proj_qkvz.weight", ".linear_attn.in_proj_ba.weight"


class Qwen3NextCausalLM(Qwen35CausalLM):
    def adapt_checkpoint(self, tensors: Iterable, source: object = None) -> Iterator:
        """The fused linear-attention projections split into Qwen3.5's (module docstring); the MTP head skipped.
        Items are (name, tensor) pairs or GGUF RawTensors (split by their packed rows: a row's blocks are its own)."""
        for item in text_model_tensors(tensors, {}, _UNREAD_PREFIXES):
            raw = hasattr(item, "name")
            name, shape = (item.name, tuple(item.shape)) if raw else (item[0], tuple(item[1].shape))
            if not name.endswith((_QKVZ, _BA)):
                yield item
                continue
            for part, rows in split_rows(self.config, name, shape, source):
                if raw:
                    yield replace(item, name=part, shape=(len(rows), shape[1]), data=item.data[rows.numpy()])
                else:
                    yield part, item[1][rows]


def split_rows(config: ModelConfig, name: str, shape: tuple[int, ...],
               source: object) -> list[tuple[str, torch.Tensor]]:
    """in_proj_qkvz -> in_proj_qkv, in_proj_z; in_proj_ba -> in_proj_b, in_proj_a: each part's name and the fused
    tensor's rows it takes, in order. A tensor of another shape than the config gives is a ModelFileError naming it."""
    r = config.recurrent
    assert r is not None
    hk, dk, dv, per = r.num_key_heads, r.key_head_dim, r.head_dim, r.num_heads // r.num_key_heads
    qkvz = name.endswith(_QKVZ)
    group = 2 * dk + 2 * per * dv if qkvz else 2 * per  # one key head's rows
    want = (hk * group, config.hidden_size)
    if shape != want:
        raise ModelFileError(source, f"tensor {name!r} has shape {shape}, expected {want} ({hk} key heads, each "
                                     f"serving {per} value heads)")
    prefix = name[: -len(_QKVZ if qkvz else _BA)] + ".linear_attn."
    grouped = torch.arange(want[0]).view(hk, group)
    if qkvz:
        q, k, v, z = grouped.split([dk, dk, per * dv, per * dv], dim=1)
        return [(prefix + "in_proj_qkv.weight", torch.cat([q.flatten(), k.flatten(), v.flatten()])),
                (prefix + "in_proj_z.weight", z.flatten())]
    b, a = grouped.split([per, per], dim=1)
    return [(prefix + "in_proj_b.weight", b.flatten()), (prefix + "in_proj_a.weight", a.flatten())]
