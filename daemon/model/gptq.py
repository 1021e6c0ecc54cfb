"""GPTQ for llmd's int4 layout: quantize a weight so that the layer's *output* error on calibration inputs is small,
not just the weight error.

With X the layer's inputs ([T, K]) and H = X^T X, the output error of a weight change D is trace(D H D^T). GPTQ
rounds one input column at a time and spreads each column's rounding error over the columns not yet rounded, in the
proportions that minimise that error (the rows of the Cholesky factor of H^-1). Columns go in "act order" (largest
H diagonal, i.e. the most active inputs, first) so the important ones are rounded while the most freedom is left to
absorb their error; each group's scale and offset are fitted up front on the weights (clip search + least squares,
as the plain quantizer does) so the packed layout stays group-contiguous. (A least-squares refit of every row's
scales and offsets on the same output error, once the codes were fixed, lowered the calibration error but raised
SmolLM2-135M's held-out perplexity at int4-g64 from +7.0% to +9.5%: it overfits a few thousand tokens.)

Everything is plain fp32 arithmetic in a fixed order, so the same weight and H give the same bytes.
"""

from __future__ import annotations

import torch

from llmd.kernels import quant_matmul as qmm

from .quant import fit_int4_grid

DAMPING = 0.1  # added to H's diagonal, relative to its mean: a few hundred calibration tokens must not be overfitted
BLOCK = 16  # columns per lazy batch update: per-column updates stay short, the rest goes through one matmul


def input_hessian(x: torch.Tensor) -> torch.Tensor:
    """X^T X / T in fp32 for the layer inputs x [..., K]."""
    x = x.reshape(-1, x.shape[-1]).to(torch.float32)
    return (x.t() @ x) / max(1, x.shape[0])


def gptq_int4(weight: torch.Tensor, hessian: torch.Tensor, group_size: int, damping: float = DAMPING
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp [N, K] and H [K, K] -> (uint8 [N, K/2], scales [N, K/g], zeros [N, K/g]), the layout of quantize_int4."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"in_features {k} is not a multiple of the int4 group size {group_size}")
    w = weight.to(torch.float32)
    h = damped(hessian.to(device=w.device, dtype=torch.float32), damping)
    _, scale, low = fit_int4_grid(w.view(n, k // group_size, group_size))
    codes = _round_in_act_order(w, h, scale, low, group_size)
    return qmm.pack_int4(codes.to(torch.uint8)), scale, low + 8.0 * scale


def damped(hessian: torch.Tensor, damping: float) -> torch.Tensor:
    h = hessian.clone()
    diag = h.diagonal()
    diag[diag <= 0] = 1.0  # an input never active in calibration: no information about it either way
    diag.add_(damping * diag.mean())
    return h


def _round_in_act_order(w, h, scale, low, group_size) -> torch.Tensor:
    """Codes [N, K] (fp32, 0..15) for the grid (scale, low) [N, K/g], each column's error pushed onto later ones."""
    n, k = w.shape
    order = torch.argsort(h.diagonal(), descending=True, stable=True)
    u = _upper_cholesky_of_inverse(h[order][:, order])
    wt = w.t()[order].contiguous()  # [K, N]: one input column per row, so every update streams whole rows
    group_of = order // group_size
    scale_t, low_t = scale.t()[group_of].contiguous(), low.t()[group_of].contiguous()
    inv_scale_t = 1.0 / scale_t
    codes_t = torch.empty_like(wt)
    errors = torch.empty(BLOCK, n, dtype=torch.float32, device=w.device)
    for b0 in range(0, k, BLOCK):
        b1 = min(k, b0 + BLOCK)
        for i in range(b0, b1):
            q = torch.sub(wt[i], low_t[i]).mul_(inv_scale_t[i]).round_().clamp_(0, 15)
            codes_t[i] = q
            err = errors[i - b0]
            torch.addcmul(low_t[i], q, scale_t[i], out=err).sub_(wt[i]).div_(u[i, i])  # (rounded - w) / d
            wt[i + 1:b1].addr_(u[i, i + 1:b1], err)  # the block's later columns now
        wt[b1:].addmm_(u[b0:b1, b1:].t(), errors[:b1 - b0])  # all later columns once per block
    codes = torch.empty_like(codes_t)
    codes[order] = codes_t
    return codes.t()


def _upper_cholesky_of_inverse(h: torch.Tensor) -> torch.Tensor:
    """U with U^T U = H^-1; more damping is added if calibration left H too close to singular."""
    extra = 0.0
    mean = h.diagonal().mean()
    for _ in range(6):
        l, info = torch.linalg.cholesky_ex(h + extra * mean * torch.eye(h.shape[0], device=h.device))
        if not info:
            u, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(l), upper=True)
            if not info:
                return u
        extra = max(extra * 10, 0.01)
    raise ValueError("GPTQ: the calibration Hessian is not positive definite even with damping")
