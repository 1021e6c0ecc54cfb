"""Sliding-window attention in every CPU path (llmd.model.attention's torch reference and batched decode, the torch
and CPU backends of llmd.model.attention_backends, the C kernels of llmd.kernels.cpu_ops) against a dense per-query softmax: a query at position p sees keys (p - W, p].

Contexts run to 4x the window, with partial blocks, GQA, decode rows beside prefill chunks. The blocks that lie
wholly before a sequence's window are replaced by a block full of NaN, as a freed and reused block would be: any
path that read one would turn its output into NaN. (The Triton kernels: tests/test_kernels_paged_attention.py.)
"""

from __future__ import annotations

import pytest
import torch
from llmd.kernels import cpu_ops
from llmd.model.attention import AttentionMetadata, DecodePlan, batched_decode_attention, torch_paged_attention
from llmd.model.attention_backends import CPU, TORCH, CpuBackend

HAVE_OPS = cpu_ops.load() is not None
BS = 4


def dense_window_attention(q, k, v, positions, window, scale):
    """q [L, H, d] at `positions`; k/v [S, kv_heads, d] the whole context: the plain masked softmax, per query."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = torch.empty_like(q)
    for i, p in enumerate(positions):
        lo = 0 if window is None else max(0, p - window + 1)
        scores = torch.einsum("hd,shd->hs", q[i], k[lo : p + 1]) * scale
        out[i] = torch.einsum("hs,shd->hd", scores.softmax(-1), v[lo : p + 1])
    return out


def make_case(lens, q_lens, window, group=2, kv_heads=2, d=16, seed=0):
    """A paged cache holding random K/V for each sequence, its dense copy, and tables whose blocks before the window
    of the chunk's first query point at a NaN block."""
    g = torch.Generator().manual_seed(seed)
    blocks = [(n + BS - 1) // BS for n in lens]
    num_blocks = sum(blocks) + 2
    k_cache = torch.randn(num_blocks, BS, kv_heads, d, generator=g)
    v_cache = torch.randn(num_blocks, BS, kv_heads, d, generator=g)
    poison = num_blocks - 1
    k_cache[poison] = v_cache[poison] = float("nan")
    order = torch.randperm(num_blocks - 1, generator=g).tolist()
    tables, dense, used = [], [], 0
    for n, q_len, nb in zip(lens, q_lens, blocks):
        table = order[used : used + nb]
        used += nb
        dense.append((k_cache[table].flatten(0, 1)[:n], v_cache[table].flatten(0, 1)[:n]))
        first_pos = n - q_len
        lo = 0 if window is None else max(0, first_pos - window + 1)
        tables.append([poison] * (lo // BS) + table[lo // BS :])  # dropped blocks: never read
    q = torch.randn(sum(q_lens), kv_heads * group, d, generator=g)
    return q, (k_cache, v_cache), tables, dense


def expected(q, dense, lens, q_lens, window, scale):
    out, start = [], 0
    for (k, v), n, q_len in zip(dense, lens, q_lens):
        out.append(dense_window_attention(q[start : start + q_len], k, v, range(n - q_len, n), window, scale))
        start += q_len
    return torch.cat(out)


WINDOW = 8
# decodes at 1x..4x the window (and shorter than it), chunks that start before, inside and past a window
LENS = [3, 8, 9, 17, 32, 30, 25, 33]
Q_LENS = [1, 1, 1, 1, 1, 12, 5, 2]


@pytest.mark.parametrize("window", [WINDOW, 5, 1, None])
@pytest.mark.parametrize("group", [1, 3])
def test_torch_reference_matches_dense(window, group):
    q, cache, tables, dense = make_case(LENS, Q_LENS, window, group=group)
    meta = AttentionMetadata.build(Q_LENS, LENS, tables, BS)
    got = torch_paged_attention(q, cache, meta, 0.3, window=window)
    torch.testing.assert_close(got, expected(q, dense, LENS, Q_LENS, window, 0.3), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [WINDOW, 5, 1])
def test_batched_decode_matches_dense_and_is_batch_invariant(window):
    lens = [n for n, ql in zip(LENS, Q_LENS) if ql == 1]
    q, cache, tables, dense = make_case(lens, [1] * len(lens), window, group=3)
    meta = AttentionMetadata.build([1] * len(lens), lens, tables, BS)
    got = batched_decode_attention(q, cache, DecodePlan.build(meta), 0.3, window=window)
    torch.testing.assert_close(got, expected(q, dense, lens, [1] * len(lens), window, 0.3), rtol=1e-5, atol=1e-5)
    for i in range(len(lens)):  # each alone: the same bits
        alone = AttentionMetadata.build([1], [lens[i]], [tables[i]], BS)
        one = batched_decode_attention(q[i : i + 1], cache, DecodePlan.build(alone), 0.3, window=window)
        assert torch.equal(one[0], got[i])


@pytest.mark.parametrize("window", [WINDOW, 5, 300, None])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_c_kernels_match_dense(window, group):
    if not HAVE_OPS:
        pytest.skip("no C compiler: the CPU kernels are not built (the torch path serves)")
    q, cache, tables, dense = make_case(LENS, Q_LENS, window, group=group)
    meta = AttentionMetadata.build(Q_LENS, LENS, tables, BS)
    plan = DecodePlan.build(meta)
    out = torch.full_like(q, float("nan"))
    assert CpuBackend._c_attention(q, cache, meta, plan, 0.3, out, window)
    torch.testing.assert_close(out, expected(q, dense, LENS, Q_LENS, window, 0.3), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(CPU.attend(q, cache, meta, 0.3, window=window), out, rtol=0, atol=0)


@pytest.mark.parametrize("window", [WINDOW, 300, 600])
def test_c_kernels_past_a_partition(window):
    """Contexts of several 256-token partitions: a window that starts mid-partition, one spanning partitions."""
    if not HAVE_OPS:
        pytest.skip("no C compiler: the CPU kernels are not built (the torch path serves)")
    lens, q_lens = [1000, 700, 1100], [1, 1, 9]
    q, cache, tables, dense = make_case(lens, q_lens, window, group=2, d=8, seed=3)
    meta = AttentionMetadata.build(q_lens, lens, tables, BS)
    out = torch.full_like(q, float("nan"))
    assert CpuBackend._c_attention(q, cache, meta, DecodePlan.build(meta), 0.3, out, window)
    torch.testing.assert_close(out, expected(q, dense, lens, q_lens, window, 0.3), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [WINDOW, 300])
def test_c_decode_equals_the_same_query_in_a_chunk(window):
    """Speculative verify and recompute: a token's output is bit-identical decoded alone, in a batch, or as any
    row of a chunk, at 1 and 4 threads."""
    if not HAVE_OPS:
        pytest.skip("no C compiler: the CPU kernels are not built (the torch path serves)")
    lens = [9, 17, 33, 700]
    q_chunk = 6
    q, (k_cache, v_cache), tables, _ = make_case(lens, [q_chunk] * len(lens), window, group=3, seed=4)
    threads = torch.get_num_threads()
    for i, n in enumerate(lens):
        table = torch.tensor(tables[i])
        chunk = q[i * q_chunk : (i + 1) * q_chunk]
        in_chunk = torch.empty_like(chunk)
        assert cpu_ops.prefill_attention(chunk, (k_cache, v_cache), table, n, 0.3, in_chunk, window)
        for j in range(q_chunk):
            for t in (1, 4):
                torch.set_num_threads(t)
                try:
                    decoded = torch.empty_like(chunk[j : j + 1])
                    assert cpu_ops.decode_attention(chunk[j : j + 1], (k_cache, v_cache), table[None],
                                                    torch.tensor([n - q_chunk + j + 1]), None, 0.3, decoded, window)
                finally:
                    torch.set_num_threads(threads)
                assert torch.equal(decoded[0], in_chunk[j]), (n, j, t)


@pytest.mark.parametrize("backend", [TORCH, CPU])
def test_torch_path_of_the_backends_matches_dense(backend):
    """The torch backend, and the CPU backend off the C path (float64 here; bf16 in use): decode rows batched
    through the windowed plan beside chunks through the reference, in one mixed step."""
    q, (k, v), tables, dense = make_case(LENS, Q_LENS, WINDOW, group=2)
    q, k, v = q.double(), k.double(), v.double()
    dense = [(a.double(), b.double()) for a, b in dense]
    meta = AttentionMetadata.build(Q_LENS, LENS, tables, BS)
    got = backend.attend(q, (k, v), meta, 0.3, window=WINDOW)
    torch.testing.assert_close(got, expected(q, dense, LENS, Q_LENS, WINDOW, 0.3), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("kv_cache_dtype", ["fp16", "bf16", "int8"])
def test_c_kernels_read_compact_caches_within_the_window(kv_cache_dtype):
    """fp16/bf16/int8 caches (int8: per-token scales on V applied only inside the window) against the torch
    reference over the same cache."""
    if not HAVE_OPS:
        pytest.skip("no C compiler: the CPU kernels are not built (the torch path serves)")
    from llmd.model.attention import allocate_kv_cache, write_kv

    g = torch.Generator().manual_seed(11)
    num_blocks = sum((n + BS - 1) // BS for n in LENS) + 1
    (cache,) = allocate_kv_cache(1, num_blocks, BS, 2, 16, torch.float32, "cpu", kv_cache_dtype)
    slots = torch.arange(num_blocks * BS)
    write_kv(torch.randn(len(slots), 2, 16, generator=g), torch.randn(len(slots), 2, 16, generator=g), cache, slots)
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], 0
    for n in LENS:
        nb = (n + BS - 1) // BS
        tables.append(order[used : used + nb])
        used += nb
    q = torch.randn(sum(Q_LENS), 6, 16, generator=g)
    meta = AttentionMetadata.build(Q_LENS, LENS, tables, BS)
    out = torch.full_like(q, float("nan"))
    assert CpuBackend._c_attention(q, cache, meta, DecodePlan.build(meta), 0.3, out, WINDOW)
    want = torch_paged_attention(q, cache, meta, 0.3, window=WINDOW)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
