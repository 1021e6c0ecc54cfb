"""A mixture-of-experts block's experts in three launches: y[t] = sum_j w[t, j] * down_e(act(gate_up_e(x[t]))), e the
token's j-th expert (llmd.model.moe.Experts, whose Python grouping path `moe_matmul_ref` restates).

Weights: each projection (`ExpertWeights`) is every expert's matrix, as parts side by side along the outputs: GGUF
blocks kept packed (uint8 [E, rows, row bytes] of a type in llmd.kernels.gguf_matmul.TYPES, dequantized in the
kernel by gguf_matmul's own helpers) or fp [E, rows, in] in the activations' dtype; gate_up's parts split at the
intermediate size (gate rows, then up rows: one part of 2I rows, or a gate part and an up part, maybe of two types),
plus optional biases [E, out].

The steps, all on the device, with no host sync (so a decode step can be captured in a CUDA graph):
1. `align`: the T * k (token, slot) pairs, sorted by expert (a stable argsort), each expert's run padded to a multiple
   of BLOCK_M with a sentinel pair, as vLLM's moe_align_block_size lays them out; each BLOCK_M-row block belongs to
   one expert (or to none: blocks past the end, whose programs return at once). The buffers have the static size
   T * k + min(T * k, E) * (BLOCK_M - 1), rounded up to BLOCK_M.
2. gate_up: one grouped launch over (block, N tile); each program multiplies its block's x rows by its expert's gate
   and up tiles, adds the biases, applies SiLU(gate) * up (or gpt-oss's clamped SwiGLU) in fp32 and writes each
   pair's row of act [T * k, I].
3. down: the same kernel, ungated, over act's rows: each pair's [H] output row written to its slot.
4. `_moe_sum_kernel`: y[t] = sum over the k slots, in slot order, of w[t, j] * slot[t, j], in fp32.

Tilings: a GEMM (tl.dot, BLOCK_M 16 to 128 rows of one expert; fp32 activations take exact dots, as torch's matmul,
not TF32) for batches, and a GEMV for decode (BLOCK_M 1, 2 or 4 rows, no tl.dot: products summed on the CUDA cores,
reduced once after the K loop). On CUDA the tiling is autotuned
once per (weights' types, shapes, token-count bucket, dtype); under the interpreter one small fixed tiling is used.
A row's result never depends on the other rows (no split-K, no atomics), so a token's output is the same whatever
shares its step, up to the tiling the step's size picks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ._triton import HAVE_TRITON, fastest, tl, triton
from .gguf_blocks import dequantize_blocks
from .gguf_matmul import gguf_type

ACTIVATIONS = ("silu", "swiglu_clamped")


@dataclass(frozen=True)
class ExpertWeights:
    """One projection of every expert: `parts` side by side along the outputs, each (tensor, GGUF type name) with the
    tensor uint8 [E, rows, row bytes], or (tensor, None) with an fp tensor [E, rows, in_features]; `bias` [E, out]."""

    parts: tuple[tuple[torch.Tensor, str | None], ...]
    in_features: int
    bias: torch.Tensor | None = None

    @property
    def num_experts(self) -> int:
        return self.parts[0][0].shape[0]

    @property
    def out_features(self) -> int:
        return sum(t.shape[1] for t, _ in self.parts)

    def dequantized(self, e: int) -> torch.Tensor:
        """Expert e's weight, fp32 [out, in] (the reference's)."""
        return torch.cat([w[e].float() if kind is None else dequantize_blocks(w[e], kind) for w, kind in self.parts])


@dataclass(frozen=True)
class Activation:
    """What joins gate and up (llmd.model.config.MoEConfig.activation and its gpt-oss constants)."""

    kind: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def check(gate_up: ExpertWeights, down: ExpertWeights, act: Activation, dtype: torch.dtype,
          device: torch.device) -> None:
    """ValueError naming what the kernel cannot take for activations of `dtype` on `device` (a caller then keeps the
    Python grouping path)."""
    if act.kind not in ACTIVATIONS:
        raise ValueError(f"activation {act.kind!r} is not one of {', '.join(ACTIVATIONS)}")
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"activations of {dtype}: expected fp16, bf16 or fp32")
    inter = gate_up.out_features // 2
    if gate_up.out_features % 2 or down.in_features != inter or down.out_features != gate_up.in_features:
        raise ValueError(f"gate_up [{gate_up.out_features}, {gate_up.in_features}] and down "
                         f"[{down.out_features}, {down.in_features}] are not one SwiGLU MLP's")
    if len(gate_up.parts) > 2 or (len(gate_up.parts) == 2 and gate_up.parts[0][0].shape[1] != inter):
        raise ValueError("gate_up's parts do not split at the intermediate size (gate rows, then up rows)")
    if len(down.parts) != 1:
        raise ValueError("down must be one part")
    for proj in (gate_up, down):
        if proj.num_experts != gate_up.num_experts:
            raise ValueError("gate_up and down hold different numbers of experts")
        for w, kind in proj.parts:
            if w.device != torch.device(device):
                raise ValueError(f"the activations are on {device} but an expert weight on {w.device}")
            if w.stride(-1) != 1:
                raise ValueError("expert weights must be contiguous along their rows")
            if kind is None:
                if w.dtype != dtype or w.dim() != 3 or w.shape[2] != proj.in_features:
                    raise ValueError(f"fp expert weights must be [E, rows, {proj.in_features}] in the activations' "
                                     f"dtype {dtype}, got {w.dtype} {tuple(w.shape)}")
            else:
                t = gguf_type(kind)
                row = proj.in_features // t.block_elems * t.block_bytes
                if proj.in_features % t.block_elems or w.dtype != torch.uint8 or w.dim() != 3 or w.shape[2] != row:
                    raise ValueError(f"{kind} expert weights for in_features {proj.in_features}: expected uint8 "
                                     f"[E, rows, {row}], got {w.dtype} {tuple(w.shape)}")
        if proj.bias is not None and tuple(proj.bias.shape) != (proj.num_experts, proj.out_features):
            raise ValueError(f"expert bias {tuple(proj.bias.shape)}, expected {(proj.num_experts, proj.out_features)}")


def _check_inputs(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: ExpertWeights,
                  down: ExpertWeights, act: Activation) -> None:
    check(gate_up, down, act, x.dtype, x.device)
    if x.dim() != 2 or x.shape[1] != gate_up.in_features:
        raise ValueError(f"expected x of shape [T, {gate_up.in_features}], got {tuple(x.shape)}")
    if ids.shape != weights.shape or ids.dim() != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(f"ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must be [T, k], T = {x.shape[0]}")


# ---------------------------------------------------------------------------------------------------------------
# Reference: the Python grouping path of llmd.model.moe.Experts, each projection in fp32 rounded to x's dtype
# ---------------------------------------------------------------------------------------------------------------

def _activation_ref(gate_up: torch.Tensor, inter: int, act: Activation) -> torch.Tensor:
    gate, up = gate_up.split(inter, dim=-1)
    if act.kind == "silu":
        return torch.nn.functional.silu(gate) * up
    gate, up = gate.clamp(max=act.limit), up.clamp(min=-act.limit, max=act.limit)
    return (up + 1) * (gate * torch.sigmoid(gate * act.alpha))


def moe_matmul_ref(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: ExpertWeights,
                   down: ExpertWeights, act: Activation = Activation(), hits: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """x [T, H], each token's experts ids [T, k] and weights [T, k] -> [T, H] in x's dtype (see moe_matmul)."""
    _check_inputs(x, ids, weights, gate_up, down, act)
    t, k = ids.shape
    inter = down.in_features
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate_up.num_experts)
    if hits is not None:
        hits += counts.to(hits.device)
    slots = x.new_empty(t * k, x.shape[-1])
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n == 0:
            continue
        pairs = order[start:start + n]
        start += n
        rows = x[pairs // k]
        h = (rows.float() @ gate_up.dequantized(e).t()).to(x.dtype)
        if gate_up.bias is not None:
            h = h + gate_up.bias[e].to(x.dtype)
        y = (_activation_ref(h, inter, act).float() @ down.dequantized(e).t()).to(x.dtype)
        if down.bias is not None:
            y = y + down.bias[e].to(x.dtype)
        slots[pairs] = y
    slots = slots.view(t, k, -1)
    w = weights.to(x.dtype).unsqueeze(-1)
    out = slots[:, 0] * w[:, 0]
    for j in range(1, k):  # in slot order
        out = out + slots[:, j] * w[:, j]
    return out


# ---------------------------------------------------------------------------------------------------------------
# Step 1: the pairs sorted by expert, each expert's run padded to BLOCK_M (torch ops on the device, no host sync)
# ---------------------------------------------------------------------------------------------------------------

def align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [T, k] -> (pairs int32 [R]: pair indices t * k + j grouped by expert, each expert's run padded with the
    sentinel T * k to a multiple of block_m; block_expert int32 [R / block_m]: each block's expert, -1 past the last;
    counts int64 [E]: pairs per expert). R is static: T * k + min(T * k, E) * (block_m - 1), rounded up to block_m."""
    flat = ids.reshape(-1).to(torch.int64)
    p = flat.numel()
    dev = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    if block_m == 1:  # nothing to pad: every pair is its own block
        return order.to(torch.int32), expert_of.to(torch.int32), counts
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    first = torch.cumsum(counts, 0) - counts  # each expert's first position in `order`
    dest = (pad_end - padded)[expert_of] + torch.arange(p, device=dev) - first[expert_of]
    rows = -(-(p + min(p, num_experts) * (block_m - 1)) // block_m) * block_m
    pairs = torch.full((rows,), p, dtype=torch.int32, device=dev)
    pairs.scatter_(0, dest, order.to(torch.int32))
    block_expert = torch.searchsorted(pad_end, torch.arange(0, rows, block_m, device=dev), right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return pairs, block_expert, counts


# ---------------------------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------------------------

if HAVE_TRITON:
    from .gguf_matmul import _dequant_tiles

    @triton.jit
    def _weight_tiles(w_ptr, row, n_mask, k0, K,
                      TYPE: tl.constexpr, QK: tl.constexpr, BYTES: tl.constexpr, G: tl.constexpr,
                      BN: tl.constexpr, T: tl.constexpr):
        """The lo and hi tiles [BN, T] of the K step at k0 (gguf_matmul's module docstring): a GGUF type's, or fp
        weights' (TYPE < 0, G == T: lo the step's first T columns, hi the next T), in their own dtype."""
        if TYPE < 0:
            kk = k0 + tl.arange(0, T)
            ptrs = w_ptr + row[:, None] + kk[None, :]
            lo = tl.load(ptrs, mask=n_mask[:, None] & (kk < K)[None, :], other=0.0)
            hi = tl.load(ptrs + T, mask=n_mask[:, None] & (kk + T < K)[None, :], other=0.0)
            return lo, hi
        else:
            return _dequant_tiles(w_ptr, row, n_mask, k0, K, TYPE, QK, BYTES, G, BN, T)

    @triton.jit
    def _x_cols(k0, T: tl.constexpr, G: tl.constexpr):
        """x's columns of the lo tile of the step at k0 (the hi tile's are G further)."""
        c = tl.arange(0, T)
        return k0 + (c // G) * (2 * G) + c % G

    @triton.jit
    def _dot(x, w, IEEE: tl.constexpr):
        """x [M, T] @ w [BN, T].T in fp32; fp32 inputs exactly (IEEE), as torch's matmul (tl.dot would take TF32)."""
        if IEEE:
            return tl.dot(x, tl.trans(w.to(x.dtype)), input_precision="ieee", out_dtype=tl.float32)
        else:
            return tl.dot(x, tl.trans(w.to(x.dtype)), out_dtype=tl.float32)

    @triton.jit
    def _epilogue(acc_g, acc_u, b_ptr, e, offs_n, mask_n, bias_stride, up_bias, alpha, limit,
                  GATED: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr):
        """Biases added, then (gated) the activation, in fp32; acc_* are [rows, BN] or [BN]."""
        if HAS_BIAS:
            b = b_ptr + e * bias_stride + offs_n
            acc_g += tl.load(b, mask=mask_n, other=0.0).to(tl.float32)
            if GATED:
                acc_u += tl.load(b + up_bias, mask=mask_n, other=0.0).to(tl.float32)
        y = acc_g
        if GATED:
            if ACT == 0:  # SiLU(gate) * up
                y = acc_g * tl.sigmoid(acc_g) * acc_u
            else:  # gpt-oss: gate clamped above, up both ways; (up + 1) * gate * sigmoid(alpha * gate)
                g = tl.minimum(acc_g, limit)
                u = tl.minimum(tl.maximum(acc_u, -limit), limit)
                y = (u + 1.0) * (g * tl.sigmoid(g * alpha))
        return y

    @triton.jit(do_not_specialize=["num_pairs"])
    def _moe_dot_kernel(
        x_ptr, wg_ptr, wu_ptr, b_ptr, out_ptr, pairs_ptr, block_expert_ptr,
        num_pairs, x_div, N, K, stride_xm, stride_om, expert_g, expert_u, row_g, row_u, bias_stride, up_bias,
        alpha, limit,
        TYPE_G: tl.constexpr, QK_G: tl.constexpr, BYTES_G: tl.constexpr, G_G: tl.constexpr,
        TYPE_U: tl.constexpr, QK_U: tl.constexpr, BYTES_U: tl.constexpr, G_U: tl.constexpr,
        GATED: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, T: tl.constexpr, IEEE: tl.constexpr,
    ):
        """The GEMM tiling: program (block, N tile) -> out[pair, N tile] for the block's BLOCK_M pairs (x's row of a
        pair is pair // x_div), two tl.dot per K step and weight (lo and hi tiles)."""
        e = tl.load(block_expert_ptr + tl.program_id(0)).to(tl.int64)
        if e < 0:
            return
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(pairs_ptr + offs_m)
        valid = pair < num_pairs
        x_rows = x_ptr + (pair // x_div).to(tl.int64)[:, None] * stride_xm
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        wg = wg_ptr + e * expert_g
        wu = wu_ptr + e * expert_u
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for step in range(0, tl.cdiv(K, 2 * T)):
            k0 = step * (2 * T)
            kx = _x_cols(k0, T, G_G)
            x_lo = tl.load(x_rows + kx[None, :], mask=valid[:, None] & (kx < K)[None, :], other=0.0)
            x_hi = tl.load(x_rows + (kx + G_G)[None, :], mask=valid[:, None] & (kx + G_G < K)[None, :], other=0.0)
            w_lo, w_hi = _weight_tiles(wg, offs_n * row_g, mask_n, k0, K, TYPE_G, QK_G, BYTES_G, G_G, BLOCK_N, T)
            acc_g += _dot(x_lo, w_lo, IEEE) + _dot(x_hi, w_hi, IEEE)
            if GATED:
                if G_U != G_G:  # the up part's type groups its elements otherwise
                    kx = _x_cols(k0, T, G_U)
                    x_lo = tl.load(x_rows + kx[None, :], mask=valid[:, None] & (kx < K)[None, :], other=0.0)
                    x_hi = tl.load(x_rows + (kx + G_U)[None, :], mask=valid[:, None] & (kx + G_U < K)[None, :],
                                   other=0.0)
                w_lo, w_hi = _weight_tiles(wu, offs_n * row_u, mask_n, k0, K, TYPE_U, QK_U, BYTES_U, G_U, BLOCK_N, T)
                acc_u += _dot(x_lo, w_lo, IEEE) + _dot(x_hi, w_hi, IEEE)
        y = _epilogue(acc_g, acc_u, b_ptr, e, offs_n[None, :], mask_n[None, :], bias_stride, up_bias, alpha, limit,
                      GATED, ACT, HAS_BIAS)
        out = out_ptr + pair.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(out, y.to(out_ptr.dtype.element_ty), mask=valid[:, None] & mask_n[None, :])

    @triton.jit
    def _gemv_acc(acc, x_ptr, pair, num_pairs, x_div, stride_xm, kx, K, G: tl.constexpr, w_lo, w_hi):
        """acc [BN, T] += one pair's x row times the lo and hi tiles (nothing for a sentinel pair)."""
        lim = tl.where(pair < num_pairs, K, 0)  # (a vector mask & a scalar one fails under the interpreter)
        x_row = x_ptr + (pair // x_div).to(tl.int64) * stride_xm
        x_lo = tl.load(x_row + kx, mask=kx < lim, other=0.0).to(tl.float32)
        x_hi = tl.load(x_row + kx + G, mask=kx + G < lim, other=0.0).to(tl.float32)
        return acc + w_lo.to(tl.float32) * x_lo[None, :] + w_hi.to(tl.float32) * x_hi[None, :]

    @triton.jit
    def _gemv_row_step(acc_g, acc_u, x_ptr, pair, num_pairs, x_div, stride_xm, k0, K, g_lo, g_hi, u_lo, u_hi,
                       G_G: tl.constexpr, G_U: tl.constexpr, T: tl.constexpr, GATED: tl.constexpr):
        acc_g = _gemv_acc(acc_g, x_ptr, pair, num_pairs, x_div, stride_xm, _x_cols(k0, T, G_G), K, G_G, g_lo, g_hi)
        if GATED:
            acc_u = _gemv_acc(acc_u, x_ptr, pair, num_pairs, x_div, stride_xm, _x_cols(k0, T, G_U), K, G_U,
                              u_lo, u_hi)
        return acc_g, acc_u

    @triton.jit
    def _gemv_store(out_ptr, pair, num_pairs, stride_om, N, acc_g, acc_u, b_ptr, e, offs_n, bias_stride, up_bias,
                    alpha, limit, GATED: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr):
        y = _epilogue(tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1), b_ptr, e, offs_n, offs_n < N, bias_stride,
                      up_bias, alpha, limit, GATED, ACT, HAS_BIAS)
        mask = offs_n < tl.where(pair < num_pairs, N, 0)
        tl.store(out_ptr + pair.to(tl.int64) * stride_om + offs_n, y.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit(do_not_specialize=["num_pairs"])
    def _moe_gemv_kernel(
        x_ptr, wg_ptr, wu_ptr, b_ptr, out_ptr, pairs_ptr, block_expert_ptr,
        num_pairs, x_div, N, K, stride_xm, stride_om, expert_g, expert_u, row_g, row_u, bias_stride, up_bias,
        alpha, limit,
        TYPE_G: tl.constexpr, QK_G: tl.constexpr, BYTES_G: tl.constexpr, G_G: tl.constexpr,
        TYPE_U: tl.constexpr, QK_U: tl.constexpr, BYTES_U: tl.constexpr, G_U: tl.constexpr,
        GATED: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, T: tl.constexpr, IEEE: tl.constexpr,
    ):
        """The GEMV tiling (BLOCK_M = 1, 2 or 4 pairs of one expert, no tl.dot): as _moe_dot_kernel, each pair's
        products summed per column in an accumulator laid out as the weight tile, reduced once after the loop."""
        e = tl.load(block_expert_ptr + tl.program_id(0)).to(tl.int64)
        if e < 0:
            return
        m0 = tl.program_id(0) * BLOCK_M
        p0 = tl.load(pairs_ptr + m0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        wg = wg_ptr + e * expert_g
        wu = wu_ptr + e * expert_u
        g0 = tl.zeros((BLOCK_N, T), dtype=tl.float32)
        u0 = tl.zeros((BLOCK_N, T), dtype=tl.float32)
        if BLOCK_M > 1:
            p1 = tl.load(pairs_ptr + m0 + 1)
            g1 = tl.zeros((BLOCK_N, T), dtype=tl.float32)
            u1 = tl.zeros((BLOCK_N, T), dtype=tl.float32)
        if BLOCK_M > 2:
            p2 = tl.load(pairs_ptr + m0 + 2)
            p3 = tl.load(pairs_ptr + m0 + 3)
            g2 = tl.zeros((BLOCK_N, T), dtype=tl.float32)
            u2 = tl.zeros((BLOCK_N, T), dtype=tl.float32)
            g3 = tl.zeros((BLOCK_N, T), dtype=tl.float32)
            u3 = tl.zeros((BLOCK_N, T), dtype=tl.float32)
        for step in range(0, tl.cdiv(K, 2 * T)):
            k0 = step * (2 * T)
            g_lo, g_hi = _weight_tiles(wg, offs_n * row_g, mask_n, k0, K, TYPE_G, QK_G, BYTES_G, G_G, BLOCK_N, T)
            if GATED:
                u_lo, u_hi = _weight_tiles(wu, offs_n * row_u, mask_n, k0, K, TYPE_U, QK_U, BYTES_U, G_U, BLOCK_N, T)
            else:
                u_lo, u_hi = g_lo, g_hi
            g0, u0 = _gemv_row_step(g0, u0, x_ptr, p0, num_pairs, x_div, stride_xm, k0, K, g_lo, g_hi, u_lo, u_hi,
                                    G_G, G_U, T, GATED)
            if BLOCK_M > 1:
                g1, u1 = _gemv_row_step(g1, u1, x_ptr, p1, num_pairs, x_div, stride_xm, k0, K, g_lo, g_hi, u_lo,
                                        u_hi, G_G, G_U, T, GATED)
            if BLOCK_M > 2:
                g2, u2 = _gemv_row_step(g2, u2, x_ptr, p2, num_pairs, x_div, stride_xm, k0, K, g_lo, g_hi, u_lo,
                                        u_hi, G_G, G_U, T, GATED)
                g3, u3 = _gemv_row_step(g3, u3, x_ptr, p3, num_pairs, x_div, stride_xm, k0, K, g_lo, g_hi, u_lo,
                                        u_hi, G_G, G_U, T, GATED)
        _gemv_store(out_ptr, p0, num_pairs, stride_om, N, g0, u0, b_ptr, e, offs_n, bias_stride, up_bias, alpha,
                    limit, GATED, ACT, HAS_BIAS)
        if BLOCK_M > 1:
            _gemv_store(out_ptr, p1, num_pairs, stride_om, N, g1, u1, b_ptr, e, offs_n, bias_stride, up_bias, alpha,
                        limit, GATED, ACT, HAS_BIAS)
        if BLOCK_M > 2:
            _gemv_store(out_ptr, p2, num_pairs, stride_om, N, g2, u2, b_ptr, e, offs_n, bias_stride, up_bias, alpha,
                        limit, GATED, ACT, HAS_BIAS)
            _gemv_store(out_ptr, p3, num_pairs, stride_om, N, g3, u3, b_ptr, e, offs_n, bias_stride, up_bias, alpha,
                        limit, GATED, ACT, HAS_BIAS)

    @triton.jit
    def _moe_sum_kernel(slots_ptr, w_ptr, out_ptr, H, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
        """out[t] = sum over j in slot order of w[t, j] * slots[t * k + j], in fp32."""
        t = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < H
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            w = tl.load(w_ptr + t * TOP_K + j).to(tl.float32)
            acc += w * tl.load(slots_ptr + (t * TOP_K + j) * H + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * H + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------------------------

def _type_args(kind: str | None, step: int) -> tuple[int, int, int, int]:
    """(TYPE, QK, BYTES, G) of a part for a tiling stepping 2 * step elements (fp: G = step)."""
    if kind is None:
        return -1, 1, 1, step
    t = gguf_type(kind)
    return t.code, t.block_elems, t.block_bytes, t.group


def _group(kind: str | None) -> int:
    return 16 if kind is None else gguf_type(kind).group


def _launch(x: torch.Tensor, proj: ExpertWeights, out: torch.Tensor, pairs: torch.Tensor, block_expert: torch.Tensor,
            num_pairs: int, x_div: int, gated: bool, act: Activation, cfg: dict, launch: dict) -> None:
    """One grouped launch of gate_up (gated: gate and up parts, act written) or down over the aligned blocks."""
    step = cfg["T"]
    inter = proj.out_features // 2 if gated else proj.out_features
    if len(proj.parts) == 2:
        (wg, kind_g), (wu, kind_u) = proj.parts
        up_rows = 0
    else:
        (wg, kind_g), = proj.parts
        wu, kind_u = wg, kind_g
        up_rows = inter if gated else 0
    row_g = wg.stride(1)  # row bytes, or elements of an fp row
    row_u = wu.stride(1)
    wu_view = wu[:, up_rows:] if up_rows else wu
    bias = proj.bias
    tg, tu = _type_args(kind_g, step), _type_args(kind_u, step)
    kernel = _moe_dot_kernel if cfg["USE_DOT"] else _moe_gemv_kernel
    # a gated program holds a gate and an up tile: BLOCK_N / 2 columns of each, the registers of BLOCK_N ungated
    block_n = max(16, cfg["BLOCK_N"] // 2) if gated else cfg["BLOCK_N"]
    grid = (block_expert.numel(), triton.cdiv(inter, block_n))
    kernel[grid](
        x, wg, wu_view, bias if bias is not None else out, out, pairs, block_expert,
        num_pairs, x_div, inter, proj.in_features, x.stride(0), out.stride(0), wg.stride(0), wu.stride(0), row_g,
        row_u, bias.stride(0) if bias is not None else 0, inter if gated else 0, act.alpha, act.limit,
        TYPE_G=tg[0], QK_G=tg[1], BYTES_G=tg[2], G_G=tg[3], TYPE_U=tu[0], QK_U=tu[1], BYTES_U=tu[2], G_U=tu[3],
        GATED=gated, ACT=ACTIVATIONS.index(act.kind), HAS_BIAS=bias is not None,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=block_n, T=step, IEEE=x.dtype == torch.float32, **launch)


def _run(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: ExpertWeights, down: ExpertWeights,
         act: Activation, cfg: dict, launch: dict, hits: torch.Tensor | None = None) -> torch.Tensor:
    t, k = ids.shape
    p = t * k
    pairs, block_expert, counts = align(ids, gate_up.num_experts, cfg["BLOCK_M"])
    if hits is not None:
        hits += counts
    h = x.shape[1]
    hidden = torch.empty((p, down.in_features), dtype=x.dtype, device=x.device)
    _launch(x, gate_up, hidden, pairs, block_expert, p, k, True, act, cfg, launch)
    slots = torch.empty((p, h), dtype=x.dtype, device=x.device)
    _launch(hidden, down, slots, pairs, block_expert, p, 1, False, act, cfg, launch)
    out = torch.empty_like(x)
    block = 256 if x.is_cuda and not _interpreting() else 64
    _moe_sum_kernel[(t, triton.cdiv(h, block))](slots, weights.contiguous(), out, h, TOP_K=k, BLOCK=block)
    return out


def _step(gate_up: ExpertWeights, down: ExpertWeights, least: int) -> int:
    """The smallest K step half (T) at least `least` that every part's group divides."""
    groups = [_group(kind) for proj in (gate_up, down) for _, kind in proj.parts]
    step = least
    while any(step % g for g in groups):
        step *= 2
    return step


def candidates(tokens: int, gate_up: ExpertWeights, down: ExpertWeights) -> list[tuple[dict, dict]]:
    """The (tiling, launch options) pairs that autotuning times for a step of `tokens` tokens, for sm_80..sm_90.
    Kept few: each tiling is two Triton compiles (gated and not) per combination of types. Few tokens: the GEMV
    tilings (1, 2 or 4 pairs of an expert a program); from 8: the dot tiling of 16 rows; past 32, blocks of 64 and
    128 rows. None spills on sm_90 at gpt-oss-20b's and Qwen3-30B-A3B's shapes (tests/gpu/compile_offline.py --moe;
    a 32-row block did, for MXFP4's gate_up)."""
    step = _step(gate_up, down, 64)
    out = []
    if tokens <= 16:
        out += [(dict(BLOCK_M=bm, BLOCK_N=32, T=step, USE_DOT=False), dict(num_warps=4, num_stages=3))
                for bm in ((1, 2) if tokens <= 4 else (2, 4))]
    if tokens >= 8:
        out.append((dict(BLOCK_M=16, BLOCK_N=64, T=step, USE_DOT=True), dict(num_warps=4, num_stages=3)))
    if tokens > 32:
        out += [(dict(BLOCK_M=bm, BLOCK_N=bn, T=step, USE_DOT=True), dict(num_warps=w, num_stages=3))
                for bm, bn, w in ((64, 64, 8), (128, 64, 8))]
    return out


def _interp_config(tokens: int, gate_up: ExpertWeights, down: ExpertWeights) -> dict:
    """One small, fixed tiling for the interpreter (tests): GEMV up to 8 tokens, else the dot tiling of 16 rows."""
    step = _step(gate_up, down, 64)
    if tokens <= 8:
        return dict(BLOCK_M=1 if tokens == 1 else 2, BLOCK_N=128, T=step, USE_DOT=False)
    return dict(BLOCK_M=16, BLOCK_N=128, T=step, USE_DOT=True)


def _bucket(tokens: int) -> int:
    return min(1 << max(0, (tokens - 1).bit_length()), 1024)


# Chosen tiling per (types, shapes, activation, token bucket, dtype): found once by timing the candidates (autotune).
_best: dict = {}


def _key(x: torch.Tensor, ids: torch.Tensor, gate_up: ExpertWeights, down: ExpertWeights, act: Activation) -> tuple:
    types = tuple(kind for proj in (gate_up, down) for _, kind in proj.parts)
    return (types, gate_up.num_experts, gate_up.in_features, down.in_features, ids.shape[1], act.kind,
            gate_up.bias is not None, _bucket(ids.shape[0]), x.dtype)


def moe_matmul(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: ExpertWeights,
               down: ExpertWeights, act: Activation = Activation(), hits: torch.Tensor | None = None
               ) -> torch.Tensor:
    """x [T, H] (fp16/bf16/fp32), each token's experts ids [T, k] (int) and weights [T, k] (fp32) -> [T, H] in x's
    dtype: sum over j of weights[t, j] * down_e(act(gate_up_e(x[t]))), e = ids[t, j]. `hits` (int64 [E] on x's
    device), if given, is incremented by the pairs each expert took."""
    _check_inputs(x, ids, weights, gate_up, down, act)
    if x.shape[0] == 0:
        return torch.empty_like(x)
    x = x if x.stride(1) == 1 else x.contiguous()
    if x.is_cuda and not _interpreting():
        key = _key(x, ids, gate_up, down, act)
        if key not in _best:
            _best[key] = fastest(candidates(x.shape[0], gate_up, down),
                                 lambda cfg, launch: _run(x, ids, weights, gate_up, down, act, cfg, launch),
                                 f"MoE of {x.shape[0]} tokens")
        cfg, launch = _best[key]
    else:
        cfg, launch = _interp_config(x.shape[0], gate_up, down), {}
    return _run(x, ids, weights, gate_up, down, act, cfg, launch, hits)
