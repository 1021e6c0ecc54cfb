"""Lookup tables that stay in host memory when the model runs on a GPU.

Gemma 4 E2B / E4B's per-layer embedding table (llmd.model.gemma4: embed_tokens_per_layer) is most of the model's
bytes and is read one row per token, so it is not worth GPU memory. Rules:
- `HostResident` (mixed into the table's module class) keeps the module's tensors on the CPU whatever the model is
  moved to (`to`, `to_empty`, `cuda`): the move's dtype still applies, its device does not; on the meta device (the
  loader's skeleton) the tensors stay meta.
- its forward looks the rows up on the CPU (a packed GGUF table: llmd.model.quant.GGUFEmbedding, dequantizes only
  those rows there) and copies just them to the device of the token ids, from pinned memory without blocking.
- `host_weight_bytes` counts such tensors of a model on CUDA: the loader reports them apart (LoadReport.host_bytes),
  so the model manager does not charge them to the GPU's memory budget.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

HOST = torch.device("cpu")


def _on_host(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """`fn` (a Module._apply conversion) with its dtype kept and its device replaced by the CPU's."""

    def apply(t: torch.Tensor) -> torch.Tensor:
        probe = fn(torch.empty(0, dtype=t.dtype, device=t.device))  # what fn does to a tensor like t, on no data
        if probe.is_meta:  # the loader's skeleton stays a skeleton
            return fn(t)
        if t.is_meta:  # to_empty: allocated, unfilled, on the host
            return torch.empty_like(t, dtype=probe.dtype, device=HOST)
        return t.to(device=HOST, dtype=probe.dtype)

    return apply


class HostResident(nn.Module):
    """Mixed in before a lookup module's class: its tensors stay on the CPU and forward(token ids) returns the rows
    on the ids' device (see the module docstring)."""

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        return super()._apply(_on_host(fn), recurse)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = super().forward(input_ids.to(HOST))  # type: ignore[misc]
        if input_ids.device.type != "cuda":
            return rows.to(input_ids.device)
        # pinned (PyTorch's caching host allocator: reused, and not handed out again before the copy is done)
        return rows.pin_memory().to(input_ids.device, non_blocking=True)


class HostEmbedding(HostResident, nn.Embedding):
    """An nn.Embedding that stays in host memory (its parameter keeps nn.Embedding's name, `weight`)."""


def host_weight_bytes(model: nn.Module) -> int:
    """Bytes of the HostResident modules' tensors of a model whose other weights are on a GPU (0 for a model on the
    CPU: there everything is host memory)."""
    if not any(p.is_cuda for p in model.parameters()):
        return 0
    seen, total = set(), 0
    for module in model.modules():
        if isinstance(module, HostResident):
            for t in [*module.parameters(), *module.buffers()]:
                if not t.is_cuda and not t.is_meta and t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    total += t.numel() * t.element_size()
    return total
