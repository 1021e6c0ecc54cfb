"""Linear layer factory and the CPU weight layout.

Every projection in the models is made here, so quantized layers can be swapped in without touching the
architectures. Checkpoints load into plain nn.Linear ([out, in] weights, Hugging Face names); on CPU the loader then
calls `use_transposed_weights`, which stores each fp weight as [in, out]: `x @ w_t` streams that layout in row order,
and at the one to few rows of a decode step it runs ~1.4x faster than nn.Linear's [out, in] layout (SmolLM2 shapes,
AVX2, one thread; `tests/benchmarks/bench_engine.py` shows the end-to-end effect).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def make_linear(
    in_features: int, out_features: int, bias: bool = False,
    dtype: torch.dtype | None = None, device: torch.device | str | None = None,
) -> nn.Module:
    """A layer mapping [..., in_features] -> [..., out_features] whose parameters are named `weight` ([out, in])
    and optionally `bias` (the Hugging Face names, so checkpoints load by name)."""
    return nn.Linear(in_features, out_features, bias=bias, dtype=dtype, device=device)


class TransposedLinear(nn.Module):
    """y = x @ weight_t (+ bias), weight_t [in, out] contiguous."""

    def __init__(self, weight_t: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = weight_t.shape
        self.weight_t = nn.Parameter(weight_t, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return torch.matmul(x, self.weight_t)
        return torch.addmm(self.bias, x.reshape(-1, self.in_features), self.weight_t).view(*x.shape[:-1], -1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class TransposedEmbedding(nn.Module):
    """Token embeddings read from a tied head's [hidden, vocab] matrix, so a tied model keeps one copy of it."""

    def __init__(self, head: TransposedLinear):
        super().__init__()
        self.head = [head]  # a list, so the shared parameter is not registered (and counted) twice

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.head[0].weight_t.t())


def use_transposed_weights(model: nn.Module) -> None:
    """Swap every plain fp nn.Linear for a TransposedLinear (quantized layers keep their own layout)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.is_floating_point():
                setattr(parent, name, _transposed(child.weight, child.bias))


def transposed_tied_head(model: nn.Module) -> None:
    """A tied model on CPU (lm_head None, fp embeddings): the table becomes a TransposedLinear head, and the
    embeddings read from it, so it is held once (llmd.model.loader.LoadPipeline.tie_output_head decides when)."""
    head = _transposed(model.model.embed_tokens.weight, None)
    model.lm_head = head
    model.model.embed_tokens = TransposedEmbedding(head)


def _transposed(weight: torch.Tensor, bias: torch.Tensor | None) -> TransposedLinear:
    weight_t = weight.detach().t().contiguous()
    # free the [out, in] copy now, not when the module goes (on the same device: a meta skeleton too can be laid out)
    weight.data = torch.empty(0, dtype=weight.dtype, device=weight.device)
    return TransposedLinear(weight_t, bias)
