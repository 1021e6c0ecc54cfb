"""The Triton paged-attention kernels (decode, and varlen prefill for chunks and speculative verifies) with a
sliding window, against a dense per-query softmax, on the NaN-poisoned caches of test_sliding_window_attention: the
blocks before each sequence's window are never read. Without CUDA they run under the Triton interpreter."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import DEVICE, load_kernel_module
from llmd.model import attention_backends as ab
from llmd.model.attention import AttentionMetadata, torch_paged_attention
from test_sliding_window_attention import BS, LENS, Q_LENS, expected, make_case

pa = load_kernel_module("paged_attention")
pf = load_kernel_module("prefill_attention")


def _on_device(q, cache, tables, lens, q_lens):
    cache = tuple(c.to(DEVICE) for c in cache)
    meta = AttentionMetadata.build(q_lens, lens, tables, BS, device=DEVICE)
    return q.to(DEVICE), cache, meta


@pytest.mark.parametrize("window", [8, 5, 1])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_kernel_matches_dense(window, num_splits):
    lens = [3, 8, 9, 17, 32, 70]  # shorter than, at, and up to ~9x the window
    q, cache, tables, dense = make_case(lens, [1] * len(lens), window, group=3)
    qd, (k, v), meta = _on_device(q, cache, tables, lens, [1] * len(lens))
    got = pa.paged_decode_attention(qd, k, v, meta.block_tables, meta.seq_lens, 0.3, num_splits=num_splits,
                                    min_split_tokens=2, window=window)
    want = expected(q, dense, lens, [1] * len(lens), window, 0.3)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
    ref = pa.paged_decode_attention_ref(q, *cache, AttentionMetadata.build([1] * len(lens), lens, tables, BS)
                                        .block_tables, torch.tensor(lens), 0.3, window=window)
    torch.testing.assert_close(ref, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [8, 5, 1])
@pytest.mark.parametrize("block_m,block_n", [(None, None), (16, 16)])
def test_prefill_kernel_matches_dense(window, block_m, block_n):
    """Decode rows beside chunks that start before, inside and past their windows (tiles straddling a window's
    start), through the backend entry point the engine calls."""
    q, cache, tables, dense = make_case(LENS, Q_LENS, window, group=2)
    qd, cachd, meta = _on_device(q, cache, tables, LENS, Q_LENS)
    got = pf.paged_prefill_attention(qd, *cachd, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.3,
                                     block_m=block_m, block_n=block_n, window=window)
    want = expected(q, dense, LENS, Q_LENS, window, 0.3)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
    backend = ab.TRITON.attend(qd, cachd, meta, 0.3, window=window)
    torch.testing.assert_close(backend.cpu(), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch_paged_attention(q, cache, AttentionMetadata.build(Q_LENS, LENS, tables, BS), 0.3,
                                                     window=window), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [8, 5])  # (a window of 1 sees one key: no cap changes its softmax)
def test_kernels_with_window_and_softcap(window):
    """Gemma 2's local layers are windowed and soft-capped: on the poisoned caches both kernels (decode over three
    splits, the varlen prefill through the backend entry point) equal the torch reference, read no block before the
    window (no NaN) and differ from the uncapped result."""
    decode_lens = [3, 8, 9, 17, 32, 70]
    decode = [1] * len(decode_lens)
    for lens, q_lens, group in ((decode_lens, decode, 3), (LENS, Q_LENS, 2)):
        q, cache, tables, _ = make_case(lens, q_lens, window, group=group)
        q = q * 4  # scores of a few units: a cap of 2 changes them
        qd, cachd, meta = _on_device(q, cache, tables, lens, q_lens)
        want = torch_paged_attention(q, cache, AttentionMetadata.build(q_lens, lens, tables, BS), 0.3, window=window,
                                     softcap=2.0)
        assert torch.isfinite(want).all()
        if q_lens is decode:
            got = pa.paged_decode_attention(qd, *cachd, meta.block_tables, meta.seq_lens, 0.3, num_splits=3,
                                            min_split_tokens=2, window=window, softcap=2.0)
        else:
            got = ab.TRITON.attend(qd, cachd, meta, 0.3, window=window, softcap=2.0)
        torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
        uncapped = ab.TRITON.attend(qd, cachd, meta, 0.3, window=window)
        assert (uncapped.cpu() - want).abs().max() > 0.1


def test_startup_check_covers_the_models_windows():
    """check_attention_backend runs each window of the model: a backend that ignores the window is refused."""
    ok = ab.check_attention_backend(ab.TRITON, 4, 2, 16, torch.float32, device=DEVICE, windows=(5,))
    assert ok is None

    class IgnoresWindow(ab.TritonBackend):
        def attend(self, q, kv_cache, meta, scale, *, window=None, softcap=None, sinks=None):
            return super().attend(q, kv_cache, meta, scale, sinks=sinks)

    problem = ab.check_attention_backend(IgnoresWindow(), 4, 2, 16, torch.float32, device=DEVICE, windows=(5,))
    assert problem is not None and "window 5" in problem


@pytest.mark.skipif(DEVICE != "cpu", reason="the tiny model runs on CPU; on a GPU the kernel tests above cover this")
def test_gemma2_engine_on_the_triton_kernels(tmp_path, monkeypatch):
    """A tiny Gemma 2 (window-8 layers beside global ones, every layer soft-capped at 2) served on the Triton backend:
    chunked prefills past the window, decodes in the same steps and a prefix-cache hit give the default backend's
    greedy tokens and logprobs (the cap moves this model's logits by ~0.3: its tokens alone would not notice a kernel
    that dropped it), and every soft-capped layer runs a Triton kernel."""
    from engine_testing import make_engine
    from llmd.engine import SamplingParams, generate
    from llmd.engine import runner as runner_module
    from llmd.model.loader import load_model
    from tiny_gemma import write_tiny_gemma

    lm = load_model(write_tiny_gemma(tmp_path / "gemma2", "gemma2"), dtype=torch.float32, device="cpu")
    g = torch.Generator().manual_seed(0)
    shared = [2] + torch.randint(10, 570, (19,), generator=g).tolist()
    prompts = [shared + torch.randint(10, 570, (n,), generator=g).tolist() for n in (3, 14)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2)

    def tokens():
        engine = make_engine(lm, max_num_batched_tokens=16)
        first = generate(engine, prompts[:1], params)  # fills the prefix cache
        rest = generate(engine, prompts, params)
        assert rest[0].timings.num_cached_tokens == 16
        return [r.token_ids for r in first + rest], [[x.logprob for x in r.logprobs] for r in first + rest]

    want, want_logprobs = tokens()
    capped = []
    for module, name in ((pa, "paged_decode_attention"), (pf, "paged_prefill_attention")):
        def counted(*a, _kernel=getattr(module, name), **kw):
            capped.append(kw.get("softcap"))
            return _kernel(*a, **kw)
        monkeypatch.setattr(module, name, counted)
    monkeypatch.setattr(runner_module, "choose_backend", lambda *a, **kw: ab.TRITON)  # as a GPU's runner picks
    got, got_logprobs = tokens()
    assert got == want
    torch.testing.assert_close(torch.tensor(got_logprobs), torch.tensor(want_logprobs), rtol=0, atol=1e-4)
    assert len(capped) >= 8 * lm.config.num_hidden_layers and set(capped) == {2.0}
