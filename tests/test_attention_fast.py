"""The CPU attention backends (llmd.model.attention_backends: the C calls, and the batched torch path) against the
per-sequence reference, and their batch invariance: a sequence's output is bit-identical alone and inside a mixed
batch (CPU, fp32)."""

from __future__ import annotations

import random

import pytest
import torch

from llmd.kernels import cpu_ops
from llmd.model.attention import AttentionMetadata, DecodePlan, torch_paged_attention
from llmd.model.attention_backends import CPU, TORCH, CpuBackend

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


BACKENDS = pytest.mark.parametrize("backend", [CPU, TORCH], ids=lambda b: b.name)


@BACKENDS
@pytest.mark.parametrize("kv_heads,group,head_dim", [(3, 3, 64), (2, 1, 32), (1, 4, 16)])
def test_matches_reference_on_mixed_batch(backend, kv_heads, group, head_dim):
    # decodes of ragged lengths (1-token context, partial and full blocks) and two prefill chunks, one with a
    # cached prefix
    query_lens = [1, 5, 1, 1, 12, 1]
    seq_lens = [1, 5, 17, 48, 40, 130]
    cache, tables = make_cache(seq_lens, kv_heads, head_dim, seed=1)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK)
    q = torch.randn(sum(query_lens), kv_heads * group, head_dim)
    scale = head_dim ** -0.5
    out = backend.attend(q, cache, meta, scale)
    ref = torch_paged_attention(q, cache, meta, scale)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # decode-only step
    dec = [i for i, n in enumerate(query_lens) if n == 1]
    meta_d = subset((query_lens, seq_lens, tables), dec)
    qd = torch.randn(len(dec), kv_heads * group, head_dim)
    torch.testing.assert_close(backend.attend(qd, cache, meta_d, scale),
                               torch_paged_attention(qd, cache, meta_d, scale), rtol=1e-5, atol=1e-5)


@BACKENDS
@pytest.mark.parametrize("seed", range(6))
def test_each_sequence_bit_identical_alone_and_in_batch_of_16(backend, seed):
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
    batched = backend.attend(q, cache, subset(args, range(16)), 0.125)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    for i in range(16):
        rows = slice(starts[i], starts[i + 1])
        alone = backend.attend(q[rows], cache, subset(args, [i]), 0.125)
        assert torch.equal(alone, batched[rows]), f"sequence {i} (query {query_lens[i]}, context {seq_lens[i]})"


def naive_attention(q, k, v, q_pos, scale, window=None, softcap=None):
    """One sequence, q [L, heads, d] at positions q_pos over its whole context k/v [S, heads, d], written out."""
    scores = torch.einsum("lhd,shd->hls", q, k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    k_pos = torch.arange(k.shape[0])
    seen = (k_pos[None, :] <= q_pos[:, None])
    if window is not None:
        seen &= k_pos[None, :] > q_pos[:, None] - window
    return torch.einsum("hls,shd->lhd", scores.masked_fill(~seen, float("-inf")).softmax(-1), v)


@pytest.mark.parametrize("window,softcap", [(5, None), (None, 2.0), (20, 1.5), (1, None)])
def test_torch_backend_window_and_softcap_match_a_naive_computation(window, softcap):
    """The per-layer options: a query at position p sees keys at positions > p - window; logits soft-capped. The
    torch backend and the C kernels of the CPU one, against the reference and a naive computation."""
    query_lens, seq_lens = [1, 7, 1, 1], [40, 30, 3, 17]
    kv_heads, group, d = 2, 2, 16
    cache, tables = make_cache(seq_lens, kv_heads, d, seed=7)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK, backend=TORCH)
    q = torch.randn(sum(query_lens), kv_heads * group, d)
    got = TORCH.attend(q, cache, meta, 0.25, window=window, softcap=softcap)
    ref = torch_paged_attention(q, cache, meta, 0.25, window=window, softcap=softcap)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    start = 0
    for i, (n, s) in enumerate(zip(query_lens, seq_lens)):
        ids = torch.tensor(tables[i])
        k = cache[0][ids].flatten(0, 1)[:s].repeat_interleave(group, dim=1)
        v = cache[1][ids].flatten(0, 1)[:s].repeat_interleave(group, dim=1)
        want = naive_attention(q[start:start + n], k, v, torch.arange(s - n, s), 0.25, window, softcap)
        torch.testing.assert_close(got[start:start + n], want, rtol=1e-5, atol=1e-5)
        start += n
    if cpu_ops.load() is None:
        return
    # the CPU backend runs both options in its C kernels (no torch fallback), to the torch code's tolerance
    cpu_meta = AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK, backend=CPU)
    out = torch.full_like(q, float("nan"))
    assert CpuBackend._c_attention(q, cache, cpu_meta, DecodePlan.build(cpu_meta), 0.25, out, window, softcap)
    assert torch.equal(CPU.attend(q, cache, cpu_meta, 0.25, window=window, softcap=softcap), out)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
