"""Varlen paged prefill attention (llmd.kernels.prefill_attention) against its torch reference and the engine's
torch attention path, and its use by the Triton attention backend. Without CUDA it runs under the Triton
interpreter on tiny shapes; the real-shape checks need a CUDA GPU."""

from __future__ import annotations

import random

import pytest
import torch
from kernel_testing import DEVICE, load_kernel_module
from llmd.model.attention import AttentionMetadata, allocate_kv_cache, torch_paged_attention, write_kv
from llmd.model.attention_backends import triton_paged_attention
from llmd.model.kv_int8 import kv_parts

pf = load_kernel_module("prefill_attention")
pa = load_kernel_module("paged_attention")

# A ragged mixed step: a whole prompt (no cached prefix), a decode, a chunk after a cached prefix that starts
# mid-block (position 25 with blocks of 8 or 16) and ends in a partial block, a decode over a 1-token context, a
# second chunk whose prefix is exactly one block, and a speculative-verify-like 3-token chunk.
MIXED_QUERY_LENS = [11, 1, 20, 1, 7, 3]
MIXED_SEQ_LENS = [11, 9, 45, 1, 23, 30]


def paged_step(query_lens, seq_lens, num_kv_heads, group, head_dim, block_size, dtype, kv_cache_dtype="auto",
               seed=0):
    """A cache holding every sequence's whole context (cached prefix and the step's new tokens, written through
    write_kv as the model does) in blocks handed out in shuffled order, the step's metadata and its queries."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    need = [-(-n // block_size) for n in seq_lens]
    free = list(range(1, sum(need) + 3))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in need]
    cache = allocate_kv_cache(1, sum(need) + 3, block_size, num_kv_heads, head_dim, dtype, DEVICE,
                              kv_cache_dtype=kv_cache_dtype)[0]
    context = AttentionMetadata.build(list(seq_lens), list(seq_lens), tables, block_size, device=DEVICE)
    k = torch.randn(sum(seq_lens), num_kv_heads, head_dim, device=DEVICE) * 2
    v = torch.randn(sum(seq_lens), num_kv_heads, head_dim, device=DEVICE)
    write_kv(k.to(dtype), v.to(dtype), cache, context.slot_mapping)
    meta = AttentionMetadata.build(list(query_lens), list(seq_lens), tables, block_size, device=DEVICE)
    q = torch.randn(sum(query_lens), num_kv_heads * group, head_dim, device=DEVICE).to(dtype)
    return q, cache, meta


def run(fn, q, cache, meta, scale, **kw):
    k_cache, v_cache, k_scale, v_scale = kv_parts(cache)
    return fn(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale,
              max(meta.query_lens_list), k_scale=k_scale, v_scale=v_scale, **kw)


def check(out, ref, dtype, tol=None):
    tol = tol or (1e-4 if dtype == torch.float32 else 1e-2)  # fp16: q, K/V and P are rounded to fp16 in the dots
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all()
    err = (out.float() - ref.float()).abs().max().item()
    assert err < tol, err


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group,num_kv_heads,head_dim,block_size", [
    (1, 2, 32, 16),  # MHA
    (3, 3, 64, 16),  # SmolLM2's GQA ratio (group padded to 4 rows)
    (8, 1, 32, 8),  # Llama-3-70B-like ratio, small blocks
    (2, 2, 40, 16),  # a head_dim that is not a power of two (masked to 64)
])
def test_mixed_batch_matches_reference(dtype, group, num_kv_heads, head_dim, block_size):
    q, cache, meta = paged_step(MIXED_QUERY_LENS, MIXED_SEQ_LENS, num_kv_heads, group, head_dim, block_size, dtype)
    scale = head_dim ** -0.5
    check(run(pf.paged_prefill_attention, q, cache, meta, scale), run(pf.paged_prefill_attention_ref, q, cache,
                                                                          meta, scale), dtype)


@pytest.mark.parametrize("block_m,block_n", [(16, 16), (64, 32)])
def test_tile_sizes_do_not_change_the_result(block_m, block_n):
    """Query tiles that split a chunk (and one that covers several chunks' worth of rows), key tiles that straddle
    cache blocks and the causal boundary."""
    q, cache, meta = paged_step([37, 1, 18], [37, 70, 50], 2, 2, 32, 16, torch.float32, seed=1)
    ref = run(pf.paged_prefill_attention_ref, q, cache, meta, 0.2)
    check(run(pf.paged_prefill_attention, q, cache, meta, 0.2, block_m=block_m, block_n=block_n), ref,
          torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group,num_kv_heads,head_dim", [(1, 2, 32), (3, 3, 64), (8, 1, 32)])
def test_int8_cache_matches_reference(dtype, group, num_kv_heads, head_dim):
    q, cache, meta = paged_step(MIXED_QUERY_LENS, MIXED_SEQ_LENS, num_kv_heads, group, head_dim, 16, dtype,
                                kv_cache_dtype="int8", seed=2)
    scale = head_dim ** -0.5
    ref = run(pf.paged_prefill_attention_ref, q, cache, meta, scale)
    check(run(pf.paged_prefill_attention, q, cache, meta, scale), ref, dtype)
    # the same cache read without its scales is raw int8 numbers: the scales are really applied
    raw = pf.paged_prefill_attention_ref(q, cache.k, cache.v, meta.block_tables, meta.seq_lens,
                                         meta.query_start_loc, scale)
    assert (raw.float() - ref.float()).abs().max() > 1.0


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize("window,softcap", [(None, None), (None, 2.0), (5, 2.0)])
def test_reference_agrees_with_engine_attention(kv_cache_dtype, window, softcap):
    """The kernel's reference and llmd.model.attention's torch path compute the same thing (fp32)."""
    q, cache, meta = paged_step(MIXED_QUERY_LENS, MIXED_SEQ_LENS, 2, 3, 32, 16, torch.float32,
                                kv_cache_dtype=kv_cache_dtype, seed=3)
    q = q * 4  # scores of a few units: a cap of 2 changes them
    opts = dict(window=window, softcap=softcap)
    torch.testing.assert_close(run(pf.paged_prefill_attention_ref, q, cache, meta, 0.3, **opts),
                               torch_paged_attention(q, cache, meta, 0.3, **opts), rtol=1e-5, atol=1e-5)


# ---- Gemma 2's attention logit soft-capping: scores -> softcap * tanh(scores / softcap) before mask and softmax -----
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype,kv_cache_dtype", [
    (torch.float32, "auto"), (torch.float32, "fp16"), (torch.float32, "int8"),
    (torch.float16, "auto"), (torch.float16, "int8"),
])
def test_softcap_matches_reference(dtype, kv_cache_dtype, window):
    """The mixed step (chunks over cached prefixes, decodes, a verify), GQA, every cache type, with and without a
    sliding window, default tiles (and small ones for the model-dtype cache): the kernel equals its torch reference,
    which is far from the uncapped result (the cap is really applied)."""
    q, cache, meta = paged_step(MIXED_QUERY_LENS, MIXED_SEQ_LENS, 2, 3, 32, 16, dtype, kv_cache_dtype=kv_cache_dtype,
                                seed=5)
    q = q * 4
    ref = run(pf.paged_prefill_attention_ref, q, cache, meta, 0.2, window=window, softcap=2.0)
    small = [{"block_m": 16, "block_n": 16}] if kv_cache_dtype == "auto" else []
    for tiles in [{}, *small]:
        check(run(pf.paged_prefill_attention, q, cache, meta, 0.2, window=window, softcap=2.0, **tiles), ref, dtype)
    uncapped = run(pf.paged_prefill_attention_ref, q, cache, meta, 0.2, window=window)
    assert (uncapped.float() - ref.float()).abs().max() > 0.1
    if dtype == torch.float32:  # the backend entry point against the engine's torch path
        check(triton_paged_attention(q, cache, meta, 0.2, window=window, softcap=2.0),
              torch_paged_attention(q, cache, meta, 0.2, window=window, softcap=2.0), dtype)


@pytest.mark.parametrize("window", [None, 5])
def test_softcap_limits(window):
    """A huge cap is no cap; a tiny one flattens every score to ~0, so each query gets the mean of V over the keys it
    sees (causal, and within the window)."""
    q, cache, meta = paged_step(MIXED_QUERY_LENS, MIXED_SEQ_LENS, 1, 8, 32, 8, torch.float32, seed=6)
    q = q * 4
    plain = run(pf.paged_prefill_attention, q, cache, meta, 0.2, window=window)
    torch.testing.assert_close(run(pf.paged_prefill_attention, q, cache, meta, 0.2, window=window, softcap=1e4), plain,
                               rtol=1e-5, atol=1e-5)
    flat = run(pf.paged_prefill_attention, q, cache, meta, 0.2, window=window, softcap=1e-5)
    v = cache[1]
    row = 0
    for i, (q_len, n) in enumerate(zip(MIXED_QUERY_LENS, MIXED_SEQ_LENS, strict=True)):
        context = v[meta.block_tables[i]].flatten(0, 1)[:n]  # [n, 1 KV head, d]
        for pos in range(n - q_len, n):
            lo = 0 if window is None else max(0, pos - window + 1)
            mean = context[lo : pos + 1].mean(0).expand(8, -1)
            torch.testing.assert_close(flat[row], mean, rtol=1e-4, atol=1e-4)
            row += 1
    assert (plain - flat).abs().max() > 0.1


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_backend_runs_steps_with_prefill_chunks_through_the_kernel(kv_cache_dtype, monkeypatch):
    q, cache, meta = paged_step(MIXED_QUERY_LENS, MIXED_SEQ_LENS, 2, 3, 32, 16, torch.float32,
                                kv_cache_dtype=kv_cache_dtype, seed=4)
    engine = torch_paged_attention(q, cache, meta, 0.3)
    calls = []
    kernel = pf.paged_prefill_attention
    monkeypatch.setattr(pf, "paged_prefill_attention", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    torch.testing.assert_close(triton_paged_attention(q, cache, meta, 0.3), engine, rtol=1e-4, atol=1e-4)
    assert calls == [1]
    decode_only = AttentionMetadata.build([1, 1], [9, 45], meta.block_tables[1:3].tolist(), 16, device=DEVICE)
    triton_paged_attention(q[:2], cache, decode_only, 0.3)
    assert calls == [1]  # decode-only steps keep the decode kernel


def test_rejects_bad_arguments():
    q, cache, meta = paged_step([4], [9], 2, 2, 32, 16, torch.float32)
    with pytest.raises(ValueError, match="do not group"):
        run(pf.paged_prefill_attention, q[:, :3], cache, meta, 1.0)
    q8, c8, meta8 = paged_step([4], [9], 1, 2, 32, 16, torch.float32, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="scales"):
        pf.paged_prefill_attention(q8, c8.k, c8.v, meta8.block_tables, meta8.seq_lens, meta8.query_start_loc, 1.0,
                                   k_scale=c8.k_scale)


# ---- real shapes (Llama-3-8B attention: 32 query heads, 8 KV heads, head_dim 128) ----------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize("query_lens,seq_lens", [
    ([2000], [2000]),  # a 2,000-token prompt in one step
    ([500, 1, 1, 9], [2000, 700, 1500, 1200]),  # the last chunk of it over a 1,500-token cached prefix, with
])  # decodes and a speculative verify in the same step
def test_real_shapes_on_gpu(kv_cache_dtype, query_lens, seq_lens):
    q, cache, meta = paged_step(query_lens, seq_lens, 8, 4, 128, 16, torch.bfloat16, kv_cache_dtype=kv_cache_dtype)
    scale = 128 ** -0.5
    ref = run(pf.paged_prefill_attention_ref, q, cache, meta, scale)
    check(run(pf.paged_prefill_attention, q, cache, meta, scale), ref, torch.bfloat16, tol=2e-2)
    check(triton_paged_attention(q, cache, meta, scale), ref, torch.bfloat16, tol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 512])
def test_softcap_real_shapes_on_gpu(window):
    """Gemma 2 2B's attention (8 query heads on 4 KV heads, head_dim 256) in bf16, soft-capped at 2 (a cap these
    random scores reach): a chunk over a cached prefix beside decodes and a speculative verify."""
    q, cache, meta = paged_step([500, 1, 1, 9], [1200, 700, 1500, 1200], 4, 2, 256, 16, torch.bfloat16)
    ref = run(pf.paged_prefill_attention_ref, q, cache, meta, 256 ** -0.5, window=window, softcap=2.0)
    check(run(pf.paged_prefill_attention, q, cache, meta, 256 ** -0.5, window=window, softcap=2.0), ref,
          torch.bfloat16, tol=2e-2)


# ---- the engine on the Triton backend (tiny Llama, CPU fp32 under the interpreter) ---------------------------------
@pytest.mark.skipif(DEVICE != "cpu", reason="the tiny model runs on CPU; on a GPU the real-shape tests cover this")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_engine_greedy_tokens_match_the_torch_backend(tiny_llama_loaded, kv_cache_dtype, monkeypatch):
    """Chunked prefills (32-token budget), decodes in the same steps and a prefix-cache hit, through both kernels:
    the same greedy tokens as the default torch attention."""
    from engine_testing import make_engine
    from llmd.engine import SamplingParams, generate
    from llmd.engine import runner as runner_module
    from llmd.model.attention_backends import TRITON

    rng = random.Random(0)
    shared = [rng.randrange(5, 200) for _ in range(40)]
    prompts = [shared + [rng.randrange(5, 200) for _ in range(n)] for n in (3, 21, 9)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    def tokens():
        engine = make_engine(tiny_llama_loaded, kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=32)
        first = generate(engine, prompts[:1], params)  # fills the prefix cache
        rest = generate(engine, prompts[1:], params)
        assert rest[0].timings.num_cached_tokens == 32
        return [r.token_ids for r in first + rest]

    want = tokens()
    calls = []
    kernel = pf.paged_prefill_attention
    monkeypatch.setattr(pf, "paged_prefill_attention", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    monkeypatch.setattr(runner_module, "choose_backend", lambda *a, **kw: TRITON)  # as a GPU's runner picks
    got = tokens()
    assert got == want
    assert len(calls) >= 4 * tiny_llama_loaded.config.num_hidden_layers  # at least 4 steps with prefill chunks
