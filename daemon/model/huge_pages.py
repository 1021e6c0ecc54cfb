"""Packed weights and KV caches in host memory backed by transparent huge pages.

A CPU decode step streams every packed weight once (0.7 GB a token for a 1B Q4_K_M). On 4 KiB pages that is a TLB
miss every few KiB and a hardware prefetcher that stops at each page boundary: the interleaved matmul tiles stream
16 GB/s where 2 MiB pages let them reach 18-19 (Zen 1, two cores). Linux gives anonymous memory huge pages where the
process asks (madvise, the default of /sys/kernel/mm/transparent_hugepage/enabled), and only in 2 MiB-aligned spans,
so the quantized layers' tensors (their codes, scales and zeros: what the matmuls read) are laid side by side in one
anonymous mapping that starts on a 2 MiB boundary and is advised before anything touches it. The CPU's KV caches
come from such a mapping too (llmd.model.attention.allocate_kv_cache, int8 ones included), so their pages are
faulted in as blocks fill rather than zeroed up front (decode at 2k tokens of context measured the same speed either
way). Elsewhere (a kernel without THP, or set to never) the advice is refused and the same mapping has ordinary
pages: nothing else changes.

The weights are placed while they are unfilled (right after the skeleton is allocated), so placing copies nothing;
a mapping is freed with the last tensor that views it. fp weights are left where they are: the CPU loader replaces
them by transposed copies after filling, which would strand their bytes in the mapping.
"""

from __future__ import annotations

import logging
import math
import mmap
from typing import Sequence

import torch
from torch import nn

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_ALIGN = 64  # each tensor's start: a cache line (and an AVX-512 vector)


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """nbytes of zeroed uint8 host memory starting on a 2 MiB boundary, in whole huge pages advised for transparent
    huge pages where the kernel offers them (at most 2 MiB more than asked; a view of its own anonymous mapping, kept
    alive by the tensors that view it)."""
    span = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    mapping = mmap.mmap(-1, span + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping: unmapped when the last view goes
    skip = -whole.data_ptr() % HUGE_PAGE
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE, skip, span)
    except (AttributeError, OSError) as e:  # no THP in this kernel (or not Linux): ordinary pages
        log.debug("no huge pages: %s", e)
    return whole[skip:skip + nbytes]


def packed_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every buffer of the model's quantized layers (a module holding a `qweight`: GGUF blocks, int8/int4 codes, and
    their scales and zeros), each tensor once."""
    found: dict[int, torch.Tensor] = {}
    for module in model.modules():
        if isinstance(module._buffers.get("qweight"), torch.Tensor):
            found.update((id(t), t) for t in module._buffers.values() if t is not None and t.numel())
    return list(found.values())


def huge_page_tensors(specs: Sequence[tuple[Sequence[int], torch.dtype]]) -> list[torch.Tensor]:
    """Zeroed host tensors of these (shape, dtype)s side by side, each 64-byte aligned, in one huge_page_buffer."""
    sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in specs]
    starts, total = [], 0
    for size in sizes:
        starts.append(total)
        total += -(-size // _ALIGN) * _ALIGN
    arena = huge_page_buffer(total)
    return [arena[at:at + size].view(dtype).view(tuple(shape))
            for (shape, dtype), at, size in zip(specs, starts, sizes, strict=True)]


def place_packed_on_huge_pages(model: nn.Module) -> None:
    """Re-home the quantized layers' unfilled host buffers (packed_tensors on the CPU; those on a GPU stay) into one
    huge-page buffer (huge_page_tensors). Their contents are not kept: call it between allocating the skeleton and
    filling it."""
    placed = [t for t in packed_tensors(model) if t.device.type == "cpu"]
    if not placed:
        return
    views = dict(zip((id(t) for t in placed), huge_page_tensors([(t.shape, t.dtype) for t in placed]), strict=True))
    for owner in model.modules():  # every module holding one of them (a table two modules share stays one tensor)
        for key, buf in owner._buffers.items():
            if buf is not None and id(buf) in views:
                owner._buffers[key] = views[id(buf)]
