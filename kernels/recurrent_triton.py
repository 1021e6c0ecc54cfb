"""Triton kernels for the recurrent layers of hybrid models on CUDA (under TRITON_INTERPRET=1 also on CPU tensors, for
the tests): the three functions of llmd.model.recurrent (whose *_ref are their torch references) over a step's
flattened batch, varlen: sequence b's tokens are rows query_start[b] .. query_start[b + 1] - 1, its state is at
slots[b], and a sequence with fresh[b] starts from a zero state.

- `causal_conv1d`: two launches. The first computes the outputs, one program per (sequence, block of channels, block
  of tokens): tap j of token t reads the input K-1-j rows before it, or the sequence's conv state where that falls
  before its first token; then the bias and SiLU in fp32, one rounding to x's dtype. The second writes each
  sequence's last K-1 inputs (or, for a sequence of fewer than K-1 tokens, the shifted old state and its inputs) back
  to its slot, after the first has read the old state (launch order on the stream).
- `gated_delta_rule`: one program per (sequence, value head, tile of value columns) holds its [Dk, BV] slice of the
  fp32 state in registers (a column of the state depends only on its own column, so the tiles are independent), q and
  k L2-normalised and q scaled by Dk^-0.5 in fp32, and writes the state back after the sequence's last token. Two
  kernels, each sequence taking one by its own length (`chunk_from`), so its values do not depend on the others':
  * token by token (decode tokens, short verify chunks): S <- S exp(g); S <- S + k (beta (v - S^T k))^T; o = S^T q;
  * by chunks of DELTA_CHUNK tokens (prefill chunks), the chunked form of the same recurrence, its products on the
    tensor cores (`dot_precision`): with gc the within-chunk cumulative sum of g, D[t, s] = exp(gc_t - gc_s)
    (s <= t), L = strictly lower (beta_t D[t, s] k_t . k_s) and A = (I + L)^-1 (forward substitution, row by row):
        u = A (beta (V - exp(gc) K S));  O = exp(gc) Q S + ((Q K^T) * D) u;
        S <- exp(gc_last) S + (K * exp(gc_last - gc))^T u
    (u holds each token's beta (v - S^T k) as the recurrence would compute it). A chunk's rows past its sequence
    have zero k, v, beta and g, so they change nothing. Its rounding differs from the recurrence's (within fp32's),
    and depends on where the sequence's prefill chunks begin, as the scheduler cuts them.
- `mamba2_scan`: Mamba2's selective scan, one program per (sequence, head, tile of state rows) holding its [BP, N]
  slice of the fp32 state in registers (a row of the state depends only on its own row: y = S C reduces over the
  state index), dt = clamp(softplus(dt + dt_bias)) in fp32, the D skip added, the state written back after the
  sequence's last token. Two kernels, each sequence taking one by its length as the delta rule's do:
  * token by token (decode tokens, short verify chunks): S <- S exp(dt A) + (dt x) B^T; y = S C + D x;
  * by chunks of MAMBA2_CHUNK tokens (prefill chunks), the chunked (SSD) form of the same recurrence, its products on
    the tensor cores: with ac the within-chunk cumulative sum of dt A and L[t, s] = exp(ac_t - ac_s) (s <= t),
        Y = ((C B^T) * L * dt_s) X + exp(ac) (C S^T) + D X;  S <- exp(ac_last) S + (X * dt exp(ac_last - ac))^T B
    A chunk's rows past its sequence have dt 0 (no decay, no input), so they change nothing. Its rounding differs
    from the recurrence's (within fp32's), and depends on where the sequence's prefill chunks begin.

A sequence's results depend only on its own tokens and state, never on the rest of the batch. Each function returns
None where Triton is missing or the tensors are not the layouts it takes (then the caller runs the torch reference).
"""

from __future__ import annotations

import torch

from ._triton import HAVE_TRITON, tl, triton

CONV_BLOCK_C = 128  # channels per program of the convolution
CONV_BLOCK_T = 16   # tokens per program of the convolution
DELTA_BLOCK_V = 32  # value columns per program of the delta rule
DELTA_CHUNK = 16    # tokens per chunk of the chunked delta rule, and the fewest a sequence runs it with
MAMBA2_BLOCK_P = 16  # state rows per program of the token-by-token Mamba2 scan (decode: many programs per head)
MAMBA2_CHUNK_P = 32  # state rows per program of the chunked Mamba2 scan
MAMBA2_CHUNK = 32    # tokens per chunk of the chunked Mamba2 scan, and the fewest a sequence runs it with


def available() -> bool:
    return HAVE_TRITON


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


if HAVE_TRITON:

    @triton.jit
    def _conv_kernel(x_ptr, w_ptr, bias_ptr, state_ptr, out_ptr, slots_ptr, fresh_ptr, start_ptr, C, stride_x,
                     stride_o, K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_T: tl.constexpr,
                     BLOCK_C: tl.constexpr):
        b = tl.program_id(0)
        start = tl.load(start_ptr + b)
        end = tl.load(start_ptr + b + 1)
        t0 = start + tl.program_id(2) * BLOCK_T
        if t0 < end:
            slot = tl.load(slots_ptr + b)
            keep = tl.load(fresh_ptr + b) == 0  # a continuing sequence reads its state; a fresh one zeros
            offs_t = t0 + tl.arange(0, BLOCK_T)
            offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
            mt = offs_t < end
            mc = offs_c < C
            state = state_ptr + slot * C * (K - 1)
            acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
            for j in tl.static_range(K):
                p = offs_t + (j - (K - 1))  # the flat row tap j reads
                in_x = p >= start
                xv = tl.load(x_ptr + p[:, None] * stride_x + offs_c[None, :],
                             mask=(mt & in_x)[:, None] & mc[None, :], other=0.0).to(tl.float32)
                col = p - start + (K - 1)  # before the sequence: column `col` of its conv state
                sv = tl.load(state + offs_c[None, :] * (K - 1) + col[:, None],
                             mask=(mt & (p < start))[:, None] & mc[None, :], other=0.0).to(tl.float32)
                sv = tl.where(keep, sv, 0.0)
                w = tl.load(w_ptr + offs_c * K + j, mask=mc, other=0.0).to(tl.float32)
                acc += (xv + sv) * w[None, :]
            if HAS_BIAS:
                acc += tl.load(bias_ptr + offs_c, mask=mc, other=0.0).to(tl.float32)[None, :]
            if SILU:
                acc = acc / (1.0 + tl.exp(-acc))
            tl.store(out_ptr + offs_t[:, None] * stride_o + offs_c[None, :], acc.to(out_ptr.dtype.element_ty),
                     mask=mt[:, None] & mc[None, :])

    @triton.jit
    def _conv_state_kernel(x_ptr, state_ptr, slots_ptr, fresh_ptr, start_ptr, C, stride_x, K: tl.constexpr,
                           KP: tl.constexpr, BLOCK_C: tl.constexpr):
        b = tl.program_id(0)
        start = tl.load(start_ptr + b)
        n = tl.load(start_ptr + b + 1) - start
        slot = tl.load(slots_ptr + b)
        keep = tl.load(fresh_ptr + b) == 0
        offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        i = tl.arange(0, KP)
        mc = offs_c < C
        mi = i < K - 1
        p = n + i - (K - 1)  # new column i is window[n + i]: input p of the sequence, or old column n + i
        state = state_ptr + slot * C * (K - 1) + offs_c[:, None] * (K - 1)
        xv = tl.load(x_ptr + (start + p)[None, :] * stride_x + offs_c[:, None],
                     mask=mc[:, None] & (mi & (p >= 0))[None, :], other=0.0)
        sv = tl.load(state + (n + i)[None, :], mask=mc[:, None] & (mi & (p < 0))[None, :], other=0.0)
        new = tl.where((p >= 0)[None, :], xv.to(state_ptr.dtype.element_ty), tl.where(keep, sv, 0.0))
        tl.debug_barrier()  # every old column read before any is overwritten
        tl.store(state + i[None, :], new, mask=mc[:, None] & mi[None, :])

    @triton.jit
    def _delta_rule_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, slots_ptr, fresh_ptr, start_ptr,
                           stride_q, stride_k, stride_v, stride_g, stride_b, stride_o, scale, chunk_from,
                           HV: tl.constexpr, REP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                           BK: tl.constexpr, BV: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        start = tl.load(start_ptr + b)
        end = tl.load(start_ptr + b + 1)
        if end - start >= chunk_from:  # the chunked kernel's
            return
        slot = tl.load(slots_ptr + b)
        keep = tl.load(fresh_ptr + b) == 0
        hk = h // REP
        offs_k = tl.arange(0, BK)
        offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
        mk = offs_k < DK
        mv = offs_v < DV
        m = mk[:, None] & mv[None, :]
        s_ptrs = state_ptr + (slot * HV + h) * (DK * DV) + offs_k[:, None] * DV + offs_v[None, :]
        s = tl.where(keep, tl.load(s_ptrs, mask=m, other=0.0), 0.0)
        for t in range(start, end):
            q = tl.load(q_ptr + t * stride_q + hk * DK + offs_k, mask=mk, other=0.0).to(tl.float32)
            k = tl.load(k_ptr + t * stride_k + hk * DK + offs_k, mask=mk, other=0.0).to(tl.float32)
            q = q * (1.0 / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6)) * scale
            k = k * (1.0 / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6))
            v = tl.load(v_ptr + t * stride_v + h * DV + offs_v, mask=mv, other=0.0).to(tl.float32)
            decay = tl.exp(tl.load(g_ptr + t * stride_g + h).to(tl.float32))
            beta = tl.load(beta_ptr + t * stride_b + h).to(tl.float32)
            s = s * decay
            delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
            s = s + k[:, None] * delta[None, :]
            o = tl.sum(s * q[:, None], axis=0)
            tl.store(out_ptr + t * stride_o + h * DV + offs_v, o.to(out_ptr.dtype.element_ty), mask=mv)
        tl.store(s_ptrs, s, mask=m)

    @triton.jit
    def _delta_rule_chunk_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, slots_ptr, fresh_ptr,
                                 start_ptr, stride_q, stride_k, stride_v, stride_g, stride_b, stride_o, scale,
                                 chunk_from, HV: tl.constexpr, REP: tl.constexpr, DK: tl.constexpr,
                                 DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
                                 PREC: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        start = tl.load(start_ptr + b)
        end = tl.load(start_ptr + b + 1)
        if end - start < chunk_from:  # the token-by-token kernel's
            return
        slot = tl.load(slots_ptr + b)
        keep = tl.load(fresh_ptr + b) == 0
        hk = h // REP
        offs_k = tl.arange(0, BK)
        offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
        mk = offs_k < DK
        mv = offs_v < DV
        s_ptrs = state_ptr + (slot * HV + h) * (DK * DV) + offs_k[:, None] * DV + offs_v[None, :]
        s = tl.where(keep, tl.load(s_ptrs, mask=mk[:, None] & mv[None, :], other=0.0), 0.0)
        rows = tl.arange(0, BT)
        causal = rows[:, None] >= rows[None, :]  # [t, s]: s <= t
        strict = rows[:, None] > rows[None, :]
        eye = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
        for c0 in range(start, end, BT):
            t = c0 + rows
            mt = t < end
            q = tl.load(q_ptr + t[:, None] * stride_q + hk * DK + offs_k[None, :], mask=mt[:, None] & mk[None, :],
                        other=0.0).to(tl.float32)
            k = tl.load(k_ptr + t[:, None] * stride_k + hk * DK + offs_k[None, :], mask=mt[:, None] & mk[None, :],
                        other=0.0).to(tl.float32)
            q = q * (1.0 / tl.sqrt(tl.sum(q * q, axis=1) + 1e-6))[:, None] * scale
            k = k * (1.0 / tl.sqrt(tl.sum(k * k, axis=1) + 1e-6))[:, None]
            v = tl.load(v_ptr + t[:, None] * stride_v + h * DV + offs_v[None, :], mask=mt[:, None] & mv[None, :],
                        other=0.0).to(tl.float32)
            g = tl.load(g_ptr + t * stride_g + h, mask=mt, other=0.0).to(tl.float32)
            beta = tl.load(beta_ptr + t * stride_b + h, mask=mt, other=0.0).to(tl.float32)
            gc = tl.sum(tl.where(causal, g[None, :], 0.0), axis=1)  # cumulative log decay within the chunk
            decay = tl.where(causal, tl.exp(tl.where(causal, gc[:, None] - gc[None, :], 0.0)), 0.0)
            kk = tl.dot(k, tl.trans(k), input_precision=PREC)
            lower = tl.where(strict, beta[:, None] * decay * kk, 0.0)
            a = eye  # (I + lower)^-1, row i from the rows before it
            for i in range(1, BT):
                li = tl.sum(tl.where(rows[:, None] == i, lower, 0.0), axis=0)
                a = tl.where(rows[:, None] == i, a - tl.sum(li[:, None] * a, axis=0)[None, :], a)
            gamma = tl.exp(gc)
            ks = tl.dot(k, s, input_precision=PREC)
            u = tl.dot(a, beta[:, None] * (v - gamma[:, None] * ks), input_precision=PREC)
            qk = tl.dot(q, tl.trans(k), input_precision=PREC) * decay
            o = gamma[:, None] * tl.dot(q, s, input_precision=PREC) + tl.dot(qk, u, input_precision=PREC)
            tl.store(out_ptr + t[:, None] * stride_o + h * DV + offs_v[None, :], o.to(out_ptr.dtype.element_ty),
                     mask=mt[:, None] & mv[None, :])
            g_last = tl.sum(tl.where(rows == BT - 1, gc, 0.0), axis=0)  # the masked rows' g are 0: the last token's
            kw = k * tl.exp(g_last - gc)[:, None]
            s = tl.exp(g_last) * s + tl.dot(tl.trans(kw), u, input_precision=PREC)
        tl.store(s_ptrs, s, mask=mk[:, None] & mv[None, :])

    @triton.jit
    def _mamba2_dt(raw, bias, dt_min, dt_max):
        # softplus(raw + bias) with torch's threshold (the input itself above 20), as log(1 + exp) (within 6e-8 of
        # torch's log1p: the rounding of 1 + exp), clamped to [dt_min, dt_max]
        v = raw.to(tl.float32) + bias
        sp = tl.where(v > 20.0, v, tl.log(1.0 + tl.exp(tl.minimum(v, 20.0))))
        return tl.minimum(tl.maximum(sp, dt_min), dt_max)

    @triton.jit
    def _mamba2_scan_kernel(x_ptr, dt_ptr, dt_bias_ptr, a_ptr, b_ptr, c_ptr, d_ptr, state_ptr, out_ptr, slots_ptr,
                            fresh_ptr, start_ptr, stride_x, stride_dt, stride_b, stride_c, stride_o, dt_min, dt_max,
                            chunk_from, H: tl.constexpr, REP: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
                            BP: tl.constexpr, BN: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        start = tl.load(start_ptr + b)
        end = tl.load(start_ptr + b + 1)
        if end - start >= chunk_from:  # the chunked kernel's
            return
        slot = tl.load(slots_ptr + b)
        keep = tl.load(fresh_ptr + b) == 0
        grp = h // REP
        offs_p = tl.program_id(2) * BP + tl.arange(0, BP)
        offs_n = tl.arange(0, BN)
        mp = offs_p < P
        mn = offs_n < N
        m = mp[:, None] & mn[None, :]
        s_ptrs = state_ptr + (slot * H + h) * (P * N) + offs_p[:, None] * N + offs_n[None, :]
        s = tl.where(keep, tl.load(s_ptrs, mask=m, other=0.0), 0.0)
        a = tl.load(a_ptr + h).to(tl.float32)
        d = tl.load(d_ptr + h).to(tl.float32)
        bias = tl.load(dt_bias_ptr + h).to(tl.float32)
        for t in range(start, end):
            dt = _mamba2_dt(tl.load(dt_ptr + t * stride_dt + h), bias, dt_min, dt_max)
            x = tl.load(x_ptr + t * stride_x + h * P + offs_p, mask=mp, other=0.0).to(tl.float32)
            bv = tl.load(b_ptr + t * stride_b + grp * N + offs_n, mask=mn, other=0.0).to(tl.float32)
            cv = tl.load(c_ptr + t * stride_c + grp * N + offs_n, mask=mn, other=0.0).to(tl.float32)
            s = s * tl.exp(dt * a) + (dt * x)[:, None] * bv[None, :]
            y = tl.sum(s * cv[None, :], axis=1) + d * x
            tl.store(out_ptr + t * stride_o + h * P + offs_p, y.to(out_ptr.dtype.element_ty), mask=mp)
        tl.store(s_ptrs, s, mask=m)

    @triton.jit
    def _mamba2_chunk_kernel(x_ptr, dt_ptr, dt_bias_ptr, a_ptr, b_ptr, c_ptr, d_ptr, state_ptr, out_ptr, slots_ptr,
                             fresh_ptr, start_ptr, stride_x, stride_dt, stride_b, stride_c, stride_o, dt_min, dt_max,
                             chunk_from, H: tl.constexpr, REP: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
                             BP: tl.constexpr, BN: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        start = tl.load(start_ptr + b)
        end = tl.load(start_ptr + b + 1)
        if end - start < chunk_from:  # the token-by-token kernel's
            return
        slot = tl.load(slots_ptr + b)
        keep = tl.load(fresh_ptr + b) == 0
        grp = h // REP
        offs_p = tl.program_id(2) * BP + tl.arange(0, BP)
        offs_n = tl.arange(0, BN)
        mp = offs_p < P
        mn = offs_n < N
        s_ptrs = state_ptr + (slot * H + h) * (P * N) + offs_p[:, None] * N + offs_n[None, :]
        s = tl.where(keep, tl.load(s_ptrs, mask=mp[:, None] & mn[None, :], other=0.0), 0.0)  # [BP, BN]
        a = tl.load(a_ptr + h).to(tl.float32)
        d = tl.load(d_ptr + h).to(tl.float32)
        bias = tl.load(dt_bias_ptr + h).to(tl.float32)
        rows = tl.arange(0, BT)
        causal = rows[:, None] >= rows[None, :]  # [t, s]: s <= t
        for c0 in range(start, end, BT):
            t = c0 + rows
            mt = t < end
            dt = _mamba2_dt(tl.load(dt_ptr + t * stride_dt + h, mask=mt, other=0.0), bias, dt_min, dt_max)
            dt = tl.where(mt, dt, 0.0)  # rows past the sequence: no decay, no input
            ac = tl.sum(tl.where(causal, (dt * a)[None, :], 0.0), axis=1)  # cumulative log decay within the chunk
            x = tl.load(x_ptr + t[:, None] * stride_x + h * P + offs_p[None, :], mask=mt[:, None] & mp[None, :],
                        other=0.0).to(tl.float32)  # [BT, BP]
            bv = tl.load(b_ptr + t[:, None] * stride_b + grp * N + offs_n[None, :], mask=mt[:, None] & mn[None, :],
                         other=0.0).to(tl.float32)  # [BT, BN]
            cv = tl.load(c_ptr + t[:, None] * stride_c + grp * N + offs_n[None, :], mask=mt[:, None] & mn[None, :],
                         other=0.0).to(tl.float32)
            decay = tl.where(causal, tl.exp(tl.where(causal, ac[:, None] - ac[None, :], 0.0)), 0.0)
            mix = tl.dot(cv, tl.trans(bv), input_precision=PREC) * decay * dt[None, :]  # [t, s]
            y = tl.dot(mix, x, input_precision=PREC) + tl.exp(ac)[:, None] * tl.dot(cv, tl.trans(s),
                                                                                  input_precision=PREC)
            y = y + d * x
            tl.store(out_ptr + t[:, None] * stride_o + h * P + offs_p[None, :], y.to(out_ptr.dtype.element_ty),
                     mask=mt[:, None] & mp[None, :])
            a_last = tl.sum(tl.where(rows == BT - 1, ac, 0.0), axis=0)  # the masked rows add 0: the last token's
            w = dt * tl.exp(a_last - ac)
            s = tl.exp(a_last) * s + tl.dot(tl.trans(x * w[:, None]), bv, input_precision=PREC)
        tl.store(s_ptrs, s, mask=mp[:, None] & mn[None, :])


def dot_precision(dtype: torch.dtype) -> str:
    """The chunked kernels' tensor-core products: tf32 for bf16 / fp16 activations (finer than their own
    rounding), three tf32 passes (about fp32's precision) for fp32 ones."""
    return "tf32x3" if dtype == torch.float32 else "tf32"


def _rows(t: torch.Tensor, dim: int) -> bool:
    """`dim` dimensions, each row's values (all but the first dimension) laid out contiguously."""
    if t.dim() != dim:
        return False
    inner = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if stride != inner and size > 1:
            return False
        inner *= size
    return True


def _batch_ok(device: torch.device, slots: torch.Tensor, fresh: torch.Tensor, query_start: torch.Tensor) -> bool:
    return all(t.device == device and t.is_contiguous() for t in (slots, fresh, query_start)) \
        and slots.dtype == query_start.dtype == torch.int64 and fresh.dtype == torch.bool \
        and fresh.numel() == slots.numel() == query_start.numel() - 1


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
                  slots: torch.Tensor, fresh: torch.Tensor, query_start: torch.Tensor, silu: bool = True,
                  max_len: int | None = None) -> torch.Tensor | None:
    """Depthwise causal convolution of x [T, C] with weight [C, K] (and bias [C]) over each sequence's tokens, the
    K-1 inputs before them read from conv_state [slots, C, K-1] (zero where fresh) and the last K-1 written back
    (in conv_state's dtype); then SiLU. max_len: the longest sequence's token count (None: read from query_start, a
    host sync). Returns [T, C] in x's dtype, or None where the kernel does not take the tensors."""
    dev = x.device
    ok = HAVE_TRITON and _rows(x, 2) and x.shape[0] > 0 and weight.dim() == 2 and weight.is_contiguous() \
        and weight.shape[0] == x.shape[1] and weight.shape[1] >= 2 and conv_state.is_contiguous() \
        and tuple(conv_state.shape[1:]) == (x.shape[1], weight.shape[1] - 1) \
        and weight.device == conv_state.device == dev and (bias is None or (bias.is_contiguous() and bias.device == dev
                                                                             and bias.numel() == x.shape[1])) \
        and _batch_ok(dev, slots, fresh, query_start)
    if not ok:
        return None
    t, c = x.shape
    k = weight.shape[1]
    b = slots.numel()
    if max_len is None:
        max_len = int((query_start[1:] - query_start[:-1]).max()) if b else 0
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if b == 0 or max_len == 0:
        return out
    blocks_c = triton.cdiv(c, CONV_BLOCK_C)
    _conv_kernel[(b, blocks_c, triton.cdiv(max_len, CONV_BLOCK_T))](
        x, weight, bias if bias is not None else weight, conv_state, out, slots, fresh, query_start, c, x.stride(0),
        out.stride(0), K=k, HAS_BIAS=bias is not None, SILU=silu, BLOCK_T=CONV_BLOCK_T, BLOCK_C=CONV_BLOCK_C)
    _conv_state_kernel[(b, blocks_c)](x, conv_state, slots, fresh, query_start, c, x.stride(0), K=k,
                                      KP=_pow2(k - 1), BLOCK_C=CONV_BLOCK_C)
    return out


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor, query_start: torch.Tensor,
                     max_len: int | None = None, chunk_from: int = DELTA_CHUNK) -> torch.Tensor | None:
    """The gated delta rule over each sequence's tokens (llmd.model.recurrent.gated_delta_rule_ref's function): q, k
    [T, Hk, Dk], v [T, Hv, Dv] (any float dtype, rows contiguous), g (log decay) and beta [T, Hv], state [slots, Hv,
    Dk, Dv] fp32 read (zero where fresh) and written at each sequence's slot. A sequence of chunk_from tokens or more
    runs by the chunked kernel, a shorter one token by token, whatever the other sequences: a decode token's values
    do not depend on its step. max_len: the longest sequence's token count (None: read from query_start, a host
    sync). Returns [T, Hv, Dv] in v's dtype, or None where the kernel does not take the tensors."""
    dev = v.device
    ok = HAVE_TRITON and all(_rows(t, 3) for t in (q, k, v)) and _rows(g, 2) and _rows(beta, 2) \
        and state.dtype == torch.float32 and state.is_contiguous() and state.dim() == 4 \
        and all(t.device == dev for t in (q, k, g, beta, state)) and q.shape == k.shape \
        and q.shape[0] == v.shape[0] == g.shape[0] == beta.shape[0] > 0 and v.shape[1] % q.shape[1] == 0 \
        and tuple(g.shape[1:]) == tuple(beta.shape[1:]) == (v.shape[1],) \
        and tuple(state.shape[1:]) == (v.shape[1], q.shape[2], v.shape[2]) and _batch_ok(dev, slots, fresh, query_start)
    if not ok:
        return None
    t, hk, dk = q.shape
    hv, dv = v.shape[1:]
    out = torch.empty(t, hv, dv, dtype=v.dtype, device=dev)
    b = slots.numel()
    if b == 0:
        return out
    if max_len is None:
        max_len = int((query_start[1:] - query_start[:-1]).max())
    args = (q, k, v, g, beta, state, out, slots, fresh, query_start, q.stride(0), k.stride(0), v.stride(0),
            g.stride(0), beta.stride(0), out.stride(0), dk ** -0.5, max(1, chunk_from))
    shape = dict(HV=hv, REP=hv // hk, DK=dk, DV=dv)
    bv = min(DELTA_BLOCK_V, _pow2(dv))
    _delta_rule_kernel[(b, hv, triton.cdiv(dv, bv))](*args, **shape, BK=_pow2(dk), BV=bv, num_warps=4)
    if max_len >= chunk_from:
        bv = max(16, bv)  # tl.dot takes no dimension under 16
        _delta_rule_chunk_kernel[(b, hv, triton.cdiv(dv, bv))](*args, **shape, BK=max(16, _pow2(dk)), BV=bv,
                                                                BT=DELTA_CHUNK, PREC=dot_precision(v.dtype),
                                                                num_warps=4)
    return out


def mamba2_scan(x: torch.Tensor, dt: torch.Tensor, dt_bias: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                C: torch.Tensor, D: torch.Tensor, state: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor,
                query_start: torch.Tensor, dt_limit: tuple[float, float] = (0.0, float("inf")),
                max_len: int | None = None, chunk_from: int = MAMBA2_CHUNK) -> torch.Tensor | None:
    """Mamba2's selective scan over each sequence's tokens (llmd.model.recurrent.mamba2_scan_ref's function): x [T, H,
    P], dt [T, H] (before the bias), B and C [T, G, N] (any float dtype, rows contiguous), dt_bias, A, D [H], state
    [slots, H, P, N] fp32 read (zero where fresh) and written at each sequence's slot. A sequence of chunk_from tokens
    or more runs by the chunked kernel, a shorter one token by token, whatever the other sequences. max_len: the
    longest sequence's token count (None: read from query_start, a host sync). Returns y [T, H, P] (the D skip added)
    in x's dtype, or None where the kernel does not take the tensors."""
    dev = x.device
    ok = HAVE_TRITON and _rows(x, 3) and _rows(dt, 2) and _rows(B, 3) and _rows(C, 3) and B.shape == C.shape \
        and x.shape[0] == dt.shape[0] == B.shape[0] > 0 and dt.shape[1] == x.shape[1] \
        and x.shape[1] % B.shape[1] == 0 \
        and all(t.is_contiguous() and t.numel() == x.shape[1] for t in (dt_bias, A, D)) \
        and state.dtype == torch.float32 and state.is_contiguous() \
        and tuple(state.shape[1:]) == (x.shape[1], x.shape[2], B.shape[2]) \
        and all(t.device == dev for t in (dt, dt_bias, A, B, C, D, state)) and _batch_ok(dev, slots, fresh, query_start)
    if not ok:
        return None
    t, h, p = x.shape
    g, n = B.shape[1:]
    out = torch.empty(t, h, p, dtype=x.dtype, device=dev)
    b = slots.numel()
    if b == 0:
        return out
    if max_len is None:
        max_len = int((query_start[1:] - query_start[:-1]).max())
    args = (x, dt, dt_bias, A, B, C, D, state, out, slots, fresh, query_start, x.stride(0), dt.stride(0), B.stride(0),
            C.stride(0), out.stride(0), float(dt_limit[0]), float(dt_limit[1]), max(1, chunk_from))
    shape = dict(H=h, REP=h // g, P=p, N=n)
    bp = min(MAMBA2_BLOCK_P, _pow2(p))
    _mamba2_scan_kernel[(b, h, triton.cdiv(p, bp))](*args, **shape, BP=bp, BN=_pow2(n), num_warps=4)
    if max_len >= chunk_from:
        bp = max(16, min(MAMBA2_CHUNK_P, _pow2(p)))  # tl.dot takes no dimension under 16
        # 8 warps: with 4 the bf16 kernel spills registers at Granite 4.0-H's heads (P 64, N 128), with 8 it does not
        # (tests/gpu/compile_offline.py --recurrent)
        _mamba2_chunk_kernel[(b, h, triton.cdiv(p, bp))](*args, **shape, BP=bp, BN=max(16, _pow2(n)),
                                                          BT=MAMBA2_CHUNK, PREC=dot_precision(x.dtype), num_warps=8)
    return out
