"""The compiled fp32 glue ops (llmd.kernels.cpu_ops) against their torch forms: RMSNorm, RoPE, SiLU * up, gpt-oss's
clamped SwiGLU, the paged KV write and decode attention (GQA ratios 1/3/8, partial blocks, a subset of rows, sliding
windows, soft-caps), and decode attention's batch and thread invariance. Where no C compiler exists every op returns
None/False; the tests then check that instead."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmd.kernels import cpu_ops
from llmd.model.attention import AttentionMetadata, torch_paged_attention
from llmd.model.ops import apply_rope, greedy_tokens, torch_swiglu_clamped_mul

HAVE_OPS = cpu_ops.load() is not None


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("rows,n", [(1, 576), (5, 40), (33, 3), (2, 1536)])
def test_rms_norm(rows, n):
    g = _gen()
    x, w = torch.randn(rows, n, generator=g) * 3, torch.randn(n, generator=g)
    got = cpu_ops.rms_norm(x, w, 1e-6)
    if not HAVE_OPS:
        assert got is None
        return
    torch.testing.assert_close(got, F.rms_norm(x, (n,), w, 1e-6), rtol=2e-6, atol=1e-6)
    assert cpu_ops.rms_norm(x.half(), w.half(), 1e-6) is None  # fp32 only
    assert cpu_ops.rms_norm(x, w[:-1], 1e-6) is None  # a weight of another size: torch's path raises


@pytest.mark.parametrize("heads,d", [(12, 64), (3, 8), (5, 6)])
def test_rope_in_place_equals_apply_rope(heads, d):
    g = _gen()
    t, extra = 7, 5  # rows of a fused qkv: the rotated heads, then columns left alone
    qkv = torch.randn(t, heads * d + extra, generator=g)
    cos, sin = torch.randn(t, 1, d, generator=g), torch.randn(t, 1, d, generator=g)
    want = apply_rope(qkv[:, : heads * d].view(t, heads, d), cos, sin)
    tail = qkv[:, heads * d :].clone()
    done = cpu_ops.rope_(qkv, cos, sin, heads, d)
    if not HAVE_OPS:
        assert not done
        return
    assert torch.equal(qkv[:, : heads * d].view(t, heads, d), want)  # the same products and sums: bit for bit
    assert torch.equal(qkv[:, heads * d :], tail)


@pytest.mark.parametrize("rows,n", [(1, 1536), (9, 13)])
def test_silu_mul(rows, n):
    gate_up = torch.randn(rows, 2 * n, generator=_gen()) * 6
    gate_up[0, :3] = torch.tensor([-100.0, 100.0, 0.0])  # exp's clamps
    got = cpu_ops.silu_mul(gate_up, n)
    if not HAVE_OPS:
        assert got is None
        return
    torch.testing.assert_close(got, F.silu(gate_up[:, :n]) * gate_up[:, n:], rtol=2e-6, atol=1e-6)
    assert torch.equal(cpu_ops.silu_mul(gate_up[-1:], n), got[-1:])


@pytest.mark.parametrize("rows,n", [(1, 2880), (9, 13)])
def test_swiglu_clamped_mul(rows, n):
    """gpt-oss's clamped SwiGLU against transformers' torch ops: values past the limit on both sides, exp's clamps,
    and a NaN (kept, as torch.clamp keeps it) in the vector part and in the scalar tail."""
    gate_up = torch.randn(rows, 2 * n, generator=_gen()) * 6
    gate_up[0, :3] = torch.tensor([-100.0, 100.0, 0.0])
    gate_up[-1, [1, n - 2, n + 2, 2 * n - 1]] = float("nan")
    got = cpu_ops.swiglu_clamped_mul(gate_up, n, 1.702, 7.0)
    if not HAVE_OPS:
        assert got is None
        return
    torch.testing.assert_close(got, torch_swiglu_clamped_mul(gate_up, n, 1.702, 7.0), rtol=2e-6, atol=1e-6,
                               equal_nan=True)
    assert got[-1].isnan().sum() == 4
    assert torch.equal(cpu_ops.swiglu_clamped_mul(gate_up[-1:], n, 1.702, 7.0).nan_to_num(), got[-1:].nan_to_num())


def test_write_kv_and_a_bad_slot():
    g = _gen()
    k_cache, v_cache = torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8)
    qkv = torch.randn(3, 6 * 8, generator=g)  # k and v as views of a fused output
    k, v = qkv[:, 16:32].view(3, 2, 8), qkv[:, 32:].view(3, 2, 8)
    slots = torch.tensor([5, 14, 0])
    if not cpu_ops.write_kv(k, v, (k_cache, v_cache), slots):
        assert not HAVE_OPS
        return
    assert torch.equal(k_cache.view(16, 2, 8)[slots], k) and torch.equal(v_cache.view(16, 2, 8)[slots], v)
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 3
    with pytest.raises(IndexError, match="slot"):
        cpu_ops.write_kv(k, v, (k_cache, v_cache), torch.tensor([1, 16, 2]))


def _paged_case(group: int, lens: list[int], block_size: int = 4, kv_heads: int = 2, d: int = 16, seed: int = 0):
    g = _gen(seed)
    num_blocks = sum((n + block_size - 1) // block_size for n in lens) + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, d, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, d, generator=g)
    order = torch.randperm(num_blocks, generator=g).tolist()  # blocks scattered through the pool
    tables, used = [], 0
    for n in lens:
        nb = (n + block_size - 1) // block_size
        tables.append(order[used : used + nb])
        used += nb
    q = torch.randn(len(lens), kv_heads * group, d, generator=g)
    return q, k_cache, v_cache, tables


@pytest.mark.parametrize("group", [1, 3, 8])
def test_decode_attention_matches_the_reference(group):
    lens = [1, 4, 5, 17, 9]  # one token, a full block, partial last blocks
    q, k_cache, v_cache, tables = _paged_case(group, lens)
    meta = AttentionMetadata.build([1] * len(lens), lens, tables, 4)
    want = torch_paged_attention(q, (k_cache, v_cache), meta, 0.25)
    got = torch.full_like(q, float("nan"))
    plan_tables = meta.block_tables.contiguous()
    if not cpu_ops.decode_attention(q, (k_cache, v_cache), plan_tables, meta.seq_lens, None, 0.25, got):
        assert not HAVE_OPS
        return
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_decode_attention_is_batch_and_thread_invariant():
    """A sequence's output is bit for bit the same alone, in a batch, at another row, and with other thread counts."""
    lens = [30, 7, 64, 1, 12]
    q, k_cache, v_cache, tables = _paged_case(3, lens, seed=1)
    meta = AttentionMetadata.build([1] * len(lens), lens, tables, 4)
    full = torch.empty_like(q)
    if not cpu_ops.decode_attention(q, (k_cache, v_cache), meta.block_tables, meta.seq_lens, None, 0.3, full):
        assert not HAVE_OPS
        return
    for i in range(len(lens)):
        alone = torch.empty_like(q[i : i + 1])
        table = meta.block_tables[i : i + 1, : (lens[i] + 3) // 4].contiguous()
        cpu_ops.decode_attention(q[i : i + 1], (k_cache, v_cache), table, meta.seq_lens[i : i + 1], None, 0.3, alone)
        assert torch.equal(alone, full[i : i + 1])
    # the queries at other rows of a larger batch (a step that mixes in prefill chunks)
    wide, out = torch.randn(9, *q.shape[1:]), torch.zeros(9, *q.shape[1:])
    rows = torch.tensor([8, 0, 3, 5, 6])
    wide[rows] = q
    cpu_ops.decode_attention(wide, (k_cache, v_cache), meta.block_tables, meta.seq_lens, rows, 0.3, out)
    assert torch.equal(out[rows], full) and not out[[1, 2, 4, 7]].any()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        again = torch.empty_like(q)
        cpu_ops.decode_attention(q, (k_cache, v_cache), meta.block_tables, meta.seq_lens, None, 0.3, again)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(again, full)


@pytest.mark.parametrize("softcap", [None, 1.5])
@pytest.mark.parametrize("group,d", [(1, 16), (3, 16), (8, 16), (3, 24)])  # d 24: a scalar tail after 16
def test_a_decoded_token_attends_bit_for_bit_as_in_a_chunk(group, d, softcap):
    """Decode attention and chunk attention give a query the very same numbers, so a token's output does not depend
    on whether it was decoded, verified in a speculative chunk or recomputed in a prefill after preemption; nor on
    whether its query heads ran one per task (few sequences) or tiled together (many). With a soft-cap too."""
    if not HAVE_OPS:
        return
    lens = [1, 5, 17, 40]
    q, k_cache, v_cache, tables = _paged_case(group, lens, d=d, seed=2)
    threads = torch.get_num_threads()
    for i, n in enumerate(lens):
        table = torch.tensor(tables[i])
        chunk_len = min(n, 6)
        chunk = torch.randn(chunk_len, *q.shape[1:], generator=_gen(i))
        chunk[-1] = q[i]  # the chunk's last query is the decoded one, at the same position
        in_chunk = torch.empty_like(chunk)
        assert cpu_ops.prefill_attention(chunk, (k_cache, v_cache), table, n, 0.3, in_chunk, softcap=softcap)
        for t in (1, 4):  # one query head per task, or tiles of query heads sharing their KV head
            torch.set_num_threads(t)
            try:
                decoded = torch.empty_like(q[i : i + 1])
                assert cpu_ops.decode_attention(q[i : i + 1], (k_cache, v_cache), table[None], torch.tensor([n]), None,
                                                0.3, decoded, softcap=softcap)
            finally:
                torch.set_num_threads(threads)
            assert torch.equal(decoded[0], in_chunk[-1])


def test_decode_attention_refuses_rows_and_blocks_outside_their_buffers():
    q, k_cache, v_cache, tables = _paged_case(1, [6])
    out = torch.empty_like(q)
    if not HAVE_OPS:
        return
    bad = torch.tensor([[tables[0][0], k_cache.shape[0]]])
    with pytest.raises(IndexError, match="block table"):
        cpu_ops.decode_attention(q, (k_cache, v_cache), bad, torch.tensor([6]), None, 0.3, out)
    good = torch.tensor([tables[0]])
    with pytest.raises(IndexError, match="query row"):  # a row past q and out
        cpu_ops.decode_attention(q, (k_cache, v_cache), good, torch.tensor([6]), torch.tensor([1]), 0.3, out)


@pytest.mark.parametrize("group", [1, 3, 8])
def test_prefill_attention_matches_the_reference(group):
    """Chunks of new tokens over a cached prefix (causal from their own positions), partial blocks, short tiles."""
    lens = [1, 7, 23]
    q_lens = [1, 6, 9]  # the last chunk: 14 cached tokens, then 9 new ones (tiles of 4: one short)
    q, k_cache, v_cache, tables = _paged_case(group, lens)
    q = torch.randn(sum(q_lens), q.shape[1], q.shape[2], generator=_gen(5))
    meta = AttentionMetadata.build(q_lens, lens, tables, 4)
    want = torch_paged_attention(q, (k_cache, v_cache), meta, 0.25)
    start = 0
    for i, (q_len, n) in enumerate(zip(q_lens, lens)):
        rows = slice(start, start + q_len)
        got = torch.full_like(q[rows], float("nan"))
        if not cpu_ops.prefill_attention(q[rows], (k_cache, v_cache), meta.block_tables[i], n, 0.25, got):
            assert not HAVE_OPS
            return
        torch.testing.assert_close(got, want[rows], rtol=1e-5, atol=1e-5)
        start += q_len
    if HAVE_OPS:
        with pytest.raises(IndexError, match="block id"):
            bad = torch.tensor([tables[2][0], k_cache.shape[0], 0, 0, 0, 0])
            cpu_ops.prefill_attention(q[-9:], (k_cache, v_cache), bad, 23, 0.25, torch.empty_like(q[-9:]))


# ---- compact caches: fp16, bf16 and int8 read in place by the same kernels -----------------------------------------

KV_KINDS = ["fp32", "fp16", "bf16", "int8"]


def _as_kind(k_cache: torch.Tensor, v_cache: torch.Tensor, kind: str) -> tuple:
    """fp32 caches in another cache type: a (k, v) pair, or int8's (k, v, k_scale, v_scale)."""
    if kind == "int8":
        from llmd.model.kv_int8 import Int8KVCache, quantize_int8

        (kq, ks), (vq, vs) = quantize_int8(k_cache), quantize_int8(v_cache)
        return Int8KVCache(kq, vq, ks, vs)
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[kind]
    return k_cache.to(dtype), v_cache.to(dtype)


@pytest.mark.parametrize("kind", KV_KINDS[1:])
def test_write_kv_converts_as_torch_does(kind):
    """The C write stores what torch's conversion (or kv_int8.quantize_int8, scales included) stores, bit for bit:
    rounding ties, fp16 subnormals and overflow, a row of zeros."""
    if not HAVE_OPS:
        return
    g = _gen(3)
    k = torch.randn(5, 3, 24, generator=g) * 4
    v = torch.randn(5, 3, 24, generator=g)
    k[0, 0, :6] = torch.tensor([1 + 2**-11, 1 + 3 * 2**-11, 3e-6, -7e-8, 7e4, 65519.0])  # fp16 ties, tiny, huge
    k[1, 2] = 0.0
    v[2, 1, :3] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, 1e-40])  # bf16 ties, an fp32 subnormal
    zeros = torch.zeros(4, 4, 3, 24)
    cache = _as_kind(zeros, zeros.clone(), kind)
    slots = torch.tensor([9, 0, 15, 4, 3])
    assert cpu_ops.write_kv(k, v, cache, slots)
    want = _as_kind(k.view(1, 5, 3, 24), v.view(1, 5, 3, 24), kind)
    for got, ref in zip(cache, want):
        assert torch.equal(got.flatten(0, 1)[slots], ref[0])


def _long_case(kind: str, lens: list[int], group: int = 3, d: int = 64, block_size: int = 16, seed: int = 0):
    q, k_cache, v_cache, tables = _paged_case(group, lens, block_size=block_size, kv_heads=2, d=d, seed=seed)
    return q, _as_kind(k_cache, v_cache, kind), tables


@pytest.mark.parametrize("kind", KV_KINDS)
def test_decode_and_chunk_attention_match_the_reference_on_every_cache_type(kind):
    """Contexts of one partition, of several (256 tokens each) and a partial last one; the reference reads the same
    cache through torch (dequantized for int8)."""
    if not HAVE_OPS:
        return
    lens = [3, 256, 700]
    q, cache, tables = _long_case(kind, lens)
    meta = AttentionMetadata.build([1] * len(lens), lens, tables, 16)
    got = torch.full_like(q, float("nan"))
    assert cpu_ops.decode_attention(q, cache, meta.block_tables, meta.seq_lens, None, 0.125, got)
    torch.testing.assert_close(got, torch_paged_attention(q, cache, meta, 0.125), rtol=1e-4, atol=1e-5)
    q_lens = [3, 5, 9]
    chunk = torch.randn(sum(q_lens), *q.shape[1:], generator=_gen(4))
    meta = AttentionMetadata.build(q_lens, lens, tables, 16)
    want = torch_paged_attention(chunk, cache, meta, 0.125)
    start = 0
    for i, (q_len, n) in enumerate(zip(q_lens, lens)):
        rows = slice(start, start + q_len)
        out = torch.full_like(chunk[rows], float("nan"))
        assert cpu_ops.prefill_attention(chunk[rows], cache, meta.block_tables[i], n, 0.125, out)
        torch.testing.assert_close(out, want[rows], rtol=1e-4, atol=1e-5)
        start += q_len


@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("kind", KV_KINDS)
def test_long_context_split_across_threads_is_bit_identical(kind, softcap):
    """One long sequence's partitions run on every thread; its output is bit for bit the same at 1, 2 and 4
    threads, alone or in a batch, and decoded or as the last query of a chunk (soft-capped or not)."""
    if not HAVE_OPS:
        return
    lens = [1100, 40, 513]
    q, cache, tables = _long_case(kind, lens, seed=5)
    meta = AttentionMetadata.build([1] * len(lens), lens, tables, 16)
    threads = torch.get_num_threads()
    outs = []
    try:
        for t in (1, 2, 4):
            torch.set_num_threads(t)
            batch = torch.empty_like(q)
            assert cpu_ops.decode_attention(q, cache, meta.block_tables, meta.seq_lens, None, 0.125, batch,
                                            softcap=softcap)
            alone = torch.empty_like(q[:1])
            table = torch.tensor([tables[0]])
            assert cpu_ops.decode_attention(q[:1], cache, table, torch.tensor([lens[0]]), None, 0.125, alone,
                                            softcap=softcap)
            chunk = torch.randn(6, *q.shape[1:], generator=_gen(6))
            chunk[-1] = q[0]
            in_chunk = torch.empty_like(chunk)
            assert cpu_ops.prefill_attention(chunk, cache, table[0], lens[0], 0.125, in_chunk, softcap=softcap)
            outs.append((batch, alone, in_chunk))
    finally:
        torch.set_num_threads(threads)
    batch, alone, in_chunk = outs[0]
    assert torch.equal(alone[0], batch[0]) and torch.equal(in_chunk[-1], batch[0])
    for other in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0], other))


@pytest.mark.parametrize("window", [None, 300])
def test_every_query_of_a_long_chunk_attends_as_if_decoded(window):
    """A chunk of 70 new tokens over 700 (three partitions), 3 query heads a KV head: the chunk's queries are cut
    into blocks and tiles that mix positions and heads (of other sizes at other thread counts), and each query's
    output is bit for bit the one it gets decoded alone at its position."""
    if not HAVE_OPS:
        return
    n, q_len = 700, 70
    _, cache, tables = _long_case("fp32", [n], seed=9)
    chunk = torch.randn(q_len, 6, 64, generator=_gen(9))
    table = torch.tensor(tables[0])
    threads = torch.get_num_threads()
    try:
        outs = []
        for t in (1, 4):
            torch.set_num_threads(t)
            outs.append(torch.empty_like(chunk))
            assert cpu_ops.prefill_attention(chunk, cache, table, n, 0.125, outs[-1], window)
        decoded = torch.empty_like(chunk)
        for i in range(q_len):
            assert cpu_ops.decode_attention(chunk[i:i + 1], cache, table[None], torch.tensor([n - q_len + i + 1]),
                                            None, 0.125, decoded[i:i + 1], window)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], decoded) and torch.equal(outs[1], decoded)


@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("kind", KV_KINDS)
def test_soft_capped_attention_matches_the_torch_reference(kind, window):
    """Gemma 2's soft-cap (scores -> cap * tanh(scores / cap)) in the decode and chunk kernels against the torch code
    that served it before (torch_paged_attention with the softcap), on every cache type, with and without a window:
    scores of 0 to ~10 caps, so both halves of the vectorised tanh (polynomial below 0.4, exp above) count."""
    if not HAVE_OPS:
        return
    lens = [3, 256, 700]
    q, cache, tables = _long_case(kind, lens, seed=7)
    q = q * 6  # scores of standard deviation ~6, cap 2: most saturate, some sit near 0
    meta = AttentionMetadata.build([1] * len(lens), lens, tables, 16)
    got = torch.full_like(q, float("nan"))
    assert cpu_ops.decode_attention(q, cache, meta.block_tables, meta.seq_lens, None, 0.125, got, window, 2.0)
    want = torch_paged_attention(q, cache, meta, 0.125, window=window, softcap=2.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)
    uncapped = torch.empty_like(q)
    cpu_ops.decode_attention(q, cache, meta.block_tables, meta.seq_lens, None, 0.125, uncapped, window)
    assert (uncapped - want).abs().max() > 0.1  # the cap bites
    q_lens = [3, 5, 9]
    chunk = torch.randn(sum(q_lens), *q.shape[1:], generator=_gen(8)) * 6
    meta = AttentionMetadata.build(q_lens, lens, tables, 16)
    want = torch_paged_attention(chunk, cache, meta, 0.125, window=window, softcap=2.0)
    start = 0
    for i, (q_len, n) in enumerate(zip(q_lens, lens)):
        rows = slice(start, start + q_len)
        out = torch.full_like(chunk[rows], float("nan"))
        assert cpu_ops.prefill_attention(chunk[rows], cache, meta.block_tables[i], n, 0.125, out, window, 2.0)
        torch.testing.assert_close(out, want[rows], rtol=1e-5, atol=2e-6)
        start += q_len


def test_soft_cap_limits():
    """A cap far above every score leaves the attention as it was (tanh(x) ~ x); a cap far below makes every score
    ~cap, so the weights are uniform and the output is the mean of V; a cap of 0 or below is refused."""
    if not HAVE_OPS:
        return
    lens = [37]
    q, k_cache, v_cache, tables = _paged_case(3, lens, seed=9)
    meta = AttentionMetadata.build([1], lens, tables, 4)
    args = ((k_cache, v_cache), meta.block_tables, meta.seq_lens, None, 0.3)
    plain, wide, narrow = (torch.empty_like(q) for _ in range(3))
    assert cpu_ops.decode_attention(q, *args, plain)
    assert cpu_ops.decode_attention(q, *args, wide, softcap=1e4)
    assert cpu_ops.decode_attention(q, *args, narrow, softcap=1e-6)
    torch.testing.assert_close(wide, plain, rtol=1e-5, atol=1e-6)
    v = v_cache[tables[0]].flatten(0, 1)[:37]  # [37, kv_heads, d]
    mean = v.mean(0).repeat_interleave(3, dim=0)  # each query head's KV head
    torch.testing.assert_close(narrow[0], mean, rtol=1e-5, atol=1e-5)
    for bad in (0.0, -1.0):
        assert not cpu_ops.decode_attention(q, *args, plain, softcap=bad)
        assert not cpu_ops.prefill_attention(q, (k_cache, v_cache), meta.block_tables[0], 37, 0.3, plain,
                                             softcap=bad)


def test_caches_the_kernels_cannot_read_are_declined():
    """Another element type, mismatched K/V, a strided cache, scales of the wrong type: False, nothing written."""
    if not HAVE_OPS:
        return
    q, k_cache, v_cache, tables = _paged_case(1, [6])
    out = torch.zeros_like(q)
    table, lens = torch.tensor([tables[0]]), torch.tensor([6])
    int8 = _as_kind(k_cache, v_cache, "int8")
    for bad in ((k_cache.double(), v_cache.double()), (k_cache, v_cache.half()), (k_cache[:, :, :1], v_cache[:, :, :1]),
                (int8.k, int8.v), int8._replace(k_scale=int8.k_scale.half())):
        assert not cpu_ops.decode_attention(q, bad, table, lens, None, 0.3, out)
        assert not cpu_ops.write_kv(q[:, :2], q[:, :2], bad, torch.tensor([0]))
    assert not out.any()


@pytest.mark.parametrize("n", [1, 7, 8, 31, 32, 33, 63, 64, 65, 1000, 262144])
def test_argmax_is_torchs(n):
    """greedy_tokens on CPU rows: torch.argmax's index, the first of equal maxima and the first NaN, on every length
    around the vector width, rows in a strided view, a batch of rows and a single row."""
    g = _gen(n)
    x = torch.randn(6, n + 3, generator=g)[:, 1 : n + 1]  # rows of a wider tensor: strided
    x[1] = x[1].round()  # many ties
    x[2] = 7.0
    if n > 3:
        x[3, n // 2] = x[3, n - 1] = x[3].max() + 1  # a tie of two maxima, the second at the very end
        x[4, n - 2] = float("nan")
        x[4, n // 3] = float("inf")
    x[5] = float("-inf")
    want = torch.argmax(x, dim=-1)
    assert torch.equal(greedy_tokens(x), want) and torch.equal(greedy_tokens(x[0]), want[0])
    got = cpu_ops.argmax(x.contiguous())
    assert got.dtype == torch.int64 and torch.equal(got, want)
    assert torch.equal(cpu_ops.argmax(x.half()), torch.argmax(x.half(), dim=-1))  # other dtypes: torch's
