"""llmd's own quantizers (fp tensor -> packed codes and scales): int8 per output channel, int4 group-wise with a clip
search and least-squares refits (AWQ and GPTQ use fit_int4_grid)."""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from llmd.kernels import quant_matmul as qmm

# Quantizers pick their grid per group (per row for int8) to minimise the squared reconstruction error: a min/max
# grid spends levels on rare outliers, so a few clipped ranges are tried and the best kept per group; int4 then
# refits scale and offset by least squares for the chosen codes. Ratio 1.0 (plain min/max) is always a candidate and
# a refit is only kept where it lowers the error, so the result is never worse than min/max.
INT4_CLIP_RATIOS = tuple(1.0 - 0.025 * i for i in range(13))  # 1.0 .. 0.7 of the min/max half-range
INT8_CLIP_RATIOS = tuple(1.0 - 0.01 * i for i in range(11))  # 1.0 .. 0.9 of max |w|
INT4_REFIT_STEPS = 2
_CHUNK_ELEMENTS = 1 << 22  # rows are quantized in chunks of about this many weights to bound the temporaries


def _row_chunks(n: int, row_elements: int) -> Iterator[slice]:
    rows = max(1, _CHUNK_ELEMENTS // max(1, row_elements))
    for start in range(0, n, rows):
        yield slice(start, min(n, start + rows))


def _best_clip(u: torch.Tensor, ratios: Iterable[float], offset: float, qmin: float, qmax: float) -> torch.Tensor:
    """u: weights in units of the unclipped step, centred ([..., group]); returns the ratio r per group whose grid
    q = clamp(round(u / r + offset)) reconstructs u best: sum(((q - offset) * r - u)^2). Ties keep the earlier."""
    buf = torch.empty_like(u)
    best_err = best_ratio = None
    for r in ratios:
        torch.mul(u, 1.0 / r, out=buf).add_(offset).round_().clamp_(qmin, qmax).sub_(offset).mul_(r).sub_(u).square_()
        err = buf.sum(-1)
        if best_err is None:
            best_err, best_ratio = err, torch.full_like(err, r)
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_ratio = torch.where(better, r, best_ratio)
    return best_ratio


def quantize_int8(weight: torch.Tensor, clip: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """fp [N, K] -> (int8 [N, K], fp32 scales [N, 1]); symmetric per output channel, clip ratio searched per row."""
    w_all = weight.to(torch.float32)
    n, k = w_all.shape
    q_out = torch.empty(n, k, dtype=torch.int8, device=weight.device)
    s_out = torch.empty(n, 1, dtype=torch.float32, device=weight.device)
    for rows in _row_chunks(n, k):
        w = w_all[rows]
        scales = (w.abs().amax(dim=1, keepdim=True) / 127.0).clamp_min(1e-10)
        if clip:
            scales = scales * _best_clip(w / scales, INT8_CLIP_RATIOS, 0.0, -127, 127).unsqueeze(-1)
        q_out[rows] = torch.round(w / scales).clamp_(-127, 127).to(torch.int8)
        s_out[rows] = scales
    return q_out, s_out


def quantize_int4(weight: torch.Tensor, group_size: int, clip: bool = True,
                  refit_steps: int = INT4_REFIT_STEPS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp [N, K] -> (uint8 [N, K/2], scales [N, K/g], zeros [N, K/g]) fp32; asymmetric per group.

    clip=False, refit_steps=0 is plain min/max rounding (the baseline the tests compare against)."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"in_features {k} is not a multiple of the int4 group size {group_size}")
    groups = k // group_size
    w_all = weight.to(torch.float32).view(n, groups, group_size)
    q_out = torch.empty(n, groups, group_size, dtype=torch.uint8, device=weight.device)
    s_out = torch.empty(n, groups, dtype=torch.float32, device=weight.device)
    z_out = torch.empty_like(s_out)
    for rows in _row_chunks(n, k):
        q, scale, low = fit_int4_grid(w_all[rows], clip, refit_steps)
        q_out[rows] = q.to(torch.uint8)
        s_out[rows] = scale
        z_out[rows] = low + 8.0 * scale  # w = q * s + low = (q - 8) * s + zero
    return qmm.pack_int4(q_out.view(n, k)), s_out, z_out


def fit_int4_grid(w: torch.Tensor, clip: bool = True, refit_steps: int = INT4_REFIT_STEPS):
    """w [..., group] fp32 -> (codes 0..15 as fp32 [..., group], scale [...], low [...]) with w ~ codes * scale + low:
    the clip ratio searched per group, then least-squares refits of (scale, low)."""
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    centre = (lo + hi) * 0.5
    scale = ((hi - lo) / 15.0).clamp_min(1e-10)
    if clip:
        scale = scale * _best_clip((w - centre.unsqueeze(-1)) / scale.unsqueeze(-1), INT4_CLIP_RATIOS, 7.5, 0, 15)
    low = centre - 7.5 * scale  # the value of code 0
    q = torch.round((w - low.unsqueeze(-1)) / scale.unsqueeze(-1)).clamp_(0, 15)
    for _ in range(refit_steps):
        q, scale, low = _refit_int4(w, q, scale, low)
    return q, scale, low


def _int4_error(w, q, scale, low) -> torch.Tensor:
    return (q * scale.unsqueeze(-1) + low.unsqueeze(-1) - w).square_().sum(-1)


def _refit_int4(w, q, scale, low):
    """One least-squares step: the (scale, low) that fit codes q best, then codes re-rounded to that grid; kept per
    group only where the squared error drops (a degenerate or negative fit is never taken)."""
    g = w.shape[-1]
    sq, sqq, sw, sqw = q.sum(-1), (q * q).sum(-1), w.sum(-1), (q * w).sum(-1)
    det = g * sqq - sq * sq
    new_scale = (g * sqw - sq * sw) / det.clamp_min(1e-12)
    usable = (det > 0) & (new_scale > 1e-10)
    new_scale = torch.where(usable, new_scale, scale)
    new_low = torch.where(usable, (sw - new_scale * sq) / g, low)
    new_q = torch.round((w - new_low.unsqueeze(-1)) / new_scale.unsqueeze(-1)).clamp_(0, 15)
    better = _int4_error(w, new_q, new_scale, new_low) < _int4_error(w, q, scale, low)
    return (torch.where(better.unsqueeze(-1), new_q, q), torch.where(better, new_scale, scale),
            torch.where(better, new_low, low))
