"""Paged decode attention kernel (llmd.kernels.paged_attention) against its torch reference and the engine's
torch attention path. Without CUDA it runs under the Triton interpreter on tiny shapes."""

from __future__ import annotations

import random

import pytest
import torch
from kernel_testing import DEVICE, load_kernel_module
from llmd.model.attention import AttentionMetadata, allocate_kv_cache, torch_paged_attention, write_kv
from llmd.model.attention_backends import TRITON, TritonBackend, check_attention_backend, triton_paged_attention
from llmd.model.kv_int8 import kv_parts

pa = load_kernel_module("paged_attention")


def _ragged_batch(seq_lens, num_kv_heads, group, head_dim, block_size, dtype, seed=0):
    """A cache whose blocks are handed out in shuffled order (so block tables are not contiguous) and one query
    token per sequence."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    tables, need = [], [-(-n // block_size) for n in seq_lens]
    free = list(range(1, sum(need) + 3))
    rng.shuffle(free)
    for n in need:
        tables.append([free.pop() for _ in range(n)])
    num_blocks = sum(need) + 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, device=DEVICE).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, device=DEVICE).to(dtype)
    meta = AttentionMetadata.build([1] * len(seq_lens), list(seq_lens), tables, block_size, device=DEVICE)
    q = torch.randn(len(seq_lens), num_kv_heads * group, head_dim, device=DEVICE).to(dtype)
    return q, k_cache, v_cache, meta


def _check(out, ref, dtype):
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert (out.float() - ref.float()).abs().max() < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group,num_kv_heads,head_dim,block_size", [
    (1, 2, 32, 16),  # MHA
    (3, 3, 64, 16),  # SmolLM2's GQA ratio
    (8, 1, 32, 8),  # Llama-3-70B-like ratio, small blocks
])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_matches_reference(dtype, group, num_kv_heads, head_dim, block_size, num_splits):
    # ragged: a 1-token context, partial last blocks, one sequence spanning several kernel tiles
    seq_lens = [1, 17, 70, 5]
    q, k_cache, v_cache, meta = _ragged_batch(seq_lens, num_kv_heads, group, head_dim, block_size, dtype)
    scale = head_dim ** -0.5
    ref = pa.paged_decode_attention_ref(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale)
    # min_split_tokens 16: the 70-token context is cut into 3 slices, the shorter ones into fewer than the grid has
    out = pa.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
                                    num_splits=num_splits, min_split_tokens=16)
    _check(out, ref, dtype)


def test_split_grid_sized_from_a_bound_is_exact_per_sequence():
    """A grid sized from a large bound (a CUDA graph captures max_model_len) leaves every sequence to slice its own
    context: each row equals the reference, and equals, bit for bit, the row computed alone with the same grid."""
    seq_lens = [3, 100, 33, 64]
    q, k_cache, v_cache, meta = _ragged_batch(seq_lens, 2, 2, 32, 16, torch.float32, seed=5)
    ref = pa.paged_decode_attention_ref(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, 0.25)
    kw = dict(num_splits=4, min_split_tokens=16)
    out = pa.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, 0.25, **kw)
    _check(out, ref, torch.float32)
    for i in range(len(seq_lens)):
        alone = pa.paged_decode_attention(q[i:i + 1], k_cache, v_cache, meta.block_tables[i:i + 1],
                                          meta.seq_lens[i:i + 1], 0.25, **kw)
        assert torch.equal(alone[0], out[i])
    bounded = pa.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, 0.25,
                                        max_seq_len=4096)
    _check(bounded, ref, torch.float32)


@pytest.mark.parametrize("window,softcap", [(None, None), (None, 2.0), (5, 2.0)])
def test_reference_agrees_with_engine_attention(window, softcap):
    """The kernel's reference and llmd.model.attention's torch path compute the same thing."""
    q, k_cache, v_cache, meta = _ragged_batch([9, 33, 2], 2, 3, 32, 16, torch.float32, seed=3)
    q = q * 4  # scores of a few units: a cap of 2 changes them
    opts = dict(window=window, softcap=softcap)
    ref = pa.paged_decode_attention_ref(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, 0.2, **opts)
    engine = torch_paged_attention(q, (k_cache, v_cache), meta, 0.2, **opts)
    _check(ref, engine, torch.float32)


def test_backend_answers_decode_and_mixed_steps():
    q, k_cache, v_cache, meta = _ragged_batch([40, 3], 1, 3, 32, 16, torch.float32, seed=4)
    out = triton_paged_attention(q, (k_cache, v_cache), meta, 0.3)
    _check(out, torch_paged_attention(q, (k_cache, v_cache), meta, 0.3), torch.float32)
    # a step with a prefill chunk (query length 4) takes the prefill kernel, see test_kernels_prefill_attention.py
    mixed = AttentionMetadata.build([4, 1], [20, 3], [meta.block_tables[0].tolist()[:2], [meta.block_tables[1, 0].item()]],
                                    16, device=DEVICE)
    qm = torch.randn(5, 3, 32, device=DEVICE)
    _check(triton_paged_attention(qm, (k_cache, v_cache), mixed, 0.3),
           torch_paged_attention(qm, (k_cache, v_cache), mixed, 0.3), torch.float32)


# ---- Gemma 2's attention logit soft-capping: scores -> softcap * tanh(scores / softcap) before the softmax ------------
SOFTCAP_LENS = [1, 17, 70, 5]  # a 1-token context, partial blocks, one context over several kernel tiles and splits


def _cached_step(seq_lens, num_kv_heads, group, head_dim, dtype, kv_cache_dtype, seed=7, q_gain=4.0):
    """_ragged_batch's contexts written through write_kv into a cache of `kv_cache_dtype` under a `dtype` model, and
    queries `q_gain` times larger (scores of a few units, which a cap of 2 changes a lot)."""
    q, k_cache, v_cache, meta = _ragged_batch(seq_lens, num_kv_heads, group, head_dim, 16, torch.float32, seed)
    (cache,) = allocate_kv_cache(1, k_cache.shape[0], 16, num_kv_heads, head_dim, dtype, DEVICE, kv_cache_dtype)
    write_kv(k_cache.flatten(0, 1), v_cache.flatten(0, 1), cache, torch.arange(k_cache.shape[0] * 16, device=DEVICE))
    return (q * q_gain).to(dtype), cache, meta


def _decode(q, cache, meta, scale, **kw):
    k_cache, v_cache, k_scale, v_scale = kv_parts(cache)
    return pa.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, k_scale=k_scale,
                                     v_scale=v_scale, **kw)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype,kv_cache_dtype", [
    (torch.float32, "auto"), (torch.float32, "fp16"), (torch.float32, "int8"),
    (torch.float16, "auto"), (torch.float16, "int8"),
])
def test_decode_softcap_matches_reference(dtype, kv_cache_dtype, window):
    """GQA (3 query heads per KV head), every cache type, with and without a sliding window, one split and three:
    the kernel equals its torch reference, which is far from the uncapped result (the cap is really applied)."""
    q, cache, meta = _cached_step(SOFTCAP_LENS, 2, 3, 32, dtype, kv_cache_dtype)
    k_cache, v_cache, k_scale, v_scale = kv_parts(cache)
    ref = pa.paged_decode_attention_ref(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, 0.2, k_scale=k_scale,
                                        v_scale=v_scale, window=window, softcap=2.0)
    for num_splits in (1, 3):
        _check(_decode(q, cache, meta, 0.2, num_splits=num_splits, min_split_tokens=16, window=window, softcap=2.0),
               ref, dtype)
    uncapped = pa.paged_decode_attention_ref(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, 0.2,
                                             k_scale=k_scale, v_scale=v_scale, window=window)
    assert (uncapped.float() - ref.float()).abs().max() > 0.1
    if dtype == torch.float32:  # the backend entry point against the engine's torch path
        _check(TRITON.attend(q, cache, meta, 0.2, window=window, softcap=2.0),
               torch_paged_attention(q, cache, meta, 0.2, window=window, softcap=2.0), dtype)


@pytest.mark.parametrize("window", [None, 5])
def test_decode_softcap_limits(window):
    """A huge cap is no cap (tanh(x) ~ x: the kernel's tanh stays accurate near 0, not only to its absolute error);
    a tiny one flattens every score to ~0, so each query gets the mean of V over the keys it sees."""
    q, cache, meta = _cached_step(SOFTCAP_LENS, 1, 8, 32, torch.float32, "auto")
    opts = dict(num_splits=3, min_split_tokens=16, window=window)
    plain = _decode(q, cache, meta, 0.2, **opts)
    torch.testing.assert_close(_decode(q, cache, meta, 0.2, softcap=1e4, **opts), plain, rtol=1e-5, atol=1e-5)
    flat = _decode(q, cache, meta, 0.2, softcap=1e-5, **opts)
    v = cache[1]
    for b, n in enumerate(SOFTCAP_LENS):
        lo = 0 if window is None else max(0, n - window)
        mean = v[meta.block_tables[b]].flatten(0, 1)[lo:n].mean(0)  # [kv_heads, d]: one KV head, 8 query heads
        torch.testing.assert_close(flat[b], mean.expand(8, -1), rtol=1e-4, atol=1e-4)
    assert (plain - flat).abs().max() > 0.1


def test_split_heuristic():
    assert pa.choose_num_splits(64, 8, 4096, num_sms=132) == 1  # the batch already fills the GPU
    assert pa.choose_num_splits(1, 8, 8192, num_sms=132) == 16  # one long sequence: split
    assert pa.choose_num_splits(1, 8, 100, num_sms=132) == 1  # short context: splitting would not pay


def test_rejects_heads_that_do_not_group():
    q, k_cache, v_cache, meta = _ragged_batch([5], 2, 2, 32, 16, torch.float32)
    with pytest.raises(ValueError, match="do not group"):
        pa.paged_decode_attention(q[:, :3], k_cache, v_cache, meta.block_tables, meta.seq_lens, 1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,context", [(1, 8192), (16, 1000), (64, 300)])
def test_real_shapes_on_gpu(batch, context):
    lens = [context - 7 * i for i in range(batch)]
    q, k_cache, v_cache, meta = _ragged_batch(lens, 8, 4, 128, 16, torch.bfloat16)
    ref = pa.paged_decode_attention_ref(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, 128 ** -0.5)
    out = pa.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, 128 ** -0.5)
    assert (out.float() - ref.float()).abs().max() < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 512])
def test_softcap_real_shapes_on_gpu(window):
    """Gemma 2 2B's attention (8 query heads on 4 KV heads, head_dim 256) in bf16, soft-capped at 2, a cap that
    these unit-sized random scores reach (Gemma's 50 would leave them almost as they are)."""
    lens = [1000 - 37 * i for i in range(16)]
    q, k_cache, v_cache, meta = _ragged_batch(lens, 4, 2, 256, 16, torch.bfloat16)
    opts = dict(window=window, softcap=2.0)
    ref = pa.paged_decode_attention_ref(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, 256 ** -0.5, **opts)
    out = pa.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, 256 ** -0.5,
                                    max_seq_len=1000, **opts)
    assert (out.float() - ref.float()).abs().max() < 2e-2


@pytest.mark.gpu
def test_gemma2_is_served_by_the_triton_kernels_on_gpu():
    """A Gemma 2 model (2B's attention: soft-capped at 50, window-4096 layers beside global ones) gets the Triton
    backend on CUDA: its soft-capped kernels pass the startup check, no torch fallback."""
    from llmd.model.attention_backends import choose_backend
    from llmd.model.config import ModelConfig

    config = ModelConfig.from_hf_config({
        "architectures": ["Gemma2ForCausalLM"], "vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216,
        "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
        "sliding_window": 4096, "query_pre_attn_scalar": 256, "hidden_activation": "gelu_pytorch_tanh"})
    assert config.attn_logit_softcapping == 50.0
    assert choose_backend(torch.device("cuda"), config, torch.bfloat16) is TRITON


@pytest.mark.parametrize("kv_cache_dtype", ["fp16", "bf16"])
def test_compact_float_caches_under_an_fp32_model(kv_cache_dtype):
    """--kv-cache-dtype fp16/bf16 with fp32 activations: both kernels (a decode-only step, then a step with a prefill
    chunk over a cached prefix) read the compact cache and widen it, as the torch path does. bf16 runs on the GPU only
    (the interpreter has no bf16)."""
    if kv_cache_dtype == "bf16" and DEVICE == "cpu":
        pytest.skip("bf16 needs CUDA (the Triton interpreter computes through numpy, which has no bf16)")
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[kv_cache_dtype]
    q, k_cache, v_cache, meta = _ragged_batch([40, 3, 17], 2, 3, 32, 16, torch.float32, seed=6)
    cache = (k_cache.to(dtype), v_cache.to(dtype))
    out = triton_paged_attention(q, cache, meta, 0.3)
    _check(out, torch_paged_attention(q, cache, meta, 0.3), torch.float32)
    tables = [meta.block_tables[i, : -(-n // 16)].tolist() for i, n in enumerate([40, 3, 17])]
    mixed = AttentionMetadata.build([5, 1, 2], [40, 3, 17], tables, 16, device=DEVICE)
    qm = torch.randn(8, 6, 32, device=DEVICE)
    _check(triton_paged_attention(qm, cache, mixed, 0.3), torch_paged_attention(qm, cache, mixed, 0.3),
           torch.float32)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp16", "int8"])
def test_startup_check_accepts_the_kernels_and_refuses_a_wrong_backend(kv_cache_dtype):
    """The check the CUDA runner runs before switching to the Triton kernels (here on the interpreter): the real
    backend passes for SmolLM2's head shape; a backend that ignores the context, or one that raises, is refused
    with the reason."""
    shape = (9, 3, 64, torch.float32, kv_cache_dtype)
    assert check_attention_backend(TRITON, *shape, device=DEVICE) is None

    class IgnoresContext(TritonBackend):
        def attend(self, q, kv_cache, meta, scale, **options):
            return q

    class Fails(TritonBackend):
        def attend(self, q, kv_cache, meta, scale, **options):
            raise RuntimeError("no kernel image for this GPU")

    assert "|difference| from the torch reference" in check_attention_backend(IgnoresContext(), *shape, device=DEVICE)
    assert check_attention_backend(Fails(), *shape, device=DEVICE) == "RuntimeError: no kernel image for this GPU"


def test_startup_check_runs_the_models_softcap():
    """A soft-capped model (Gemma 2's cap, 50) is checked soft-capped, with a cap the check's scores reach: the
    kernels pass, a backend that drops the softcap is refused."""
    shape = (4, 2, 16, torch.float32)
    assert check_attention_backend(TRITON, *shape, device=DEVICE, windows=(5,), softcap=50.0) is None

    class IgnoresSoftcap(TritonBackend):
        def attend(self, q, kv_cache, meta, scale, *, window=None, softcap=None, sinks=None):
            return super().attend(q, kv_cache, meta, scale, window=window, sinks=sinks)

    problem = check_attention_backend(IgnoresSoftcap(), *shape, device=DEVICE, softcap=50.0)
    assert problem is not None and "softcap 2.0" in problem
