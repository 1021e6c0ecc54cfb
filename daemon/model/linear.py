"""Linear layer factory: every projection in the models is made here, so quantized layers can be swapped in later
without touching the architectures."""

from __future__ import annotations

import torch
from torch import nn


def make_linear(
    in_features: int, out_features: int, bias: bool = False,
    dtype: torch.dtype | None = None, device: torch.device | str | None = None,
) -> nn.Module:
    """A layer mapping [..., in_features] -> [..., out_features] whose parameters are named `weight` ([out, in])
    and optionally `bias` (the Hugging Face names, so checkpoints load by name). Plain nn.Linear for now."""
    return nn.Linear(in_features, out_features, bias=bias, dtype=dtype, device=device)
