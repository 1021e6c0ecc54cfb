"""fp16 and bf16 KV caches on the CPU (--kv-cache-dtype fp16/bf16): the engine's greedy tokens are identical alone,
batched and preempted on each, SmolLM2 still answers, and the pool's stats say what each KV dtype would hold."""

from __future__ import annotations

import pytest
import torch

from engine_testing import make_engine, no_leaked_blocks  # noqa: F401  (autouse leak check)
from llmd.engine import SamplingParams, generate
from llmd.engine.config import CPU_KV_CACHE_DTYPE
from llmd.engine.runner import kv_bytes_per_block
from test_kv_int8 import GREEDY, random_prompts, staggered

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("kind,dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_engine_greedy_alone_equals_batched_and_preempted(tiny_llama_loaded, kind, dtype):
    tiny = tiny_llama_loaded
    prompts = random_prompts(12, 2, 90, tiny.config.vocab_size, seed=3)
    params = SamplingParams(max_tokens=20, **GREEDY)
    alone_engine = make_engine(tiny, kv_cache_dtype=kind, enable_prefix_caching=False)
    assert all(t.dtype is dtype for c in alone_engine.runner.kv_caches for t in c)
    alone = [generate(alone_engine, [p], params)[0].token_ids for p in prompts]
    assert staggered(make_engine(tiny, kv_cache_dtype=kind, max_num_batched_tokens=64), prompts, params) == alone
    tight = make_engine(tiny, kv_cache_dtype=kind, num_kv_blocks=11)
    assert [r.token_ids for r in generate(tight, prompts, params)] == alone
    assert tight.stats()["num_preemptions"] > 0


def test_smollm2_with_fp16_kv_answers_paris_through_the_layer_stack(smollm2_gguf):
    from llmd.model import cpu_stack
    from llmd.model.loader import load_model

    smol = load_model(smollm2_gguf, quant="gguf")
    prompt = smol.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    engine = make_engine(smol, kv_cache_dtype="fp16")
    (out,) = generate(engine, [prompt], SamplingParams(max_tokens=12, **GREEDY))
    assert "Paris" in smol.tokenizer.decode(out.token_ids)
    assert isinstance(engine.runner.forward, cpu_stack.CompiledCpuForward) and engine.runner.forward.stack._caches


def test_stats_name_the_kv_dtype_and_the_8k_sequences_each_dtype_fits(tiny_llama_loaded):
    budget = 64 * 1024**2
    cfg = tiny_llama_loaded.config
    seen = {}
    for kind in ("auto", "fp32", "fp16", "int8"):
        stats = make_engine(tiny_llama_loaded, num_kv_blocks=None, kv_cache_bytes=budget, kv_cache_dtype=kind).stats()
        seen[kind] = stats["kv_cache_dtype"], stats["kv_8k_sequences_by_dtype"]
        assert stats["kv_cache_bytes"] <= budget
    # the tiny model is fp32; "auto" on the CPU is the measured default (llmd.engine.config.CPU_KV_CACHE_DTYPE)
    assert [seen[k][0] for k in ("auto", "fp32", "fp16", "int8")] == [CPU_KV_CACHE_DTYPE, "fp32", "fp16", "int8"]
    fits = seen["fp16"][1]
    pool = make_engine(tiny_llama_loaded, num_kv_blocks=None, kv_cache_bytes=budget, kv_cache_dtype="fp16")
    for kind, n in fits.items():  # what a pool of this one's bytes holds: whole 8,192-token sequences
        per_seq = 512 * kv_bytes_per_block(cfg, 16, torch.float32, kind)
        assert n == pool.runner.kv_cache_bytes // per_seq
    assert fits["fp16"] == fits["bf16"] and fits["fp32"] * 2 <= fits["fp16"] + 1 and fits["int8"] > fits["fp16"]
