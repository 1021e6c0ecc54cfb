"""Fused dequantize + matmul for weight-only int8 and int4 linear layers.

Weight formats (shared with llmd.model.quant):
- int8: `qweight` int8 [N, K], `scales` [N, K // group_size]; w = q * scale. Per-channel is group_size == K.
- int4: `qweight` uint8 [N, K // 2], two values per byte: k = 2i in the low nibble, k = 2i + 1 in the high one;
  `scales`, `zeros` [N, K // group_size]; w = (q - 8) * scale + zero (the convention of torch's int4 CPU kernel,
  so one layout feeds both).

Each Triton entry point has a pure-torch reference with the same signature (`*_ref`). Small M (decode) runs a
split-K tiling so that enough programs stream the weight at once; large M (prefill) runs a plain GEMM tiling.
"""

from __future__ import annotations

import os

import torch

from ._triton import triton, tl, HAVE_TRITON, fastest

# Decode-sized batches (M up to this) take the split-K path.
SMALL_M = 32


# ---------------------------------------------------------------------------------------------------------------
# References
# ---------------------------------------------------------------------------------------------------------------

def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    n, k = qweight.shape
    w = qweight.to(torch.float32).view(n, k // group_size, group_size) * scales.to(torch.float32).unsqueeze(-1)
    return w.view(n, k)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> uint8 [N, K] values 0..15 (low nibble first)."""
    low = qweight & 0xF
    high = qweight >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """uint8/int [N, K] values 0..15 -> uint8 [N, K/2] (low nibble = even k)."""
    v = values.to(torch.uint8)
    return v[:, 0::2] | (v[:, 1::2] << 4)


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    n = qweight.shape[0]
    k = qweight.shape[1] * 2
    q = unpack_int4(qweight).to(torch.float32).view(n, k // group_size, group_size)
    w = (q - 8.0) * scales.to(torch.float32).unsqueeze(-1) + zeros.to(torch.float32).unsqueeze(-1)
    return w.view(n, k)


def int8_matmul_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    w = dequantize_int8(qweight, scales, group_size)
    return (x.to(torch.float32) @ w.t()).to(x.dtype)


def int4_matmul_ref(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    w = dequantize_int4(qweight, scales, zeros, group_size)
    return (x.to(torch.float32) @ w.t()).to(x.dtype)


# ---------------------------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------------------------

if HAVE_TRITON:

    # M and NG are not specialized on (Triton otherwise compiles apart M == 1, M % 16 == 0 and other M, and likewise
    # NG): one binary per tiling then serves every batch size of its M bucket, which divides the compiles that
    # autotuning does (24 candidates per bucket and kernel) by up to 3 at no cost, as both only bound masks.
    @triton.jit(do_not_specialize=["M", "NG"])
    def _int8_mm_kernel(
        x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, NG,
        stride_xm, stride_om,
        GROUP: tl.constexpr, PER_CHANNEL: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = offs_m < M
        mask_n = offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                        mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            q = tl.load(w_ptr + offs_n[None, :] * K + offs_k[:, None],
                        mask=mask_k[:, None] & mask_n[None, :], other=0)  # [BLOCK_K, BLOCK_N]
            w = q.to(tl.float32)
            if not PER_CHANNEL:
                GPT: tl.constexpr = BLOCK_K // GROUP
                offs_g = k0 // GROUP + tl.arange(0, GPT)
                s = tl.load(s_ptr + offs_n[None, :] * NG + offs_g[:, None],
                            mask=(offs_g[:, None] < NG) & mask_n[None, :], other=0.0).to(tl.float32)
                w = tl.reshape(tl.reshape(w, (GPT, GROUP, BLOCK_N)) * s[:, None, :], (BLOCK_K, BLOCK_N))
            acc += tl.dot(x, w.to(x.dtype), out_dtype=tl.float32)
        if PER_CHANNEL:
            s = tl.load(s_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            acc = acc * s[None, :]
        out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        mask = mask_m[:, None] & mask_n[None, :]
        if SPLIT_K == 1:
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.atomic_add(out_ptrs, acc, mask=mask)

    @triton.jit(do_not_specialize=["M", "NG"])
    def _int4_mm_kernel(
        x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, M, N, K, NG,
        stride_xm, stride_om,
        GROUP: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    ):
        # Works on half-tiles: byte column i holds k = 2i (low nibble) and 2i + 1 (high nibble), so the even and odd
        # columns of x multiply the low and high nibbles; no interleave is needed.
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        HALF: tl.constexpr = BLOCK_K // 2
        HG: tl.constexpr = GROUP // 2
        GPT: tl.constexpr = BLOCK_K // GROUP
        KH = K // 2
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = offs_m < M
        mask_n = offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
            offs_b = k0 // 2 + tl.arange(0, HALF)  # byte columns
            mask_b = offs_b < KH
            x_rows = x_ptr + offs_m[:, None] * stride_xm + 2 * offs_b[None, :]
            x_mask = mask_m[:, None] & mask_b[None, :]
            x_even = tl.load(x_rows, mask=x_mask, other=0.0)
            x_odd = tl.load(x_rows + 1, mask=x_mask, other=0.0)
            b = tl.load(w_ptr + offs_n[None, :] * KH + offs_b[:, None],
                        mask=mask_b[:, None] & mask_n[None, :], other=0)  # [HALF, BLOCK_N] uint8
            offs_g = k0 // GROUP + tl.arange(0, GPT)
            g_mask = (offs_g[:, None] < NG) & mask_n[None, :]
            g_off = offs_n[None, :] * NG + offs_g[:, None]
            s = tl.load(s_ptr + g_off, mask=g_mask, other=0.0).to(tl.float32)[:, None, :]
            z = tl.load(z_ptr + g_off, mask=g_mask, other=0.0).to(tl.float32)[:, None, :]
            lo = tl.reshape((b & 0xF).to(tl.float32) - 8.0, (GPT, HG, BLOCK_N))
            hi = tl.reshape((b >> 4).to(tl.float32) - 8.0, (GPT, HG, BLOCK_N))
            w_lo = tl.reshape(lo * s + z, (HALF, BLOCK_N)).to(x_even.dtype)
            w_hi = tl.reshape(hi * s + z, (HALF, BLOCK_N)).to(x_even.dtype)
            acc += tl.dot(x_even, w_lo, out_dtype=tl.float32)
            acc += tl.dot(x_odd, w_hi, out_dtype=tl.float32)
        out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        mask = mask_m[:, None] & mask_n[None, :]
        if SPLIT_K == 1:
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.atomic_add(out_ptrs, acc, mask=mask)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _configs(small_m: bool, group: int, m_bucket: int = 16) -> list:
    """Autotune candidates for sm_80..sm_90 (and the H200). BLOCK_K must be a multiple of the group size.
    Small M: one M tile covers the whole batch (each weight byte is read once), split-K fills the SMs."""
    out = []
    if small_m:
        for bm in (max(16, m_bucket),):
            for bn in (32, 64, 128):
                for bk in (128, 256):
                    for sk in (1, 2, 4, 8):
                        for warps in (4,):
                            out.append(triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk),
                                                     num_warps=warps, num_stages=3))
    else:
        for bm, bn, warps in ((64, 128, 4), (128, 128, 8), (128, 64, 4), (64, 64, 4)):
            for bk in (64, 128):
                out.append(triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=1),
                                         num_warps=warps, num_stages=3))
    return [c for c in out if c.kwargs["BLOCK_K"] % group == 0 or group >= 1 << 30]


def _interp_config(m: int, n: int, k: int, group: int, per_channel: bool) -> dict:
    """One small, fixed tiling for the CPU interpreter (tests): no autotuning, which would time every config."""
    bk = group if not per_channel else 32
    while bk < 32:
        bk *= 2
    split = 2 if (m <= SMALL_M and k >= 2 * bk) else 1
    return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=bk, SPLIT_K=split)


def _m_bucket(m: int) -> int:
    return 1 << max(0, (m - 1).bit_length())


def _run(kernel, args, x, n, extra, cfg: dict, launch: dict) -> torch.Tensor:
    m, k = x.shape
    split = cfg["SPLIT_K"]
    # Split-K programs add their partial sums into an fp32 buffer.
    out = torch.zeros((m, n), dtype=torch.float32, device=x.device) if split > 1 else \
        torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]), split)
    kernel[grid](*args, out, m, n, k, extra["NG"], x.stride(0), out.stride(0), **extra["const"], **cfg, **launch)
    return out if split == 1 else out.to(x.dtype)


# Chosen tiling per (kernel, M bucket, N, K, group): found once by timing the candidates on the device (autotune).
_best: dict = {}


def candidates(m: int, k: int, group: int, per_channel: bool) -> list[tuple[dict, dict]]:
    """The (tiling, launch options) pairs that autotuning times for an [M, K] input."""
    out = []
    for c in _configs(m <= SMALL_M, group if not per_channel else 1 << 30, _m_bucket(m)):
        cfg = dict(c.kwargs)
        if triton.cdiv(k, cfg["BLOCK_K"]) < cfg["SPLIT_K"] or cfg["BLOCK_K"] > max(k, 64):
            continue
        out.append((cfg, dict(num_warps=c.num_warps, num_stages=c.num_stages)))
    return out


def _best_config(kernel, args, x, n, group, per_channel, extra) -> tuple[dict, dict]:
    m, k = x.shape
    small = m <= SMALL_M
    key = (kernel.fn.__name__ if hasattr(kernel, "fn") else id(kernel), _m_bucket(m) if small else min(_m_bucket(m), 512),
           n, k, group, x.dtype)
    if key in _best:
        return _best[key]
    best = fastest(candidates(m, k, group, per_channel),
                   lambda cfg, launch: _run(kernel, args, x, n, extra, cfg, launch),
                   f"quantized matmul for M={m} N={n} K={k}")
    _best[key] = best
    return best


def _launch(kernel, args, x, n, group, per_channel, extra) -> torch.Tensor:
    m, k = x.shape
    if x.is_cuda and not _interpreting():
        cfg, launch = _best_config(kernel, args, x, n, group, per_channel, extra)
    else:
        cfg, launch = _interp_config(m, n, k, group, per_channel), {}
    return _run(kernel, args, x, n, extra, cfg, launch)


def _check(x: torch.Tensor, k: int) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"expected x of shape [M, {k}], got {tuple(x.shape)}")
    return x if x.stride(1) == 1 else x.contiguous()


def int8_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """x [M, K] (fp16/bf16/fp32) @ dequant(qweight int8 [N, K], scales [N, K/group]).T -> [M, N] in x.dtype."""
    n, k = qweight.shape
    x = _check(x, k)
    per_channel = group_size == k
    extra = dict(NG=k // group_size, const=dict(GROUP=group_size if not per_channel else 1, PER_CHANNEL=per_channel))
    return _launch(_int8_mm_kernel, (x, qweight, scales), x, n, group_size, per_channel, extra)


def int4_matmul(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """x [M, K] @ dequant(qweight uint8 [N, K/2], scales/zeros [N, K/group]).T -> [M, N] in x.dtype."""
    n = qweight.shape[0]
    k = qweight.shape[1] * 2
    x = _check(x, k)
    extra = dict(NG=k // group_size, const=dict(GROUP=group_size))
    return _launch(_int4_mm_kernel, (x, qweight, scales, zeros), x, n, group_size, False, extra)
