"""Fused dequantize + matmul for GGUF weights kept packed: y[M, N] = x[M, K] @ dequant(qweight).T.

A packed GGUF weight is the file's own block bytes: `qweight` uint8 [N, (K / block_elems) * block_bytes], row n
holding output channel n's blocks in file order, plus its GGML type name (`TYPES` lists those handled here). The
values are those of `gguf.quants.dequantize` on the same bytes; `dequantize_gguf` checks the shapes and gives them
bit-exact with pure-torch ops (`gguf_blocks.dequantize_blocks`), and `gguf_matmul_ref` is the matmul over it.

How the kernel walks a row: every type's block splits into "groups" of 2G consecutive elements whose low and high
halves come from one run of G bytes or codes (the low and high nibbles of a Q4_K pair, the two halves of a Q4_0
block, the low/high nibble quarters of a Q6_K half). A K step takes T // G such groups: it dequantizes a "lo" tile
[BLOCK_N, T] (the first G elements of each group) and a "hi" tile (the last G), and multiplies each by the matching
columns of x, so that no tile is interleaved in registers. Small M (decode) runs split-K tilings, each program with
the whole batch in one M tile, so each weight byte is read once; M <= 4 may also take a GEMV tiling without tl.dot
(products summed on the CUDA cores). Large M (prefill) runs a GEMM tiling. The accumulator is fp32.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ._triton import triton, tl, HAVE_TRITON, fastest
from .gguf_blocks import dequantize_blocks


@dataclass(frozen=True)
class GGUFType:
    name: str
    code: int  # constexpr selecting the dequantizer in the kernel
    block_elems: int
    block_bytes: int
    group: int  # G: elements in the low (and in the high) half of one group, see the module docstring
    f16_at: tuple[int, ...]  # byte offsets of the block's fp16 fields (super-scales, mins)
    e8m0_at: tuple[int, ...] = ()  # byte offsets of E8M0 exponents (MXFP4's scale 2^(e - 128))


_TYPE_LIST = [
    GGUFType("Q8_0", 0, 32, 34, 16, (0,)),
    GGUFType("Q4_0", 1, 32, 18, 16, (0,)),
    GGUFType("Q4_1", 2, 32, 20, 16, (0, 2)),
    GGUFType("Q5_0", 3, 32, 22, 16, (0,)),
    GGUFType("Q5_1", 4, 32, 24, 16, (0, 2)),
    GGUFType("IQ4_NL", 5, 32, 18, 16, (0,)),
    GGUFType("Q4_K", 6, 256, 144, 32, (0, 2)),
    GGUFType("Q5_K", 7, 256, 176, 32, (0, 2)),
    GGUFType("Q6_K", 8, 256, 210, 64, (208,)),
    GGUFType("Q2_K", 9, 256, 84, 64, (80, 82)),
    GGUFType("Q3_K", 10, 256, 110, 64, (108,)),
    GGUFType("IQ4_XS", 11, 256, 136, 16, (0,)),
    GGUFType("MXFP4", 12, 32, 17, 16, (), (0,)),
]
TYPES: dict[str, GGUFType] = {t.name: t for t in _TYPE_LIST}

# IQ4_NL / IQ4_XS code book (ggml's kvalues_iq4nl).
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)

# Decode-sized batches (M up to this) take the split-K tilings.
SMALL_M = 16


def gguf_type(type_name: str) -> GGUFType:
    try:
        return TYPES[type_name]
    except KeyError:
        raise ValueError(f"GGUF type {type_name!r} has no packed matmul (known: {', '.join(TYPES)})") from None


# ---------------------------------------------------------------------------------------------------------------
# Reference: the blocks dequantized with torch ops (kernels/gguf_blocks.py, bit-exact with gguf.quants), then a matmul
# ---------------------------------------------------------------------------------------------------------------

def dequantize_gguf(qweight: torch.Tensor, type_name: str, in_features: int) -> torch.Tensor:
    """uint8 [N, row bytes] -> fp32 [N, in_features], exactly as gguf.quants.dequantize."""
    t = gguf_type(type_name)
    _check_weight(qweight, t, in_features)
    return dequantize_blocks(qweight, t.name)


def gguf_matmul_ref(x: torch.Tensor, qweight: torch.Tensor, type_name: str, in_features: int) -> torch.Tensor:
    w = dequantize_gguf(qweight, type_name, in_features)
    return (x.to(torch.float32) @ w.t()).to(x.dtype)


def _check_weight(qweight: torch.Tensor, t: GGUFType, k: int) -> None:
    if k % t.block_elems:
        raise ValueError(f"{t.name}: in_features {k} is not a multiple of its {t.block_elems}-element block")
    row = k // t.block_elems * t.block_bytes
    if qweight.dtype != torch.uint8 or qweight.dim() != 2 or qweight.shape[1] != row:
        raise ValueError(f"{t.name} weight for in_features {k}: expected uint8 [N, {row}], "
                         f"got {qweight.dtype} {tuple(qweight.shape)}")


# ---------------------------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------------------------

def _pack_i8(values) -> int:
    """Eight int8 values as one signed 64-bit int, the first in the low byte."""
    word = sum((v & 0xFF) << (8 * i) for i, v in enumerate(values))
    return word - (1 << 64) if word >= 1 << 63 else word


if HAVE_TRITON:
    _IQ4_LO = tl.constexpr(_pack_i8(IQ4_VALUES[:8]))
    _IQ4_HI = tl.constexpr(_pack_i8(IQ4_VALUES[8:]))

    @triton.jit
    def _iq4(q):
        """IQ4 codes (uint8 0..15) -> their values, picked from two 64-bit constants (a table in memory would be a
        gather per element, and Triton's pipeliner stages such gathers in shared memory: up to 240 KB a tiling)."""
        word = tl.where(q < 8, _IQ4_LO, _IQ4_HI)
        return ((word >> ((q & 7).to(tl.int64) * 8)) & 0xFF).to(tl.int8).to(tl.float32)

    @triton.jit
    def _mxfp4(q):
        """MXFP4 codes (uint8 0..15) -> their doubled E2M1 values (gguf_blocks.MXFP4_KVALUES), computed in int32
        (a 64-bit table word as _iq4's spills a tiling): magnitude m for m < 2, else (2 + m % 2) << (m // 2 - 1); bit
        3 the sign."""
        m = (q & 7).to(tl.int32)
        mag = tl.where(m < 2, m, (2 + (m & 1)) << tl.maximum(m // 2 - 1, 0))
        return tl.where(q >= 8, -mag, mag).to(tl.float32)

    @triton.jit
    def _ld_e8m0_half(ptr, mask):
        """An E8M0 exponent byte at ptr -> 2^(e - 128) in fp32, built from its bits as ggml's
        ggml_e8m0_to_fp32_half does (e = 0 and 1: the subnormals 2^-128 and 2^-127)."""
        e = tl.load(ptr, mask=mask, other=0).to(tl.int32)
        return tl.where(e < 2, (e + 1) << 21, (e - 1) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def _ld_f16(ptr, mask):
        """An fp16 stored as two bytes at ptr (any alignment) -> fp32."""
        lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
        hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
        return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _ld_i8(ptr, mask):
        return tl.load(ptr, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)

    @triton.jit
    def _k_scale(ptr, sub, mask):
        """Q4_K/Q5_K: 6-bit scale and min of sub-block `sub` (0..7) from the 12 scale bytes at ptr."""
        low = sub < 4
        a = tl.load(ptr + tl.where(low, sub, sub + 4), mask=mask, other=0)  # s[j] or s[j + 4]
        b = tl.load(ptr + tl.where(low, sub + 4, sub - 4), mask=mask, other=0)  # s[j + 4] or s[j - 4]
        c = tl.load(ptr + sub, mask=mask, other=0)
        sc = tl.where(low, a & 0x3F, (a & 0x0F) | ((b >> 6) << 4))
        mn = tl.where(low, b & 0x3F, (a >> 4) | ((c >> 6) << 4))
        return sc.to(tl.float32), mn.to(tl.float32)

    @triton.jit
    def _dequant_tiles(w_ptr, row, n_mask, k0, K,
                       TYPE: tl.constexpr, QK: tl.constexpr, BYTES: tl.constexpr, G: tl.constexpr,
                       BN: tl.constexpr, T: tl.constexpr):
        """The lo and hi weight tiles [BLOCK_N, T] (fp32) of the K step starting at element k0: group s of the step
        starts at k0 + 2 G s; lo column s * G + g is its element g, hi the element G + g."""
        # Index space [BN, S, U, 16]: group s, 16-element run u (the unit of Q6_K/Q3_K/Q2_K scales), element v;
        # a value that is the same along a run is computed on [BN, S, U, 1] and loaded once.
        S: tl.constexpr = T // G
        U: tl.constexpr = G // 16
        s = tl.arange(0, S)[None, :, None, None]
        u = tl.arange(0, U)[None, None, :, None]
        v = tl.arange(0, 16)[None, None, None, :]
        g = u * 16 + v
        kb = k0 + s * (2 * G)  # first element of each group
        mask = n_mask[:, None, None, None] & (kb < K)
        blk = w_ptr + row[:, None, None, None] + (kb // QK) * BYTES  # [BN, S, 1, 1] block start
        e = kb % QK  # group start within its block
        if TYPE == 0:  # Q8_0: d, 32 x int8
            d = _ld_f16(blk, mask)
            lo = _ld_i8(blk + 2 + g, mask) * d
            hi = _ld_i8(blk + 18 + g, mask) * d
        elif TYPE == 1 or TYPE == 2 or TYPE == 5:  # Q4_0 / Q4_1 / IQ4_NL: d, (m), 16 bytes of nibble pairs
            QS: tl.constexpr = 4 if TYPE == 2 else 2
            d = _ld_f16(blk, mask)
            b = tl.load(blk + QS + g, mask=mask, other=0)
            if TYPE == 1:
                lo = d * ((b & 0x0F).to(tl.float32) - 8.0)
                hi = d * ((b >> 4).to(tl.float32) - 8.0)
            elif TYPE == 2:
                m = _ld_f16(blk + 2, mask)
                lo = d * (b & 0x0F).to(tl.float32) + m
                hi = d * (b >> 4).to(tl.float32) + m
            else:
                lo = d * _iq4(b & 0x0F)
                hi = d * _iq4(b >> 4)
        elif TYPE == 3 or TYPE == 4:  # Q5_0 / Q5_1: d, (m), 32 high bits, 16 bytes of nibble pairs
            QH: tl.constexpr = 4 if TYPE == 4 else 2
            d = _ld_f16(blk, mask)
            b = tl.load(blk + QH + 4 + g, mask=mask, other=0)
            qh = tl.load(blk + QH, mask=mask, other=0).to(tl.uint32)  # the 32 high bits, bit i for element i
            for i in tl.static_range(1, 4):
                qh = qh | (tl.load(blk + QH + i, mask=mask, other=0).to(tl.uint32) << (8 * i))
            h_lo = ((qh >> g) & 1).to(tl.uint8)
            h_hi = ((qh >> (g + 16)) & 1).to(tl.uint8)
            q_lo = ((b & 0x0F) | (h_lo << 4)).to(tl.float32)
            q_hi = ((b >> 4) | (h_hi << 4)).to(tl.float32)
            if TYPE == 3:
                lo = d * (q_lo - 16.0)
                hi = d * (q_hi - 16.0)
            else:
                m = _ld_f16(blk + 2, mask)
                lo = d * q_lo + m
                hi = d * q_hi + m
        elif TYPE == 6 or TYPE == 7:  # Q4_K / Q5_K: d, dmin, 12 scale bytes, (32 high-bit bytes), 128 qs bytes
            QS: tl.constexpr = 16 if TYPE == 6 else 48
            pair = e // 64
            d = _ld_f16(blk, mask)
            dmin = _ld_f16(blk + 2, mask)
            sc_lo, mn_lo = _k_scale(blk + 4, 2 * pair, mask)
            sc_hi, mn_hi = _k_scale(blk + 4, 2 * pair + 1, mask)
            b = tl.load(blk + QS + pair * 32 + g, mask=mask, other=0)
            q_lo = b & 0x0F
            q_hi = b >> 4
            if TYPE == 7:
                h = tl.load(blk + 16 + g, mask=mask, other=0)
                q_lo = q_lo | (((h >> (2 * pair)) & 1) << 4)
                q_hi = q_hi | (((h >> (2 * pair + 1)) & 1) << 4)
            lo = (d * sc_lo) * q_lo.to(tl.float32) - dmin * mn_lo
            hi = (d * sc_hi) * q_hi.to(tl.float32) - dmin * mn_hi
        elif TYPE == 8:  # Q6_K: 128 ql bytes, 64 qh bytes, 16 int8 scales, d; a group is one half (128 elements)
            half = e // 128
            d = _ld_f16(blk + 208, mask)
            b = tl.load(blk + half * 64 + g, mask=mask, other=0)
            h = tl.load(blk + 128 + half * 32 + (u % 2) * 16 + v, mask=mask, other=0)
            q_lo = ((b & 0x0F) | (((h >> (2 * (u // 2))) & 3) << 4)).to(tl.int8) - 32
            q_hi = ((b >> 4) | (((h >> (4 + 2 * (u // 2))) & 3) << 4)).to(tl.int8) - 32
            sub = half * 8 + u
            # scale x quant as an integer (exact), then x d: where Triton has to move a tile between the layouts of
            # the quant and the scale loads, it moves int8 quants rather than fp32 values (4x less shared memory)
            sc_lo = tl.load(blk + 192 + sub, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.int16)
            sc_hi = tl.load(blk + 196 + sub, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.int16)
            lo = d * (sc_lo * q_lo.to(tl.int16)).to(tl.float32)
            hi = d * (sc_hi * q_hi.to(tl.int16)).to(tl.float32)
        elif TYPE == 9:  # Q2_K: 16 scale/min bytes, 64 qs bytes (2-bit), d, dmin; a group is one half
            half = e // 128
            d = _ld_f16(blk + 80, mask)
            dmin = _ld_f16(blk + 82, mask)
            b = tl.load(blk + 16 + half * 32 + (u % 2) * 16 + v, mask=mask, other=0)
            sh = (2 * (u // 2)).to(tl.uint8)  # (an int32 shift would widen the quants to int32)
            sub = half * 8 + u
            s_lo = tl.load(blk + sub, mask=mask, other=0)
            s_hi = tl.load(blk + sub + 4, mask=mask, other=0)
            lo = d * ((s_lo & 0x0F) * ((b >> sh) & 3)).to(tl.float32) - dmin * (s_lo >> 4).to(tl.float32)
            hi = d * ((s_hi & 0x0F) * ((b >> (sh + 4)) & 3)).to(tl.float32) - dmin * (s_hi >> 4).to(tl.float32)
        elif TYPE == 10:  # Q3_K: 32 hmask bytes, 64 qs bytes (2-bit), 12 scale bytes (6-bit), d; group = half
            half = e // 128
            d = _ld_f16(blk + 108, mask)
            b = tl.load(blk + 32 + half * 32 + (u % 2) * 16 + v, mask=mask, other=0)
            hm = tl.load(blk + (u % 2) * 16 + v, mask=mask, other=0)
            sh = 2 * (u // 2)
            hb = half * 4 + u // 2  # hmask bit of the lo element (the hi one is 2 further)
            q_lo = ((b >> sh) & 3).to(tl.int8) - ((((hm >> hb) & 1) ^ 1) << 2).to(tl.int8)
            q_hi = ((b >> (sh + 4)) & 3).to(tl.int8) - ((((hm >> (hb + 2)) & 1) ^ 1) << 2).to(tl.int8)
            sub_lo = half * 8 + u
            sub_hi = sub_lo + 4
            l_lo = (tl.load(blk + 96 + sub_lo % 8, mask=mask, other=0) >> (4 * (sub_lo // 8))) & 0x0F
            l_hi = (tl.load(blk + 96 + sub_hi % 8, mask=mask, other=0) >> (4 * (sub_hi // 8))) & 0x0F
            u_lo = (tl.load(blk + 104 + sub_lo % 4, mask=mask, other=0) >> (2 * (sub_lo // 4))) & 3
            u_hi = (tl.load(blk + 104 + sub_hi % 4, mask=mask, other=0) >> (2 * (sub_hi // 4))) & 3
            sc_lo = ((l_lo | (u_lo << 4)).to(tl.int8) - 32).to(tl.int16)
            sc_hi = ((l_hi | (u_hi << 4)).to(tl.int8) - 32).to(tl.int16)
            lo = d * (sc_lo * q_lo.to(tl.int16)).to(tl.float32)
            hi = d * (sc_hi * q_hi.to(tl.int16)).to(tl.float32)
        elif TYPE == 12:  # MXFP4: an E8M0 exponent, 16 bytes of nibble pairs (E2M1 codes)
            d = _ld_e8m0_half(blk, mask)
            b = tl.load(blk + 1 + g, mask=mask, other=0)
            lo = d * _mxfp4(b & 0x0F)
            hi = d * _mxfp4(b >> 4)
        else:  # IQ4_XS: d, 2 bytes of high scale bits, 4 bytes of low scale nibbles, 128 qs bytes; group = sub-block
            sub = e // 32
            d = _ld_f16(blk, mask)
            sl = (tl.load(blk + 4 + sub // 2, mask=mask, other=0) >> (4 * (sub % 2))) & 0x0F
            su = (tl.load(blk + 2 + sub // 4, mask=mask, other=0) >> (2 * (sub % 4))) & 3
            dl = d * ((sl | (su << 4)).to(tl.int8) - 32).to(tl.float32)
            b = tl.load(blk + 8 + sub * 16 + g, mask=mask, other=0)
            lo = dl * _iq4(b & 0x0F)
            hi = dl * _iq4(b >> 4)
        return tl.reshape(lo, (BN, T)), tl.reshape(hi, (BN, T))

    # M is not specialized on (Triton otherwise compiles M == 1, M % 16 == 0 and other M apart), nor SPLIT_K (a grid
    # size): one binary per tiling serves every batch size and split; only whether partial sums are atomically added
    # (ATOMIC) is compiled in.
    @triton.jit(do_not_specialize=["M", "SPLIT_K"])
    def _gguf_mm_kernel(
        x_ptr, w_ptr, out_ptr, M, N, K, row_bytes, stride_xm, stride_om, SPLIT_K,
        TYPE: tl.constexpr, QK: tl.constexpr, BYTES: tl.constexpr, G: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, T: tl.constexpr, ATOMIC: tl.constexpr, ROW64: tl.constexpr,
    ):
        """The tl.dot tilings: an [BLOCK_M, BLOCK_N] output tile, two dots per K step (lo and hi tiles)."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = offs_m < M
        mask_n = offs_n < N
        row = offs_n.to(tl.int64) * row_bytes if ROW64 else offs_n * row_bytes
        c = tl.arange(0, T)
        k_lo = (c // G) * (2 * G) + c % G  # x columns of the lo tile, relative to the step's start
        x_rows = x_ptr + offs_m[:, None] * stride_xm
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for step in range(pid_k, tl.cdiv(K, 2 * T), SPLIT_K):
            k0 = step * (2 * T)
            w_lo, w_hi = _dequant_tiles(w_ptr, row, mask_n, k0, K, TYPE, QK, BYTES, G, BLOCK_N, T)
            kx = k0 + k_lo
            x_mask = mask_m[:, None] & (kx < K)[None, :]
            x_lo = tl.load(x_rows + kx[None, :], mask=x_mask, other=0.0)
            x_hi = tl.load(x_rows + (kx + G)[None, :], mask=x_mask, other=0.0)
            acc += tl.dot(x_lo, tl.trans(w_lo.to(x_lo.dtype)), out_dtype=tl.float32)
            acc += tl.dot(x_hi, tl.trans(w_hi.to(x_hi.dtype)), out_dtype=tl.float32)
        out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        mask = mask_m[:, None] & mask_n[None, :]
        if ATOMIC:
            tl.atomic_add(out_ptrs, acc, mask=mask)
        else:
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _gemv_row(acc, x_row, m, M, kx, K, G: tl.constexpr, w_lo, w_hi):
        k_mask = kx < tl.where(m < M, K, 0)  # (a vector mask & a scalar one fails under the interpreter)
        x_lo = tl.load(x_row + kx, mask=k_mask, other=0.0).to(tl.float32)
        x_hi = tl.load(x_row + kx + G, mask=k_mask, other=0.0).to(tl.float32)
        return acc + w_lo * x_lo[None, :] + w_hi * x_hi[None, :]

    @triton.jit
    def _gemv_store(out_ptr, m, M, N, stride_om, offs_n, acc, ATOMIC: tl.constexpr):
        ptrs = out_ptr + m * stride_om + offs_n
        mask = offs_n < tl.where(m < M, N, 0)
        if ATOMIC:
            tl.atomic_add(ptrs, tl.sum(acc, axis=1), mask=mask)
        else:
            tl.store(ptrs, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit(do_not_specialize=["M", "SPLIT_K"])
    def _gguf_gemv_kernel(
        x_ptr, w_ptr, out_ptr, M, N, K, row_bytes, stride_xm, stride_om, SPLIT_K,
        TYPE: tl.constexpr, QK: tl.constexpr, BYTES: tl.constexpr, G: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, T: tl.constexpr, ATOMIC: tl.constexpr, ROW64: tl.constexpr,
    ):
        """The GEMV tilings (BLOCK_M <= 4 rows of x, no tl.dot): each row's products are summed per column into an
        accumulator laid out as the weight tile, and reduced across threads once, after the loop (a [M, N, T]
        accumulator would have Triton move every dequantized tile through shared memory)."""
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        m0 = tl.program_id(0) * BLOCK_M
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        row = offs_n.to(tl.int64) * row_bytes if ROW64 else offs_n * row_bytes
        c = tl.arange(0, T)
        k_lo = (c // G) * (2 * G) + c % G
        x_row = x_ptr + m0 * stride_xm
        a0 = tl.zeros((BLOCK_N, T), dtype=tl.float32)
        if BLOCK_M > 1:
            a1 = tl.zeros((BLOCK_N, T), dtype=tl.float32)
        if BLOCK_M > 2:
            a2 = tl.zeros((BLOCK_N, T), dtype=tl.float32)
            a3 = tl.zeros((BLOCK_N, T), dtype=tl.float32)
        for step in range(pid_k, tl.cdiv(K, 2 * T), SPLIT_K):
            k0 = step * (2 * T)
            w_lo, w_hi = _dequant_tiles(w_ptr, row, mask_n, k0, K, TYPE, QK, BYTES, G, BLOCK_N, T)
            kx = k0 + k_lo
            a0 = _gemv_row(a0, x_row, m0, M, kx, K, G, w_lo, w_hi)
            if BLOCK_M > 1:
                a1 = _gemv_row(a1, x_row + stride_xm, m0 + 1, M, kx, K, G, w_lo, w_hi)
            if BLOCK_M > 2:
                a2 = _gemv_row(a2, x_row + 2 * stride_xm, m0 + 2, M, kx, K, G, w_lo, w_hi)
                a3 = _gemv_row(a3, x_row + 3 * stride_xm, m0 + 3, M, kx, K, G, w_lo, w_hi)
        _gemv_store(out_ptr, m0, M, N, stride_om, offs_n, a0, ATOMIC)
        if BLOCK_M > 1:
            _gemv_store(out_ptr, m0 + 1, M, N, stride_om, offs_n, a1, ATOMIC)
        if BLOCK_M > 2:
            _gemv_store(out_ptr, m0 + 2, M, N, stride_om, offs_n, a2, ATOMIC)
            _gemv_store(out_ptr, m0 + 3, M, N, stride_om, offs_n, a3, ATOMIC)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _m_bucket(m: int) -> int:
    return 1 << max(0, (m - 1).bit_length())


def candidates(m: int, type_name: str, k: int) -> list[tuple[dict, dict]]:
    """The (tiling, launch options) pairs that autotuning times for an [M, K] input, for sm_80..sm_90 (H200).
    Kept few, as each distinct tiling is a Triton compile per type (15 per type in all). Small M: the whole
    batch in one M tile, split-K fills the SMs (SPLIT_K is a runtime argument, so splits 2..8 share one binary);
    M <= 4 also tries the GEMV tilings (no tl.dot), with two shapes at M = 1."""
    t = gguf_type(type_name)
    out = []
    if m <= SMALL_M:
        tilings = [dict(BLOCK_M=16, BLOCK_N=bn, T=tt, USE_DOT=True) for bn, tt in ((32, 128), (64, 64))]
        if m <= 4:
            gemv = ((16, 128), (32, 64)) if m == 1 else ((32, 64),)
            tilings += [dict(BLOCK_M=_m_bucket(m), BLOCK_N=bn, T=tt, USE_DOT=False) for bn, tt in gemv]
        for tiling in tilings:
            for split in (1, 2, 4, 8):
                out.append((dict(tiling, SPLIT_K=split), dict(num_warps=4, num_stages=3)))
    else:
        # The middle tiling is one that does not spill on sm_80 (offline compiles): 128x64 stepping 64 elements
        # (T = 32) where the type allows, else 64x64 over 8 warps; the 128x128 one is for sm_90's wgmma.
        middle = (128, 64, 32, 8) if t.group <= 32 else (64, 64, 64, 8)
        for bm, bn, tt, warps in ((64, 64, 64, 4), middle, (128, 128, 64, 8)):
            out.append((dict(BLOCK_M=bm, BLOCK_N=bn, T=tt, USE_DOT=True, SPLIT_K=1),
                        dict(num_warps=warps, num_stages=3)))
    return [(cfg, launch) for cfg, launch in out
            if cfg["T"] % t.group == 0 and cfg["SPLIT_K"] <= max(1, -(-k // (2 * cfg["T"])))]


def _interp_config(m: int, t: GGUFType, k: int) -> dict:
    """One small, fixed tiling for the CPU interpreter (tests): no autotuning, which would time every config.
    Small M: split-K over two programs when there are steps enough; M <= 4: the GEMV tiling."""
    tt = max(t.group, 32)
    steps = -(-k // (2 * tt))
    if m <= 4:
        return dict(BLOCK_M=_m_bucket(m), BLOCK_N=16, T=tt, USE_DOT=False, SPLIT_K=min(2, steps))
    return dict(BLOCK_M=16, BLOCK_N=16, T=tt, USE_DOT=True, SPLIT_K=2 if (m <= SMALL_M and steps >= 2) else 1)


def _run(x: torch.Tensor, qweight: torch.Tensor, t: GGUFType, k: int, cfg: dict, launch: dict) -> torch.Tensor:
    m = x.shape[0]
    n = qweight.shape[0]
    split = cfg["SPLIT_K"]
    out = torch.zeros((m, n), dtype=torch.float32, device=x.device) if split > 1 else \
        torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]), split)
    row_bytes = qweight.shape[1]
    kernel = _gguf_mm_kernel if cfg["USE_DOT"] else _gguf_gemv_kernel
    kernel[grid](
        x, qweight, out, m, n, k, row_bytes, x.stride(0), out.stride(0), split,
        TYPE=t.code, QK=t.block_elems, BYTES=t.block_bytes, G=t.group,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], T=cfg["T"], ATOMIC=split > 1,
        ROW64=n * row_bytes >= 2**31, **launch)
    return out if split == 1 else out.to(x.dtype)


# Chosen tiling per (type, M bucket, N, K, dtype): found once by timing the candidates on the device (autotune).
_best: dict = {}


def _best_config(x: torch.Tensor, qweight: torch.Tensor, t: GGUFType, k: int) -> tuple[dict, dict]:
    m = x.shape[0]
    n = qweight.shape[0]
    key = (t.name, _m_bucket(m) if m <= SMALL_M else min(_m_bucket(m), 512), n, k, x.dtype)
    if key in _best:
        return _best[key]
    best = fastest(candidates(m, t.name, k), lambda cfg, launch: _run(x, qweight, t, k, cfg, launch),
                   f"{t.name} matmul for M={m} N={n} K={k}")
    _best[key] = best
    return best


def gguf_matmul(x: torch.Tensor, qweight: torch.Tensor, type_name: str, in_features: int) -> torch.Tensor:
    """x [M, K] (fp16/bf16/fp32) @ dequant(qweight: GGUF blocks uint8 [N, row bytes]).T -> [M, N] in x.dtype."""
    t = gguf_type(type_name)
    k = in_features
    _check_weight(qweight, t, k)
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"expected x of shape [M, {k}], got {tuple(x.shape)}")
    if x.device != qweight.device:
        raise ValueError(f"x is on {x.device} but the {t.name} weight on {qweight.device}")
    if x.shape[0] == 0:
        return x.new_empty((0, qweight.shape[0]))
    x = x if x.stride(1) == 1 else x.contiguous()
    qweight = qweight.contiguous()
    if x.is_cuda and not _interpreting():
        cfg, launch = _best_config(x, qweight, t, k)
    else:
        cfg, launch = _interp_config(x.shape[0], t, k), {}
    return _run(x, qweight, t, k, cfg, launch)
