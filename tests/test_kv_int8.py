"""The int8 KV cache option (llmd.model.kv_int8): quantization, every attention reader (torch reference, batched CPU
path, Triton decode kernel under TRITON_INTERPRET), the engine on an int8 pool, pool sizing and the setting.

Tolerances against the fp cache: the int8 readers are first checked to compute exactly attention over the
dequantized cache (fp32 rounding only), and the dequantized values to lie within half a quantization step of the
originals. What remains is how that per-element error propagates, bounded per query by

    max_j |dv_j| + (exp(2 eps) - 1) * max_j |v_j - c|,    eps = max_j |scale * q . dk_j|,  c = midrange of v

(each score moves by at most eps, so each softmax weight changes by a factor within exp(+-2 eps); the output is a
convex combination of the V rows). The bound is computed from the actual errors, so it is tight where it matters:
a 1-token context must reproduce V within half a step.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from engine_testing import make_engine, no_leaked_blocks  # noqa: F401  (autouse leak check)
from kernel_testing import DEVICE, load_kernel_module
from llmd.config import ConfigError, load_settings
from llmd.engine import EngineConfig, SamplingParams, generate
from llmd.engine.runner import kv_bytes_per_block, plan_num_blocks
from llmd.model.attention import (
    AttentionMetadata, allocate_kv_cache, gather_context, torch_paged_attention, write_kv,
)
from llmd.model.attention_backends import CPU, triton_paged_attention
from llmd.model.config import ModelConfig
from llmd.model.kv_int8 import Int8KVCache, dequantize_int8, quantize_int8

pa = load_kernel_module("paged_attention")
BLOCK = 16
GREEDY = dict(temperature=0.0, ignore_eos=True)


# ---- quantization ----------------------------------------------------------------------------------------------
def test_quantize_is_within_half_a_step_and_keeps_zeros():
    torch.manual_seed(0)
    x = torch.randn(50, 3, 64) * torch.logspace(-4, 3, 50)[:, None, None]  # rows from 1e-4 to 1e3 in magnitude
    x[7, 1] = 0.0  # an all-zero head
    x[9, 2, 5] = 500.0  # an outlier channel
    q, scale = quantize_int8(x)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == x.shape[:-1]
    back = dequantize_int8(q, scale, torch.float32)
    assert ((back - x).abs() <= scale.unsqueeze(-1) * (0.5 + 1e-5)).all()
    assert (back[7, 1] == 0).all() and scale[7, 1] == 0
    assert q.abs().amax(-1)[scale > 0].eq(127).all()  # the whole int8 range is used by every head
    torch.testing.assert_close(back.abs().amax(-1), x.abs().amax(-1), rtol=1e-6, atol=0)


def test_write_kv_quantizes_into_the_right_slots():
    torch.manual_seed(1)
    cache = allocate_kv_cache(1, 6, 4, 2, 8, torch.float32, kv_cache_dtype="int8")[0]
    assert isinstance(cache, Int8KVCache) and cache.k.dtype == torch.int8
    k, v = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    slots = torch.tensor([21, 3, 4, 10, 0])
    write_kv(k, v, cache, slots)
    for x, data, scale in ((k, cache.k, cache.k_scale), (v, cache.v, cache.v_scale)):
        flat_q, flat_s = data.view(24, 2, 8), scale.view(24, 2)
        want_q, want_s = quantize_int8(x)
        assert torch.equal(flat_q[slots], want_q) and torch.equal(flat_s[slots], want_s)
        others = [s for s in range(24) if s not in slots.tolist()]
        assert flat_q[others].eq(0).all() and flat_s[others].eq(0).all()
    with pytest.raises(ValueError):  # an int8 cache cannot be unpacked as a (k, v) pair by code that ignores scales
        _k, _v = cache


# ---- torch readers ---------------------------------------------------------------------------------------------
def filled_caches(seq_lens, kv_heads, head_dim, seed, dtype=torch.float32):
    """The same random K/V written into an fp cache and an int8 cache, blocks in shuffled order."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    need = [-(-n // BLOCK) for n in seq_lens]
    free = list(range(sum(need) + 4))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in need]
    num_blocks = sum(need) + 4
    fp = allocate_kv_cache(1, num_blocks, BLOCK, kv_heads, head_dim, dtype)[0]
    i8 = allocate_kv_cache(1, num_blocks, BLOCK, kv_heads, head_dim, dtype, kv_cache_dtype="int8")[0]
    every = AttentionMetadata.build(list(seq_lens), list(seq_lens), tables, BLOCK)
    k = torch.randn(sum(seq_lens), kv_heads, head_dim).to(dtype)
    v = torch.randn(sum(seq_lens), kv_heads, head_dim).to(dtype)
    write_kv(k, v, fp, every.slot_mapping)
    write_kv(k, v, i8, every.slot_mapping)
    return fp, i8, tables


def dequantized_copy(i8: Int8KVCache, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return dequantize_int8(i8.k, i8.k_scale, dtype), dequantize_int8(i8.v, i8.v_scale, dtype)


def propagation_bound(q, fp, i8, meta, scale) -> torch.Tensor:
    """Per query token, the bound of the module docstring on |int8 output - fp output| (max over heads)."""
    out = torch.empty(q.shape[0])
    start = 0
    for i, (q_len, s_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
        k, v = gather_context(fp, meta.block_tables[i], s_len, torch.float32)
        kq, vq = gather_context(i8, meta.block_tables[i], s_len, torch.float32)
        group = q.shape[1] // k.shape[1]
        dk, dv = (kq - k).repeat_interleave(group, 1), (vq - v).repeat_interleave(group, 1)
        v = v.repeat_interleave(group, 1)
        for p in range(q_len):
            n = s_len - q_len + p + 1  # keys this query sees
            eps = (scale * torch.einsum("hd,shd->hs", q[start + p], dk[:n])).abs().amax(-1)
            half_range = ((v[:n].amax(0) - v[:n].amin(0)) / 2).amax(-1)
            out[start + p] = (dv[:n].abs().amax(dim=(0, 2)) + torch.expm1(2 * eps) * half_range).amax()
        start += q_len
    return out


@pytest.mark.parametrize("kv_heads,group,head_dim", [(3, 3, 64), (2, 1, 32), (1, 8, 16)])
def test_torch_paths_int8_against_fp(kv_heads, group, head_dim):
    # decodes of ragged lengths (1-token context, partial and full blocks) and two prefill chunks, one after a
    # cached prefix
    query_lens = [1, 5, 1, 1, 12, 1]
    seq_lens = [1, 5, 17, 48, 40, 130]
    fp, i8, tables = filled_caches(seq_lens, kv_heads, head_dim, seed=kv_heads * 10 + group)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK)
    q = torch.randn(sum(query_lens), kv_heads * group, head_dim)
    scale = head_dim ** -0.5
    ref_int8 = torch_paged_attention(q, i8, meta, scale)
    # 1. exactly attention over the dequantized cache, in the reference and in the batched path
    torch.testing.assert_close(ref_int8, torch_paged_attention(q, dequantized_copy(i8, torch.float32), meta, scale),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(CPU.attend(q, i8, meta, scale), ref_int8, rtol=1e-5, atol=1e-5)
    # 2. against the fp cache: within the propagated quantization error
    err = (ref_int8 - torch_paged_attention(q, fp, meta, scale)).abs().amax(dim=(1, 2))
    assert (err <= propagation_bound(q, fp, i8, meta, scale) + 1e-5).all()
    assert err.mean() < 0.02  # a few hundredths at most on unit-variance K/V (measured ~0.005)


def test_batched_int8_decode_is_bit_identical_alone_and_in_batch():
    query_lens = [1, 1, 7, 1, 1, 1, 3, 1]
    seq_lens = [1, 33, 7, 200, 16, 17, 50, 64]
    _fp, i8, tables = filled_caches(seq_lens, 3, 64, seed=5)
    q = torch.randn(sum(query_lens), 9, 64)
    batched = CPU.attend(q, i8, AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK), 0.125)
    start = 0
    for i, n in enumerate(query_lens):
        alone_meta = AttentionMetadata.build([n], [seq_lens[i]], [tables[i]], BLOCK)
        alone = CPU.attend(q[start : start + n], i8, alone_meta, 0.125)
        assert torch.equal(alone, batched[start : start + n]), f"sequence {i}"
        start += n


# ---- the Triton decode kernel (TRITON_INTERPRET=1 without CUDA) -------------------------------------------------
def int8_decode_batch(seq_lens, num_kv_heads, group, head_dim, block_size, dtype, seed=0):
    """Shuffled block tables, an int8 cache quantized from random values, one query token per sequence."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    need = [-(-n // block_size) for n in seq_lens]
    free = list(range(1, sum(need) + 3))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in need]
    shape = (sum(need) + 3, block_size, num_kv_heads, head_dim)
    k, k_scale = quantize_int8(torch.randn(shape) * 2)
    v, v_scale = quantize_int8(torch.randn(shape))
    cache = Int8KVCache(*(t.to(DEVICE) for t in (k, v, k_scale, v_scale)))
    meta = AttentionMetadata.build([1] * len(seq_lens), list(seq_lens), tables, block_size, device=DEVICE)
    q = torch.randn(len(seq_lens), num_kv_heads * group, head_dim, device=DEVICE).to(dtype)
    return q, cache, meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group,num_kv_heads,head_dim,block_size", [
    (1, 2, 32, 16),  # MHA
    (3, 3, 64, 16),  # SmolLM2's GQA ratio
    (8, 1, 32, 8),  # Llama-3-70B-like ratio, small blocks
])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_kernel_int8_matches_reference(dtype, group, num_kv_heads, head_dim, block_size, num_splits):
    seq_lens = [1, 17, 70, 5]  # a 1-token context, partial last blocks, several kernel tiles
    q, c, meta = int8_decode_batch(seq_lens, num_kv_heads, group, head_dim, block_size, dtype)
    scale = head_dim ** -0.5
    ref = pa.paged_decode_attention_ref(q, c.k, c.v, meta.block_tables, meta.seq_lens, scale,
                                        k_scale=c.k_scale, v_scale=c.v_scale)
    out = pa.paged_decode_attention(q, c.k, c.v, meta.block_tables, meta.seq_lens, scale, num_splits=num_splits,
                                    k_scale=c.k_scale, v_scale=c.v_scale, min_split_tokens=16)
    tol = 1e-4 if dtype == torch.float32 else 1e-2  # fp16: q and the dequantized K/V are rounded to fp16
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert (out.float() - ref.float()).abs().max() < tol


def test_kernel_reference_and_backend_agree_with_engine_attention_on_int8():
    q, c, meta = int8_decode_batch([9, 33, 2, 16], 2, 3, 32, 16, torch.float32, seed=3)
    engine = torch_paged_attention(q, c, meta, 0.2)
    ref = pa.paged_decode_attention_ref(q, c.k, c.v, meta.block_tables, meta.seq_lens, 0.2,
                                        k_scale=c.k_scale, v_scale=c.v_scale)
    torch.testing.assert_close(ref, engine, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(triton_paged_attention(q, c, meta, 0.2), engine, rtol=1e-4, atol=1e-4)
    # the same cache without its scales would be read as raw int8 numbers: the result must differ
    raw = pa.paged_decode_attention_ref(q, c.k, c.v, meta.block_tables, meta.seq_lens, 0.2)
    assert (raw - engine).abs().max() > 1.0


@pytest.mark.gpu
@pytest.mark.parametrize("batch,context", [(1, 8192), (16, 1000), (64, 300)])
def test_kernel_int8_real_shapes_on_gpu(batch, context):
    lens = [context - 7 * i for i in range(batch)]
    q, c, meta = int8_decode_batch(lens, 8, 4, 128, 16, torch.bfloat16)  # Llama-3-8B heads, bf16 queries
    kw = dict(k_scale=c.k_scale, v_scale=c.v_scale)
    ref = pa.paged_decode_attention_ref(q, c.k, c.v, meta.block_tables, meta.seq_lens, 128 ** -0.5, **kw)
    out = pa.paged_decode_attention(q, c.k, c.v, meta.block_tables, meta.seq_lens, 128 ** -0.5, **kw)
    assert (out.float() - ref.float()).abs().max() < 2e-2  # bf16 rounding of q and the dequantized K/V


def test_kernel_refuses_one_scale_only():
    q, c, meta = int8_decode_batch([5], 1, 2, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="scales"):
        pa.paged_decode_attention(q, c.k, c.v, meta.block_tables, meta.seq_lens, 1.0, k_scale=c.k_scale)


# ---- the engine on an int8 pool (tiny Llama and SmolLM2, CPU fp32) -----------------------------------------------
one_thread = pytest.mark.usefixtures("one_torch_thread")


def random_prompts(n, lo, hi, vocab, seed):
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def staggered(engine, prompts, params) -> list[list[int]]:
    """Request i arrives at step 2i; returns each request's tokens."""
    tokens = {str(i): [] for i in range(len(prompts))}
    done, step = set(), 0
    while len(done) < len(prompts):
        for i, p in enumerate(prompts):
            if 2 * i == step:
                engine.add_request(str(i), p, params)
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            done |= {out.request_id} if out.finished else set()
        step += 1
    return [tokens[str(i)] for i in range(len(prompts))]


@one_thread
def test_engine_int8_greedy_alone_equals_batched_and_preempted(tiny_llama_loaded):
    tiny = tiny_llama_loaded
    prompts = random_prompts(16, 2, 90, tiny.config.vocab_size, seed=0)
    params = SamplingParams(max_tokens=24, **GREEDY)
    alone_engine = make_engine(tiny, kv_cache_dtype="int8", enable_prefix_caching=False)
    alone = [generate(alone_engine, [p], params)[0].token_ids for p in prompts]
    batched = staggered(make_engine(tiny, kv_cache_dtype="int8", max_num_batched_tokens=64), prompts, params)
    assert batched == alone
    tight = make_engine(tiny, kv_cache_dtype="int8", num_kv_blocks=14)  # 224 slots for 16 requests of <= 113
    assert [r.token_ids for r in generate(tight, prompts, params)] == alone
    assert tight.stats()["num_preemptions"] > 0


@one_thread
def test_engine_int8_prefix_cache_hits_and_matches_a_miss(tiny_llama_loaded):
    tiny = tiny_llama_loaded
    shared = random_prompts(1, 70, 71, tiny.config.vocab_size, seed=1)[0]
    params = SamplingParams(max_tokens=16, **GREEDY)
    miss = generate(make_engine(tiny, kv_cache_dtype="int8", enable_prefix_caching=False),
                    [shared + [11, 12, 13]], params)[0]
    engine = make_engine(tiny, kv_cache_dtype="int8")
    generate(engine, [shared + [7, 8, 9]], params)
    hit = generate(engine, [shared + [11, 12, 13]], params)[0]
    assert hit.timings.num_cached_tokens == 64  # 4 full blocks of the shared prefix, read back from int8 blocks
    assert hit.token_ids == miss.token_ids


@one_thread
def test_engine_int8_speculation_keeps_greedy_output_and_draft_pool_is_int8(tiny_llama_loaded):
    tiny = tiny_llama_loaded
    prompts = random_prompts(4, 5, 40, tiny.config.vocab_size, seed=2)
    params = SamplingParams(max_tokens=20, **GREEDY)
    plain = [r.token_ids for r in generate(make_engine(tiny, kv_cache_dtype="int8"), prompts, params)]
    engine = make_engine(tiny, kv_cache_dtype="int8", speculative_mode="draft", draft_model=tiny)
    assert [r.token_ids for r in generate(engine, prompts, params)] == plain
    assert all(isinstance(c, Int8KVCache) for c in engine.speculator.draft.runner.kv_caches)
    # the draft is the target itself, quantizing the same K/V the same way: it proposes what the target picks
    assert engine.stats()["spec_acceptance_rate"] >= 0.95


@one_thread
def test_smollm2_with_int8_kv_still_answers_paris(smollm2_gguf):
    from llmd.model.loader import load_model

    smol = load_model(smollm2_gguf, dtype=torch.float32, device="cpu", quant="none")
    prompt = smol.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    (out,) = generate(make_engine(smol, kv_cache_dtype="int8"), [prompt], SamplingParams(max_tokens=12, **GREEDY))
    assert "Paris" in smol.tokenizer.decode(out.token_ids)


# ---- pool sizing -------------------------------------------------------------------------------------------------
def model_config(layers, kv_heads, head_dim):
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=1000, hidden_size=kv_heads * head_dim * 3,
                       intermediate_size=64, num_hidden_layers=layers, num_attention_heads=kv_heads * 3,
                       num_key_value_heads=kv_heads, head_dim=head_dim)


@pytest.mark.parametrize("shape", [(30, 3, 64), (32, 8, 128)])  # SmolLM2-135M, Llama-3-8B
def test_int8_pool_holds_about_2x_bf16_and_4x_fp32_blocks(shape):
    cfg = model_config(*shape)
    budget = 1024**3
    # + 1: the pool's scratch block (padding rows) is paid from the same budget
    blocks = {(dtype, kind): 1 + plan_num_blocks(cfg, EngineConfig(kv_cache_bytes=budget, kv_cache_dtype=kind), dtype,
                                                 "cpu")
              for dtype in (torch.float32, torch.bfloat16) for kind in ("auto", "int8")}
    # int8 blocks do not depend on the model dtype; the fp32 scales cost 4 bytes per head_dim values
    assert blocks[torch.float32, "int8"] == blocks[torch.bfloat16, "int8"]
    head_dim = shape[2]
    for dtype, fp_bytes in ((torch.float32, 4), (torch.bfloat16, 2)):
        ratio = blocks[dtype, "int8"] / blocks[dtype, "auto"]
        assert ratio == pytest.approx(fp_bytes * head_dim / (head_dim + 4), rel=1e-3)
    assert 1.85 < blocks[torch.bfloat16, "int8"] / blocks[torch.bfloat16, "auto"] < 2
    assert 3.7 < blocks[torch.float32, "int8"] / blocks[torch.float32, "auto"] < 4


def test_engine_int8_pool_fills_its_byte_budget_with_scales_counted(tiny_llama_loaded):
    budget = 3 * 1024**2
    engine = make_engine(tiny_llama_loaded, num_kv_blocks=None, kv_cache_bytes=budget, kv_cache_dtype="int8")
    runner = engine.runner
    caches = runner.kv_caches
    assert all(isinstance(c, Int8KVCache) for c in caches)
    allocated = sum(t.nbytes for c in caches for t in c)
    per_block = kv_bytes_per_block(tiny_llama_loaded.config, runner.block_size, runner.dtype, "int8")
    assert allocated == (runner.num_blocks + 1) * per_block == runner.kv_cache_bytes  # + the scratch block
    assert allocated <= budget < allocated + per_block  # as many blocks as fit, and no more
    fp_engine = make_engine(tiny_llama_loaded, num_kv_blocks=None, kv_cache_bytes=budget, kv_cache_dtype="fp32")
    assert sum(t.nbytes for c in fp_engine.runner.kv_caches for t in c) <= budget
    assert engine.stats()["kv_blocks_total"] > 3 * fp_engine.stats()["kv_blocks_total"]  # head_dim 16: 3.2x


# ---- the setting -------------------------------------------------------------------------------------------------
def test_setting_from_flag_env_and_config_file(tmp_path, monkeypatch):
    for name in [n for n in os.environ if n.startswith("LLMD_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert load_settings().kv_cache_dtype == "auto"
    (tmp_path / "llmd").mkdir()
    (tmp_path / "llmd" / "config.toml").write_text('[engine]\nkv-cache-dtype = "int8"\n')
    assert load_settings().kv_cache_dtype == "int8"
    monkeypatch.setenv("LLMD_KV_CACHE_DTYPE", "auto")
    assert load_settings().kv_cache_dtype == "auto"
    assert load_settings(kv_cache_dtype="int8").kv_cache_dtype == "int8"
    assert load_settings(kv_cache_dtype="fp16").kv_cache_dtype == "fp16"
    with pytest.raises(ConfigError,
                       match=r"kv_cache_dtype \(--kv-cache-dtype\): must be one of auto, fp32, fp16, bf16, int8"):
        load_settings(kv_cache_dtype="fp8")
    monkeypatch.setenv("LLMD_KV_CACHE_DTYPE", "int4")
    with pytest.raises(ConfigError, match="LLMD_KV_CACHE_DTYPE"):
        load_settings()


def test_engine_config_rejects_unknown_kv_dtype():
    with pytest.raises(ValueError, match="kv_cache_dtype .*one of auto, fp32, fp16, bf16, int8"):
        EngineConfig(kv_cache_dtype="fp8").validate()
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        allocate_kv_cache(1, 1, 16, 1, 8, torch.float32, kv_cache_dtype="int4")
