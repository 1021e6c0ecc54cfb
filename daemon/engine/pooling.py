"""Pooling an embedding request's final hidden states (after the model's last norm) into one vector.

The chunks of a chunked prefill are joined before pooling, so the vector does not depend on where the scheduler
cut the prompt: a mean is taken once over all positions, in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .types import EmbedParams


def pool(chunks: list[torch.Tensor], params: EmbedParams) -> list[float]:
    """[n_i, hidden] chunks in prompt order -> the pooled vector, cut to `dimensions`, then L2-normalized."""
    if params.pooling == "last":
        vec = chunks[-1][-1].float()
    elif params.pooling == "cls":
        vec = chunks[0][0].float()
    else:
        vec = torch.cat(chunks).float().mean(dim=0)
    if params.dimensions is not None:
        vec = vec[: params.dimensions]
    if params.normalize:
        vec = F.normalize(vec, dim=0)
    return vec.tolist()
