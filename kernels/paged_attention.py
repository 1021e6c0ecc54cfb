"""Decode attention over the paged KV cache (layout: llmd.model.attention), with a split-KV variant.

One program handles one (sequence, KV head, split): it loads the query heads that share that KV head together, so
each K/V row is read from memory once per group rather than once per query head, and streams the context through the
block table with an online softmax. With several splits each program covers a slice of the context and writes its
unnormalised partial result; a small combine step merges the slices (long contexts at small batch would otherwise
leave most of the GPU idle).

The grid's split count is chosen on the host from the batch size and an upper bound of the context lengths; each
program then sizes its slice from its own sequence's length, read on the device (at most that many slices, none
shorter than `min_split_tokens`). So the launch depends on no per-step host value beyond the bound, and a CUDA graph
captured with the bound max_model_len (llmd.engine.cuda_graphs) still splits a short context little and a long one
fully.

A sliding window (`window`, a per-layer option) starts each sequence's range at max(0, seq_len - window): only the
window's tokens are split and read.

Soft-capping (`softcap`, Gemma 2's per-layer option): each score (after the scale, before the softmax) becomes
softcap * tanh(score / softcap). It is a compile-time switch (SOFTCAP), so kernels without it are unchanged. Triton has
no portable tanh (libdevice's is not there in every version, nor under TRITON_INTERPRET=1): `softcap_tanh` computes it
from exp, with a series near 0 so that the error stays relative to the score even for a huge cap.

Attention sinks (`sinks`, gpt-oss's per-layer option: fp32 [heads]): each head's sink logit joins the softmax
denominator of its query. A compile-time switch (SINKS) too: with one split the program folds the sink into its
running max and sum before it normalises; with several, the combine step takes it in as one more slice without a value.

An int8 cache (llmd.model.kv_int8: int8 values plus an fp32 scale per token per KV head) is dequantized as it is
loaded, by `load_kv_tile`, a jit helper that other kernels reading the paged cache (prefill) can call too.
"""

from __future__ import annotations

import os

import torch

from ._triton import HAVE_TRITON, tl, triton

MIN_SPLIT_TOKENS = 256  # a shorter slice of a context costs more in the combine than it saves


def paged_decode_attention_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, num_splits: int | None = None, max_seq_len: int | None = None,
    *, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    min_split_tokens: int = MIN_SPLIT_TOKENS, window: int | None = None, softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, H, D] (one new token per sequence, already in the cache) -> [B, H, D]. num_splits, max_seq_len and
    min_split_tokens do not change the result; they are accepted so the signature matches the kernel.
    k_scale/v_scale [num_blocks, block_size, kv_heads]: the caches hold int8 values x / scale. window: attend to
    the last `window` tokens only. softcap: scores -> softcap * tanh(scores / softcap) (None or 0: as they are).
    sinks [H]: each head's logit joins its softmax denominator (None: none)."""
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.empty_like(q)

    def context(cache, cache_scale, ids, s_len):  # [S, H, D] fp32, each KV head repeated for its query heads
        x = cache[ids].flatten(0, 1)[:s_len].to(torch.float32)
        if cache_scale is not None:
            x = x * cache_scale[ids].flatten(0, 1)[:s_len, :, None]
        return x.repeat_interleave(group, dim=1)

    for b, s_len in enumerate(seq_lens.tolist()):
        n_blocks = (s_len + block_size - 1) // block_size
        ids = block_tables[b, :n_blocks]
        lo = 0 if window is None else max(0, s_len - window)
        k = context(k_cache, k_scale, ids, s_len)[lo:]
        v = context(v_cache, v_scale, ids, s_len)[lo:]
        scores = torch.einsum("hd,shd->hs", q[b].to(torch.float32), k) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        if sinks is not None:  # the sink joins the softmax, then is dropped
            scores = torch.cat((scores, sinks.float()[:, None]), dim=-1)
        probs = scores.softmax(-1)[:, : k.shape[0]]
        out[b] = torch.einsum("hs,shd->hd", probs, v).to(q.dtype)
    return out


if HAVE_TRITON:

    @triton.jit
    def load_kv_tile(ptr, scale_ptr, row, scale_row, t_mask, d, d_mask, QUANT: tl.constexpr):
        """A [BLOCK_T, D_PAD] tile of a K or V cache: token t's head vector starts at element `row[t]`, its scale
        (QUANT: int8 cache) at `scale_row[t]`. Masked rows and columns read 0. Returns the cache dtype, or fp32
        dequantized values for an int8 cache; the caller casts to its compute dtype."""
        x = tl.load(ptr + row[:, None] + d[None, :], mask=t_mask[:, None] & d_mask[None, :], other=0)
        if QUANT:
            s = tl.load(scale_ptr + scale_row, mask=t_mask, other=0.0)
            x = x.to(tl.float32) * s[:, None]
        return x

    @triton.jit
    def softcap_tanh(x):
        """tanh of an fp32 tensor, to a few ulp relative: (1 - e) / (1 + e) with e = exp(-2|x|) (never overflows),
        and below |x| = 1/4, where 1 - e would cancel, its Taylor series to x^9 (the next term is < 1e-8 relative)."""
        a = tl.abs(x)
        e = tl.exp(-2.0 * a)
        far = (1.0 - e) / (1.0 + e)
        s = tl.minimum(a, 0.25)
        s2 = s * s
        near = s * (1.0 + s2 * (-1.0 / 3.0 + s2 * (2.0 / 15.0 + s2 * (-17.0 / 315.0 + s2 * (62.0 / 2835.0)))))
        t = tl.where(a < 0.25, near, far)
        return tl.where(x < 0, -t, t)

    # The block-table row stride (the step's widest table in eager steps) is not specialized on: Triton would compile
    # apart a width of 1, of a multiple of 16 and any other width, a new compile mid-serving for no speed.
    @triton.jit(do_not_specialize=["stride_btb"])
    def _paged_decode_kernel(
        q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, sl_ptr, sinks_ptr, out_ptr, m_ptr, l_ptr, scale,
        stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_sb, stride_st, stride_sh, stride_btb,
        stride_ob, stride_oh, stride_os, block_size, min_split_tokens, window, softcap,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
        BLOCK_T: tl.constexpr, SPLIT: tl.constexpr, QUANT: tl.constexpr, SOFTCAP: tl.constexpr,
        SINKS: tl.constexpr,
    ):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        sp = tl.program_id(2)
        seq_len = tl.load(sl_ptr + b).to(tl.int32)
        # the tokens it attends to: [lo, seq_len), lo > 0 only under a sliding window (window 0: none)
        lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
        # this sequence's own slices: at most SPLIT, none shorter than min_split_tokens, whole BLOCK_T tiles; the
        # programs past its last slice store an empty result (m = -inf, l = 0), which the combine weighs 0
        n_split = tl.minimum(tl.maximum((seq_len - lo) // min_split_tokens, 1), SPLIT)
        per_split = ((seq_len - lo + n_split - 1) // n_split + BLOCK_T - 1) // BLOCK_T * BLOCK_T
        start = lo + sp * per_split
        end = tl.minimum(start + per_split, seq_len)

        g = tl.arange(0, GROUP_PAD)
        heads = kvh * GROUP + g
        h_mask = g < GROUP
        d = tl.arange(0, D_PAD)
        d_mask = d < HEAD_DIM
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                    mask=h_mask[:, None] & d_mask[None, :], other=0.0)
        q = (q.to(tl.float32) * scale).to(q_ptr.dtype.element_ty)

        m_i = tl.full((GROUP_PAD,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((GROUP_PAD,), dtype=tl.float32)
        acc = tl.zeros((GROUP_PAD, D_PAD), dtype=tl.float32)
        for t0 in range(start, end, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            t_mask = t < end
            blk = tl.load(bt_ptr + b * stride_btb + t // block_size, mask=t_mask, other=0)
            row = blk.to(tl.int64) * stride_kb + (t % block_size) * stride_kt + kvh * stride_kh
            scale_row = blk.to(tl.int64) * stride_sb + (t % block_size) * stride_st + kvh * stride_sh
            k = load_kv_tile(k_ptr, ks_ptr, row, scale_row, t_mask, d, d_mask, QUANT).to(q.dtype)
            v = load_kv_tile(v_ptr, vs_ptr, row, scale_row, t_mask, d, d_mask, QUANT).to(q.dtype)
            s = tl.dot(q, tl.trans(k), out_dtype=tl.float32)  # [GROUP_PAD, BLOCK_T], q already scaled
            if SOFTCAP:
                s = softcap * softcap_tanh(s / softcap)
            s = tl.where(t_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, out_dtype=tl.float32)
            m_i = m_new

        o_mask = h_mask[:, None] & d_mask[None, :]
        o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + sp * stride_os + d[None, :]
        if SPLIT == 1:
            if SINKS:  # one more term of the denominator, the max taken over it too
                sink = tl.load(sinks_ptr + heads, mask=h_mask, other=0.0)
                m_new = tl.maximum(m_i, sink)
                alpha = tl.exp(m_i - m_new)
                l_i = l_i * alpha + tl.exp(sink - m_new)
                acc = acc * alpha[:, None]
            tl.store(o_ptrs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=o_mask)
        else:
            tl.store(o_ptrs, acc, mask=o_mask)
            ml_off = (b * tl.num_programs(1) * GROUP + heads) * SPLIT + sp
            tl.store(m_ptr + ml_off, m_i, mask=h_mask)
            tl.store(l_ptr + ml_off, l_i, mask=h_mask)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, num_sms: int = 132) -> int:
    """Enough programs to fill the GPU (about two per SM), and no split shorter than MIN_SPLIT_TOKENS."""
    programs = batch * num_kv_heads
    if programs >= 2 * num_sms:
        return 1
    by_length = max(1, max_seq_len // MIN_SPLIT_TOKENS)
    return max(1, min(16, by_length, (2 * num_sms + programs - 1) // programs))


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, num_splits: int | None = None, max_seq_len: int | None = None,
    *, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    min_split_tokens: int = MIN_SPLIT_TOKENS, window: int | None = None, softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton version of `paged_decode_attention_ref`. max_seq_len (a host int, any upper bound of seq_lens) picks
    the grid's split count without a sync; num_splits overrides it. Each sequence uses at most that many splits,
    none shorter than min_split_tokens (tests lower it to exercise splitting on tiny contexts)."""
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group onto {num_kv_heads} KV heads")
    if k_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("q and the KV cache must be contiguous in head_dim")
    if k_cache.stride() != v_cache.stride():
        raise ValueError("the K and V caches must have the same layout")
    quant = k_scale is not None
    if k_scale is not None:
        if v_scale is None or k_scale.stride() != v_scale.stride() or k_scale.shape != k_cache.shape[:3]:
            raise ValueError("an int8 cache needs K and V scales of shape [num_blocks, block_size, kv_heads], "
                             "with the same layout")
        scale_strides = k_scale.stride()
    else:
        k_scale = v_scale = k_cache  # placeholders: never read when QUANT is off
        scale_strides = (0, 0, 0)
    group = num_heads // num_kv_heads
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    if num_splits is None:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())  # a device->host sync: callers on the hot path pass it
        if window:
            max_seq_len = min(max_seq_len, window)  # what a sequence reads
        sms = 132 if interp or not q.is_cuda else torch.cuda.get_device_properties(q.device).multi_processor_count
        num_splits = choose_num_splits(batch, num_kv_heads, max_seq_len, sms)
    block_t = 32 if interp else 64
    if num_splits == 1:
        out = torch.empty_like(q)
        part, m, l = out.unsqueeze(2), out, out  # m/l unused
    else:
        part = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        m = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
        l = torch.empty_like(m)
    if sinks is not None and (sinks.dtype != torch.float32 or sinks.shape != (num_heads,) or not sinks.is_contiguous()):
        raise ValueError(f"sinks must be a contiguous fp32 [{num_heads}] tensor")
    _paged_decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, q if sinks is None else sinks, part, m, l,
        scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), *scale_strides,
        block_tables.stride(0), part.stride(0), part.stride(1), part.stride(2), block_size, max(1, min_split_tokens),
        window or 0, float(softcap or 1.0), GROUP=group, GROUP_PAD=max(16, _next_pow2(group)), HEAD_DIM=head_dim, D_PAD=max(16, _next_pow2(head_dim)),
        BLOCK_T=block_t, SPLIT=num_splits, QUANT=quant, SOFTCAP=bool(softcap), SINKS=sinks is not None,
        **({} if interp else {"num_warps": 4, "num_stages": 2}),
    )
    if num_splits == 1:
        return out
    # Merge the slices: weight each by exp(its max - overall max); empty slices have m = -inf and weigh 0. A sink is
    # one more slice with m = sink, l = 1 and no value.
    m_all = m.amax(dim=-1, keepdim=True)
    if sinks is None:
        w = torch.exp(m - m_all)
        return ((part * w.unsqueeze(-1)).sum(2) / (l * w).sum(-1, keepdim=True)).to(q.dtype)
    sink = sinks.view(1, num_heads, 1)
    m_all = torch.maximum(m_all, sink)
    w = torch.exp(m - m_all)
    denominator = (l * w).sum(-1, keepdim=True) + torch.exp(sink - m_all)
    return ((part * w.unsqueeze(-1)).sum(2) / denominator).to(q.dtype)
