"""The int8 KV cache: symmetric per-token, per-head quantization of K and V, and the gather every reader goes through.

A layer's cache is either a plain pair (k_cache, v_cache) in the model dtype ("auto") or a named float type ("fp32",
"fp16", "bf16"), or an `Int8KVCache` ("int8"):
the same [num_blocks, block_size, kv_heads, head_dim] layout holding int8 values, plus one fp32 scale per
(block, offset, kv_head) for K and for V, so that x ~= q * scale with q in [-127, 127].

Why per token and per head: a token's K/V are written once, when it is computed, so its scale never changes
afterwards (a per-block scale would have to re-quantize earlier tokens when a larger value arrives), and the result
does not depend on what else is in the batch. fp32 scales cost 4 bytes per 64-128 values (3-6 %) and never
underflow, unlike fp16 ones for near-zero heads.

An Int8KVCache is a 4-tuple: code that unpacks a cache as `k_cache, v_cache = kv_cache` fails loudly on it instead
of silently reading int8 numbers as values.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..engine.types import KvCacheDtype, choices
from .huge_pages import huge_page_tensors

KV_CACHE_DTYPES = choices(KvCacheDtype)  # the engine's vocabulary (llmd.engine.types), not a second list
SCALE_DTYPE = torch.float32
_FLOAT_KV = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element type of a cache: the model's for "auto", the named one for fp32/fp16/bf16, int8 for "int8"."""
    if kv_cache_dtype == "int8":
        return torch.int8
    return _FLOAT_KV.get(kv_cache_dtype, model_dtype)


class Int8KVCache(NamedTuple):
    k: torch.Tensor  # int8 [num_blocks, block_size, kv_heads, head_dim]
    v: torch.Tensor
    k_scale: torch.Tensor  # fp32 [num_blocks, block_size, kv_heads]
    v_scale: torch.Tensor


def kv_parts(kv_cache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(k, v, k_scale, v_scale) of either kind of layer cache; the scales are None for an fp cache."""
    if isinstance(kv_cache, Int8KVCache):
        return kv_cache
    k, v = kv_cache
    return k, v, None, None


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (int8 values [..., head_dim], fp32 scales [...]): symmetric, one scale per row.
    A row of zeros gets scale 0 and dequantizes to exact zeros."""
    x = x.to(torch.float32)
    amax = x.abs().amax(dim=-1)
    scale = amax / 127.0
    inv = 127.0 / amax.clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(x * inv.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 [..., head_dim] times fp32 scales [...] -> `dtype` (computed in fp32, rounded once)."""
    return (q.to(torch.float32) * scale.unsqueeze(-1)).to(dtype)


def gather_blocks(cache: torch.Tensor, scale: torch.Tensor | None, block_ids: torch.Tensor,
                  dtype: torch.dtype) -> torch.Tensor:
    """Whole blocks `block_ids` [n] of one K or V cache as [n, block_size, kv_heads, head_dim] in `dtype`,
    dequantized when `scale` is given. The one place a torch reader turns cache contents into values."""
    blocks = torch.index_select(cache, 0, block_ids)
    if scale is None:
        return blocks.to(dtype)
    return dequantize_int8(blocks, torch.index_select(scale, 0, block_ids), dtype)


def write_int8(k: torch.Tensor, v: torch.Tensor, kv_cache: Int8KVCache, slot_mapping: torch.Tensor) -> None:
    """Quantize the new tokens' K/V ([T, kv_heads, head_dim]) and store values and scales into their slots."""
    num_blocks, block_size = kv_cache.k.shape[:2]
    slots = num_blocks * block_size
    for x, data, scale in ((k, kv_cache.k, kv_cache.k_scale), (v, kv_cache.v, kv_cache.v_scale)):
        q, s = quantize_int8(x)
        data.view(slots, *data.shape[2:]).index_copy_(0, slot_mapping, q)
        scale.view(slots, scale.shape[2]).index_copy_(0, slot_mapping, s)


def bytes_per_token(num_kv_heads: int, head_dim: int, dtype: torch.dtype, kv_cache_dtype: str) -> int:
    """Bytes one token's K and V take in one layer's cache, scales included."""
    if kv_cache_dtype == "int8":
        return 2 * num_kv_heads * (head_dim + torch.empty((), dtype=SCALE_DTYPE).element_size())
    return 2 * num_kv_heads * head_dim * torch.empty((), dtype=cache_dtype(kv_cache_dtype, dtype)).element_size()


def allocate_int8(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                  device: torch.device | str) -> Int8KVCache:
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if torch.device(device).type == "cpu":  # zeroed huge pages (llmd.model.huge_pages), faulted in as blocks fill
        return Int8KVCache(*huge_page_tensors([(shape, torch.int8)] * 2 + [(shape[:3], SCALE_DTYPE)] * 2))

    def zeros(*s, dtype):
        return torch.zeros(s, dtype=dtype, device=device)

    return Int8KVCache(zeros(*shape, dtype=torch.int8), zeros(*shape, dtype=torch.int8),
                       zeros(*shape[:3], dtype=SCALE_DTYPE), zeros(*shape[:3], dtype=SCALE_DTYPE))
