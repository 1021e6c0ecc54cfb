"""The batched CPU attention path (llmd.model.attention.fast_paged_attention) against the per-sequence reference,
and its batch invariance: a sequence's output is bit-identical alone and inside a mixed batch (CPU, fp32)."""

from __future__ import annotations

import random

import pytest
import torch

from llmd.model.attention import AttentionMetadata, fast_paged_attention, torch_paged_attention

BLOCK = 16


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_cache(seq_lens, kv_heads, head_dim, seed):
    """Random K/V pool with each sequence's blocks scattered in shuffled order; returns the cache and block tables."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    need = [-(-n // BLOCK) for n in seq_lens]
    free = list(range(sum(need) + 4))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in need]
    shape = (sum(need) + 4, BLOCK, kv_heads, head_dim)
    return (torch.randn(shape), torch.randn(shape)), tables


def subset(meta_args, keep):
    query_lens, seq_lens, tables = meta_args
    return AttentionMetadata.build([query_lens[i] for i in keep], [seq_lens[i] for i in keep],
                                   [tables[i] for i in keep], BLOCK)


@pytest.mark.parametrize("kv_heads,group,head_dim", [(3, 3, 64), (2, 1, 32), (1, 4, 16)])
def test_matches_reference_on_mixed_batch(kv_heads, group, head_dim):
    # decodes of ragged lengths (1-token context, partial and full blocks) and two prefill chunks, one with a
    # cached prefix
    query_lens = [1, 5, 1, 1, 12, 1]
    seq_lens = [1, 5, 17, 48, 40, 130]
    cache, tables = make_cache(seq_lens, kv_heads, head_dim, seed=1)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK)
    q = torch.randn(sum(query_lens), kv_heads * group, head_dim)
    scale = head_dim ** -0.5
    out = fast_paged_attention(q, cache, meta, scale)
    ref = torch_paged_attention(q, cache, meta, scale)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # decode-only step
    dec = [i for i, n in enumerate(query_lens) if n == 1]
    meta_d = subset((query_lens, seq_lens, tables), dec)
    qd = torch.randn(len(dec), kv_heads * group, head_dim)
    torch.testing.assert_close(fast_paged_attention(qd, cache, meta_d, scale),
                               torch_paged_attention(qd, cache, meta_d, scale), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", range(6))
def test_each_sequence_bit_identical_alone_and_in_batch_of_16(seed):
    rng = random.Random(seed)
    kv_heads, group, head_dim = 3, 3, 64
    query_lens = [1] * 16
    for i in rng.sample(range(16), 3):
        query_lens[i] = rng.randint(2, 40)  # prefill chunks mixed in
    seq_lens = [q + rng.choice([0, rng.randint(0, 400)]) for q in query_lens]
    seq_lens = [max(s, 1) for s in seq_lens]
    cache, tables = make_cache(seq_lens, kv_heads, head_dim, seed)
    args = (query_lens, seq_lens, tables)
    q = torch.randn(sum(query_lens), kv_heads * group, head_dim)
    batched = fast_paged_attention(q, cache, subset(args, range(16)), 0.125)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    for i in range(16):
        rows = slice(starts[i], starts[i + 1])
        alone = fast_paged_attention(q[rows], cache, subset(args, [i]), 0.125)
        assert torch.equal(alone, batched[rows]), f"sequence {i} (query {query_lens[i]}, context {seq_lens[i]})"
