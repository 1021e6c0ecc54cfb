"""The Triton paged-attention kernels (decode, one split and several; varlen prefill through the backend entry point)
with attention sinks (gpt-oss), against the torch path, with and without a sliding window, on the NaN-poisoned
caches of test_sliding_window_attention; the startup check runs a model's sinks. Without CUDA they run under the
Triton interpreter (fp32, tiny shapes)."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import DEVICE, load_kernel_module
from llmd.model import attention_backends as ab
from llmd.model.attention import AttentionMetadata, allocate_kv_cache, torch_paged_attention, write_kv
from llmd.model.kv_int8 import kv_parts
from test_attention_sinks import head_sinks
from test_sliding_window_attention import BS, LENS, Q_LENS, make_case

pa = load_kernel_module("paged_attention")
pf = load_kernel_module("prefill_attention")
DECODE_LENS = [3, 8, 9, 17, 32, 70]


def _case(lens, q_lens, window, group):
    q, cache, tables, _ = make_case(lens, q_lens, window, group=group)
    sinks = head_sinks(q.shape[1])
    want = torch_paged_attention(q, cache, AttentionMetadata.build(q_lens, lens, tables, BS), 0.3, window=window,
                                 sinks=sinks)
    assert torch.isfinite(want).all()
    meta = AttentionMetadata.build(q_lens, lens, tables, BS, device=DEVICE)
    return q.to(DEVICE), tuple(c.to(DEVICE) for c in cache), meta, sinks.to(DEVICE), want


@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_kernel_matches_the_torch_path(window, num_splits):
    q, (k, v), meta, sinks, want = _case(DECODE_LENS, [1] * len(DECODE_LENS), window, group=3)
    got = pa.paged_decode_attention(q, k, v, meta.block_tables, meta.seq_lens, 0.3, num_splits=num_splits,
                                    min_split_tokens=2, window=window, sinks=sinks)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
    ref = pa.paged_decode_attention_ref(q, k, v, meta.block_tables, meta.seq_lens, 0.3, window=window, sinks=sinks)
    torch.testing.assert_close(ref.cpu(), want, rtol=1e-5, atol=1e-5)
    plain = pa.paged_decode_attention(q, k, v, meta.block_tables, meta.seq_lens, 0.3, num_splits=num_splits,
                                      min_split_tokens=2, window=window)
    assert (plain.cpu() - want).abs().max() > 0.1  # the sinks matter here


@pytest.mark.parametrize("window", [None, 8, 5])
@pytest.mark.parametrize("block_m,block_n", [(None, None), (16, 16)])
def test_prefill_kernel_matches_the_torch_path(window, block_m, block_n):
    """Decode rows beside chunks over cached prefixes (a chunked prefill's later chunks), through the kernel and
    through the backend entry point the engine calls."""
    q, cache, meta, sinks, want = _case(LENS, Q_LENS, window, group=2)
    got = pf.paged_prefill_attention(q, *cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.3,
                                     block_m=block_m, block_n=block_n, window=window, sinks=sinks)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ab.TRITON.attend(q, cache, meta, 0.3, window=window, sinks=sinks).cpu(), want,
                               rtol=1e-4, atol=1e-4)
    if window is None:  # (the reference reads whole contexts: the poisoned blocks before a window too)
        ref = pf.paged_prefill_attention_ref(q, *cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.3,
                                             sinks=sinks)
        torch.testing.assert_close(ref.cpu(), want, rtol=1e-5, atol=1e-5)


def test_sinks_with_softcap_and_an_int8_cache():
    """The switches together: soft-capped scores and a sink (which is not capped), on an int8 cache, decode over
    three splits and a mixed step through the backend."""
    g = torch.Generator().manual_seed(2)
    num_blocks = 40
    (cache,) = allocate_kv_cache(1, num_blocks, BS, 2, 16, torch.float32, DEVICE, "int8")
    slots = torch.arange(num_blocks * BS, device=DEVICE)
    kv = torch.randn(2, len(slots), 2, 16, generator=g).to(DEVICE)
    write_kv(kv[0], kv[1], cache, slots)
    tables = [list(range(i * 9, i * 9 + 9)) for i in range(4)]
    sinks = head_sinks(4).to(DEVICE)
    for q_lens, lens in (([1, 1, 1, 1], [5, 33, 17, 36]), ([1, 12, 1, 7], [5, 33, 17, 36])):
        meta = AttentionMetadata.build(q_lens, lens, tables, BS, device=DEVICE)
        q = (torch.randn(sum(q_lens), 4, 16, generator=g) * 4).to(DEVICE)
        want = torch_paged_attention(q, cache, meta, 0.3, softcap=2.0, sinks=sinks)
        got = ab.TRITON.attend(q, cache, meta, 0.3, softcap=2.0, sinks=sinks)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        if meta.is_decode_only:
            k, v, ks, vs = kv_parts(cache)
            split = pa.paged_decode_attention(q, k, v, meta.block_tables, meta.seq_lens, 0.3, num_splits=3,
                                              min_split_tokens=4, k_scale=ks, v_scale=vs, softcap=2.0, sinks=sinks)
            torch.testing.assert_close(split, want, rtol=1e-4, atol=1e-4)


def test_startup_check_runs_the_models_sinks():
    """A model with sinks is checked with sinks: the kernels pass, a backend that drops them is refused."""
    shape = (4, 2, 16, torch.float32)
    assert ab.check_attention_backend(ab.TRITON, *shape, device=DEVICE, windows=(5,), sinks=True) is None

    class IgnoresSinks(ab.TritonBackend):
        def attend(self, q, kv_cache, meta, scale, *, window=None, softcap=None, sinks=None):
            return super().attend(q, kv_cache, meta, scale, window=window, softcap=softcap)

    problem = ab.check_attention_backend(IgnoresSinks(), *shape, device=DEVICE, sinks=True)
    assert problem is not None and "sinks True" in problem
    assert ab.check_attention_backend(IgnoresSinks(), *shape, device=DEVICE) is None  # (a model without them)
