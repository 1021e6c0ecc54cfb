"""Varlen attention over the paged KV cache for steps with prefill chunks (layout: llmd.model.attention).

The batch is flattened: sequence i's new tokens are rows query_start_loc[i]:query_start_loc[i+1] of q and sit at
positions [seq_len - q_len, seq_len) of its context; their K/V are already in the cache. Each token attends causally
to its cached prefix and to the chunk up to itself. Decode rows (q_len 1) and speculative verifies are just short
chunks.

One program handles one tile of a sequence's new tokens for one KV head. The query heads that share the KV head are
packed into the tile's rows (row r = token r // GROUP_PAD, head r % GROUP_PAD), so each K/V tile loaded through the
block table serves the whole group. Keys before the tile's first token are visible to every row and need no causal
mask; only the last stretch (at most one tile of tokens) is masked. Online softmax with fp32 accumulators, in base 2.

A sliding window (`window`, a per-layer option) hides keys at or before q_pos - window too: a tile then folds only
[first row's q_pos - window + 1, its last key) in one masked pass (rows may see none of a tile's keys, so the running
max is guarded against -inf).

Soft-capping (`softcap`, Gemma 2) turns each score (after the scale, before the mask and softmax) into
softcap * tanh(score / softcap), with paged_attention's `softcap_tanh`; a compile-time switch (SOFTCAP), so kernels
without it are unchanged. The scale then goes in two parts: 1 / softcap before the tanh, softcap * log2(e) after.

Attention sinks (`sinks`, gpt-oss: fp32 [heads]): each head's sink logit joins the softmax denominator of its rows,
folded into the running max and sum (in base 2, as sink * log2(e)) before the program normalises; a compile-time
switch (SINKS), so kernels without it are unchanged.

Programs are laid out without any host-side plan: sequence i's tiles are numbered from
query_start_loc[i] // BLOCK_Q + i, a strictly increasing start, and each program finds its sequence by binary search
over query_start_loc. cdiv(T, BLOCK_Q) + B programs per KV head cover every tile; the few left over exit at once.
"""

from __future__ import annotations

import math
import os

import torch

from ._triton import HAVE_TRITON, tl, triton


def paged_prefill_attention_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, max_query_len: int | None = None,
    *, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    block_m: int | None = None, block_n: int | None = None, num_warps: int | None = None,
    num_stages: int | None = None, window: int | None = None, softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, H, D] -> [T, H, D], computed in fp32 (window: keys in (q_pos - window, q_pos] only; softcap: scores ->
    softcap * tanh(scores / softcap), None or 0: as they are; sinks [H]: each head's logit joins its softmax
    denominator, None: none). k_scale/v_scale [num_blocks, block_size, kv_heads]:
    the caches hold int8 values x / scale. max_query_len and the tile settings do not change the result; they are
    accepted so the signature matches the kernel."""
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()

    def context(cache, cache_scale, ids, s_len):  # [H, S, D] fp32, each KV head repeated for its query heads
        x = cache[ids].flatten(0, 1)[:s_len].to(torch.float32)
        if cache_scale is not None:
            x = x * cache_scale[ids].flatten(0, 1)[:s_len, :, None]
        return x.repeat_interleave(group, dim=1).transpose(0, 1)

    for i, s_len in enumerate(seq_lens.tolist()):
        first, last = starts[i], starts[i + 1]
        if first == last:
            continue
        ids = block_tables[i, : (s_len + block_size - 1) // block_size]
        k, v = context(k_cache, k_scale, ids, s_len), context(v_cache, v_scale, ids, s_len)
        qs = q[first:last].transpose(0, 1).to(torch.float32)  # [H, L, D]
        scores = torch.einsum("hld,hsd->hls", qs, k) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(s_len - (last - first), s_len, device=q.device)
        k_pos = torch.arange(s_len, device=q.device)[None, :]
        hidden = k_pos > q_pos[:, None]
        if window is not None:
            hidden |= k_pos <= q_pos[:, None] - window
        scores = scores.masked_fill(hidden, float("-inf"))
        if sinks is not None:  # the sink joins the softmax, then is dropped
            scores = torch.cat((scores, sinks.float()[:, None, None].expand(-1, scores.shape[1], 1)), dim=-1)
        probs = scores.softmax(-1)[..., :s_len]
        out[first:last] = torch.einsum("hls,hsd->hld", probs, v).transpose(0, 1).to(q.dtype)
    return out


if HAVE_TRITON:
    from .paged_attention import load_kv_tile, softcap_tanh

    @triton.jit
    def _attend_range(
        acc, l_i, m_i, q, q_pos, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row_ptr, kvh, begin, end, d, d_mask, block_size,
        stride_kb, stride_kt, stride_kh, stride_sb, stride_st, stride_sh, qk_scale, cap_scale, window,
        BLOCK_N: tl.constexpr, QUANT: tl.constexpr, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr,
        SOFTCAP: tl.constexpr,
    ):
        """Fold context positions [begin, end) into the running softmax of every row; CAUSAL also hides keys past
        each row's own position, WINDOWED (with CAUSAL) those at or before q_pos - window. SOFTCAP: the scores are
        cap_scale * tanh(q.k * qk_scale) (qk_scale = scale / softcap, cap_scale = softcap * log2(e))."""
        for t0 in range(begin, end, BLOCK_N):
            t = t0 + tl.arange(0, BLOCK_N)
            t_mask = t < end
            blk = tl.load(bt_row_ptr + t // block_size, mask=t_mask, other=0).to(tl.int64)
            off = t % block_size
            row = blk * stride_kb + off * stride_kt + kvh * stride_kh
            scale_row = blk * stride_sb + off * stride_st + kvh * stride_sh
            k = load_kv_tile(k_ptr, ks_ptr, row, scale_row, t_mask, d, d_mask, QUANT).to(q.dtype)
            v = load_kv_tile(v_ptr, vs_ptr, row, scale_row, t_mask, d, d_mask, QUANT).to(q.dtype)
            s = tl.dot(q, tl.trans(k), out_dtype=tl.float32) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
            if SOFTCAP:
                s = cap_scale * softcap_tanh(s)
            if CAUSAL:
                visible = t_mask[None, :] & (t[None, :] <= q_pos[:, None])
            else:
                visible = t_mask[None, :]
            if WINDOWED:
                visible = visible & (t[None, :] > q_pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_sub = m_new  # every row sees the first key of each range (see the caller), so m stays finite...
            if WINDOWED:  # ...except here, where a row may see none of these keys yet: no -inf - -inf (NaN)
                m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_sub[:, None])
            alpha = tl.exp2(m_i - m_sub)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, out_dtype=tl.float32)
            m_i = m_new
        return acc, l_i, m_i

    # Not specialized on the per-step values num_seqs (Triton compiles 1 apart) and the block-table row stride (1, a
    # multiple of 16, other): they only bound a search and offset one load, and each variant is a compile mid-serving.
    @triton.jit(do_not_specialize=["num_seqs", "stride_btb"])
    def _paged_prefill_kernel(
        q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, sl_ptr, qsl_ptr, sinks_ptr, out_ptr, qk_scale, cap_scale, num_seqs,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_kt, stride_kh, stride_sb, stride_st, stride_sh,
        stride_btb, block_size, window,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QUANT: tl.constexpr, WINDOWED: tl.constexpr,
        SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
    ):
        BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_PAD  # query tokens per tile
        tile = tl.program_id(0)
        kvh = tl.program_id(1)

        # the sequence whose tiles include this one: the last i with query_start_loc[i] // BLOCK_Q + i <= tile
        lo = tile * 0
        hi = lo + num_seqs
        while hi - lo > 1:
            mid = (lo + hi) // 2
            first_tile = tl.load(qsl_ptr + mid).to(tl.int32) // BLOCK_Q + mid
            lo = tl.where(first_tile <= tile, mid, lo)
            hi = tl.where(first_tile <= tile, hi, mid)
        seq = lo
        q_start = tl.load(qsl_ptr + seq).to(tl.int32)
        q_len = tl.load(qsl_ptr + seq + 1).to(tl.int32) - q_start
        j0 = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # first token of this tile within the chunk
        if j0 >= q_len:
            return
        seq_len = tl.load(sl_ptr + seq).to(tl.int32)
        chunk_pos = seq_len - q_len  # context position of the chunk's first token

        r = tl.arange(0, BLOCK_M)
        tok = j0 + r // GROUP_PAD
        g = r % GROUP_PAD
        row_mask = (tok < q_len) & (g < GROUP)
        heads = kvh * GROUP + g
        q_pos = chunk_pos + tok
        d = tl.arange(0, D_PAD)
        d_mask = d < HEAD_DIM
        io_mask = row_mask[:, None] & d_mask[None, :]
        flat_row = (q_start + tok).to(tl.int64)
        q = tl.load(q_ptr + flat_row[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                    mask=io_mask, other=0.0)

        m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, D_PAD), dtype=tl.float32)
        bt_row_ptr = bt_ptr + seq.to(tl.int64) * stride_btb
        shared_end = chunk_pos + j0
        causal_end = tl.minimum(shared_end + BLOCK_Q, seq_len)
        if WINDOWED:
            # one masked pass from the first key the tile's first row sees (no block before it is read)
            begin = tl.maximum(shared_end - window + 1, 0)
            acc, l_i, m_i = _attend_range(
                acc, l_i, m_i, q, q_pos, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row_ptr, kvh, begin, causal_end, d,
                d_mask, block_size, stride_kb, stride_kt, stride_kh, stride_sb, stride_st, stride_sh, qk_scale,
                cap_scale, window, BLOCK_N, QUANT, True, True, SOFTCAP,
            )
        else:
            # keys before the tile's first token: visible to every row
            acc, l_i, m_i = _attend_range(
                acc, l_i, m_i, q, q_pos, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row_ptr, kvh, 0, shared_end, d, d_mask,
                block_size, stride_kb, stride_kt, stride_kh, stride_sb, stride_st, stride_sh, qk_scale, cap_scale,
                window, BLOCK_N, QUANT, False, False, SOFTCAP,
            )
            # the tile's own tokens: causal (row with token j sees up to chunk_pos + j; rows past q_len not stored)
            acc, l_i, m_i = _attend_range(
                acc, l_i, m_i, q, q_pos, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row_ptr, kvh, shared_end, causal_end, d,
                d_mask, block_size, stride_kb, stride_kt, stride_kh, stride_sb, stride_st, stride_sh, qk_scale,
                cap_scale, window, BLOCK_N, QUANT, True, False, SOFTCAP,
            )
        if SINKS:  # one more term of the denominator (base 2), the max taken over it too
            sink = tl.load(sinks_ptr + heads, mask=row_mask, other=0.0) * 1.4426950408889634
            m_new = tl.maximum(m_i, sink)
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.exp2(sink - m_new)
            acc = acc * alpha[:, None]
        if WINDOWED:  # padding rows past the chunk may see no key at all (they are not stored)
            l_i = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_i[:, None]
        tl.store(out_ptr + flat_row[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=io_mask)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _scale_args(k_cache, k_scale, v_scale):
    """(k_scale, v_scale, their strides, quant) for the kernel; placeholders that are never read for an fp cache."""
    if k_scale is None:
        return k_cache, k_cache, (0, 0, 0), False
    if v_scale is None or k_scale.stride() != v_scale.stride() or k_scale.shape != k_cache.shape[:3]:
        raise ValueError("an int8 cache needs K and V scales of shape [num_blocks, block_size, kv_heads], "
                         "with the same layout")
    return k_scale, v_scale, k_scale.stride(), True


def paged_prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, max_query_len: int | None = None,
    *, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    block_m: int | None = None, block_n: int | None = None, num_warps: int | None = None,
    num_stages: int | None = None, window: int | None = None, softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton version of `paged_prefill_attention_ref`. max_query_len (a host int; read from query_start_loc when
    not given) lets steps of short chunks (speculative verifies) use smaller tiles. block_m (rows = tokens x padded
    group), block_n (keys per step), num_warps and num_stages override the tile choice (tests, tuning)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group onto {num_kv_heads} KV heads")
    if k_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("q and the KV cache must be contiguous in head_dim")
    if k_cache.stride() != v_cache.stride():
        raise ValueError("the K and V caches must have the same layout")
    k_scale, v_scale, scale_strides, quant = _scale_args(k_cache, k_scale, v_scale)
    if sinks is not None and (sinks.dtype != torch.float32 or sinks.shape != (num_heads,) or not sinks.is_contiguous()):
        raise ValueError(f"sinks must be a contiguous fp32 [{num_heads}] tensor")
    out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    group_pad = _next_pow2(group)
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if block_m is None:  # enough rows for the longest chunk's tokens, up to a full tile
        block_m = min(32 if interp else 128, _next_pow2(max(1, max_query_len)) * group_pad)
    block_m = max(16, block_m, group_pad)  # tl.dot needs 16 rows; a tile holds at least one token's group
    if block_n is None:
        block_n = 16 if interp else 64
    block_q = block_m // group_pad
    grid = (triton.cdiv(num_tokens, block_q) + num_seqs, num_kv_heads)
    if softcap:  # tanh(q.k * scale / softcap), then back to log2 units
        qk_scale, cap_scale = scale / softcap, softcap * math.log2(math.e)
    else:
        qk_scale, cap_scale = scale * math.log2(math.e), 1.0
    _paged_prefill_kernel[grid](
        q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, query_start_loc,
        q if sinks is None else sinks, out, qk_scale, cap_scale, num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), *scale_strides, block_tables.stride(0), k_cache.shape[1], window or 0,
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, D_PAD=max(16, _next_pow2(head_dim)),
        BLOCK_M=block_m, BLOCK_N=block_n, QUANT=quant, WINDOWED=bool(window), SOFTCAP=bool(softcap),
        SINKS=sinks is not None,
        # compiled for sm_90 these tiles use wgmma (block_m >= 64) and cp.async double-buffered K/V without spills
        **({} if interp else {"num_warps": num_warps or (8 if block_m >= 128 else 4), "num_stages": num_stages or 2}),
    )
    return out
