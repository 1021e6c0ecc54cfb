"""Engine invariants on CPU fp32: exactness under batching, prefix caching, preemption and chunked prefill; no leaked
blocks; stop handling; request validation. Tiny random-weight Llama for breadth, SmolLM2 for the real thing."""

from __future__ import annotations

import random
from dataclasses import asdict

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmd.engine import Engine, EngineConfig, EngineStats, FinishReason, Priority, SamplingParams, generate
from llmd.errors import InvalidRequest, QueueFull
from llmd.model.loader import load_model

from engine_testing import make_engine, no_leaked_blocks  # noqa: F401  (autouse leak check)

GREEDY = dict(temperature=0.0, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tiny_llama_loaded):
    return tiny_llama_loaded


@pytest.fixture(scope="module")
def smol(smollm2_gguf):
    # fp32 weights (the GGUF's Q4_1 blocks dequantized): the exactness reference on CPU
    return load_model(smollm2_gguf, dtype=torch.float32, device="cpu", quant="none")


def random_prompts(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def run_alone(loaded, prompts, params, **kw) -> list[list[int]]:
    """Each prompt run by itself (one request in the engine at a time, no prefix cache)."""
    engine = make_engine(loaded, enable_prefix_caching=False, **kw)
    return [generate(engine, [p], params)[0].token_ids for p in prompts]


def run_staggered(engine: Engine, prompts, params, arrive_every: int = 2) -> dict[str, list[int]]:
    """Add request i at step i * arrive_every; run to completion; tokens per request id."""
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    finished: set[str] = set()
    step = 0
    while len(finished) < len(prompts):
        for i, p in enumerate(prompts):
            if i * arrive_every == step:
                engine.add_request(str(i), p, params[i] if isinstance(params, list) else params)
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                finished.add(out.request_id)
        step += 1
    return tokens


# ---- exactness -------------------------------------------------------------------------------------------------
def test_greedy_identical_alone_and_in_staggered_batch_of_16(tiny):
    prompts = random_prompts(16, 2, 90, tiny.config.vocab_size)
    params = SamplingParams(max_tokens=24, **GREEDY)
    alone = run_alone(tiny, prompts, params)
    engine = make_engine(tiny, max_num_batched_tokens=64)  # small budget: prompts are chunked too
    batched = run_staggered(engine, prompts, params)
    assert engine.stats().last_batch_size >= 1 and engine.steps_total < sum(len(a) for a in alone)
    for i, ref in enumerate(alone):
        assert batched[str(i)] == ref, f"request {i} changed when batched"


@pytest.fixture(scope="module")
def smol_packed(smollm2_gguf):
    # the CPU default: the GGUF's own Q4_1 layers and Q8_0 head through llmd's compiled CPU kernel
    return load_model(smollm2_gguf, dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("weights", ["smol", "smol_packed"])
def test_smollm2_greedy_identical_alone_and_batched(weights, request):
    smol = request.getfixturevalue(weights)
    if weights == "smol_packed":  # packed wherever the kernel builds (here: a C compiler is present)
        from llmd.kernels import cpu_gemm
        from llmd.model.quant import GGUFLinear

        q4_1 = [m for m in smol.model.modules() if isinstance(m, GGUFLinear) and m.file_type == "Q4_1"]
        assert bool(q4_1) == cpu_gemm.available()
    tok = smol.tokenizer
    questions = ["What is the capital of France?", "Name three colours.", "Write a haiku about rain.",
                 "What is 2 + 2?", "Say hello in Spanish.", "Why is the sky blue? Answer in one long sentence."]
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in questions]
    params = SamplingParams(max_tokens=8, **GREEDY)
    alone = run_alone(smol, prompts, params)
    batched = run_staggered(make_engine(smol, max_num_batched_tokens=48), prompts, params, arrive_every=1)
    assert [batched[str(i)] for i in range(len(prompts))] == alone
    assert "Paris" in tok.decode(alone[0])


def test_prefix_cache_hit_gives_same_tokens_as_miss(tiny):
    shared = random_prompts(1, 70, 71, tiny.config.vocab_size, seed=1)[0]
    first, second = shared + [7, 8, 9], shared + [11, 12, 13, 14, 15]
    params = SamplingParams(max_tokens=16, **GREEDY)
    (miss,) = run_alone(tiny, [second], params)
    engine = make_engine(tiny)
    generate(engine, [first], params)
    (hit,) = generate(engine, [second], params)
    assert hit.timings.num_cached_tokens == 64  # 4 full blocks of the 70-token shared prefix
    assert engine.stats().kv.prefix_hits_tokens == 64
    assert hit.token_ids == miss


def test_smollm2_prefix_hit_matches_miss(smol):
    tok = smol.tokenizer
    system = "You are a helpful assistant who answers briefly and accurately. " * 3
    msgs = lambda q: [{"role": "system", "content": system}, {"role": "user", "content": q}]  # noqa: E731
    a, b = tok.encode_chat(msgs("What is the capital of France?")), tok.encode_chat(msgs("What is 2 + 2?"))
    params = SamplingParams(max_tokens=6, **GREEDY)
    (miss,) = run_alone(smol, [b], params)
    engine = make_engine(smol)
    generate(engine, [a], params)
    (hit,) = generate(engine, [b], params)
    assert hit.timings.num_cached_tokens >= 32
    assert hit.token_ids == miss


def test_preempted_requests_give_same_tokens(tiny):
    prompts = random_prompts(8, 10, 40, tiny.config.vocab_size, seed=2)
    params = SamplingParams(max_tokens=40, **GREEDY)
    ample = generate(make_engine(tiny), prompts, params)
    engine = make_engine(tiny, num_kv_blocks=12)  # 192 token slots for 8 requests of up to 80 tokens
    tight = generate(engine, prompts, params)
    assert engine.stats().num_preemptions > 0
    assert sum(r.timings.num_preemptions for r in tight) == engine.stats().num_preemptions
    assert [r.token_ids for r in tight] == [r.token_ids for r in ample]


def test_seeded_sampling_same_alone_and_batched(tiny):
    prompts = random_prompts(6, 5, 30, tiny.config.vocab_size, seed=3)
    seeded = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    (alone,) = run_alone(tiny, [prompts[0]], seeded)
    others = [SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True),
              SamplingParams(max_tokens=15, **GREEDY), SamplingParams(max_tokens=20, temperature=0.5, seed=9)]
    batch_params = [others[i % 3] for i in range(len(prompts))]
    batch_params[3] = seeded
    engine = make_engine(tiny, max_num_batched_tokens=32)
    batched = run_staggered(engine, [prompts[(i + 3) % 6] if i != 3 else prompts[0] for i in range(6)],
                            batch_params)
    assert batched["3"] == alone
    # and an unseeded sampler in the same batch really sampled (not all greedy)
    assert len(set(map(tuple, batched.values()))) > 1


# ---- chunked prefill -------------------------------------------------------------------------------------------
def test_long_prompt_does_not_stall_running_decodes(tiny):
    engine = make_engine(tiny, num_kv_blocks=400, max_num_batched_tokens=512, max_model_len=4096)
    vocab = tiny.config.vocab_size
    for i, p in enumerate(random_prompts(8, 5, 20, vocab, seed=4)):
        engine.add_request(f"s{i}", p, SamplingParams(max_tokens=200, **GREEDY))
    for _ in range(3):
        engine.step()
    long_prompt = random_prompts(1, 2000, 2001, vocab, seed=5)[0]
    engine.add_request("long", long_prompt, SamplingParams(max_tokens=2, **GREEDY))
    prefill_steps, steps_all_advanced = 0, 0
    while not engine.requests["long"].timings.first_token:
        outs = engine.step()
        prefill_steps += 1
        advanced = {o.request_id for o in outs if o.new_token_ids}
        steps_all_advanced += all(f"s{i}" in advanced for i in range(8))
        assert engine.last_step_tokens <= 512
    assert prefill_steps >= 4, "2,000 tokens under a 512-token budget take several steps"
    assert steps_all_advanced == prefill_steps, "every decode advanced in every step of the long prefill"
    for rid in list(engine.requests):
        engine.abort(rid)
    engine.step()


# ---- stop handling ---------------------------------------------------------------------------------------------
def boundary_stop(tokenizer, token_ids: list[int]) -> tuple[str, str]:
    """A stop string that straddles a token boundary in the text of token_ids, and the text before it."""
    pieces = [tokenizer.decode(token_ids[:i]) for i in range(len(token_ids) + 1)]
    full = pieces[-1]
    for i in range(2, len(pieces) - 1):
        cut = len(pieces[i])
        if pieces[i] == full[:cut] and cut >= 2 and len(full) >= cut + 2:
            stop = full[cut - 2 : cut + 2]
            if stop.strip() and full.find(stop) == cut - 2:
                return stop, full[: cut - 2]
    pytest.fail("the fixed greedy output has no usable token boundary: pick another prompt")


def test_smollm2_stop_string_across_token_boundary(smol):
    tok = smol.tokenizer
    prompt = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    engine = make_engine(smol)
    (free,) = generate(engine, [prompt], SamplingParams(max_tokens=10, **GREEDY))
    stop, before = boundary_stop(tok, free.token_ids)
    (stopped,) = generate(engine, [prompt], SamplingParams(max_tokens=10, stop=[stop], **GREEDY))
    assert stopped.finish_reason is FinishReason.STOP and stopped.stop_reason == stop
    assert free.stop_reason is None
    assert stopped.text == before and stop not in stopped.text
    assert len(stopped.token_ids) < len(free.token_ids)


def test_stop_string_streamed_text_never_leaks_it(tiny):
    prompt = random_prompts(1, 10, 11, tiny.config.vocab_size, seed=6)[0]
    engine = make_engine(tiny)
    (free,) = generate(engine, [prompt], SamplingParams(max_tokens=30, **GREEDY))
    stop, before = boundary_stop(tiny.tokenizer, free.token_ids)
    engine.add_request("r", prompt, SamplingParams(max_tokens=30, stop=[stop], **GREEDY))
    deltas = []
    while engine.has_work():
        deltas += [o.text_delta for o in engine.step()]
    assert "".join(deltas) == before


def test_eos_stop_ids_max_tokens_and_max_model_len(tiny):
    prompt = random_prompts(1, 8, 9, tiny.config.vocab_size, seed=7)[0]
    engine = make_engine(tiny, max_model_len=40)
    (free,) = generate(engine, [prompt], SamplingParams(max_tokens=20, **GREEDY))
    assert free.finish_reason is FinishReason.LENGTH and len(free.token_ids) == 20
    target = free.token_ids[5]
    first = free.token_ids.index(target)
    (stopped,) = generate(engine, [prompt], SamplingParams(max_tokens=20, stop_token_ids=[target], **GREEDY))
    assert stopped.finish_reason is FinishReason.STOP and stopped.token_ids == free.token_ids[: first + 1]
    assert stopped.stop_reason == target  # the stop token (vLLM's stop_reason)
    # the model's EOS ends a request unless ignore_eos
    engine.eos_token_ids.add(target)
    (eos,) = generate(engine, [prompt], SamplingParams(max_tokens=20, temperature=0.0))
    assert eos.finish_reason is FinishReason.STOP and eos.token_ids[-1] == target and eos.stop_reason is None
    engine.eos_token_ids.discard(target)
    (capped,) = generate(engine, [prompt], SamplingParams(max_tokens=100, **GREEDY))
    assert capped.finish_reason is FinishReason.LENGTH and len(prompt) + len(capped.token_ids) == 40


def test_logprobs_are_reported(tiny):
    engine = make_engine(tiny)
    (r,) = generate(engine, [[5, 6, 7]], SamplingParams(max_tokens=4, logprobs=3, **GREEDY))
    assert len(r.logprobs) == 4
    for token, lp in zip(r.token_ids, r.logprobs):
        assert lp.token_id == token and lp.top[0][0] == token and len(lp.top) == 3 and lp.logprob <= 0


# ---- admission and abort ---------------------------------------------------------------------------------------
def test_requests_that_can_never_run_are_refused(tiny):
    engine = make_engine(tiny, num_kv_blocks=4, max_model_len=100, max_num_seqs=1, max_queue=2)
    ok = SamplingParams(max_tokens=4)
    with pytest.raises(InvalidRequest, match="max_model_len"):
        engine.add_request("a", list(range(5, 105)), ok)
    with pytest.raises(InvalidRequest, match="pool"):
        engine.add_request("b", list(range(5, 60)), SamplingParams(max_tokens=30))
    with pytest.raises(InvalidRequest, match="vocabulary"):
        engine.add_request("c", [5, 10**6], ok)
    with pytest.raises(InvalidRequest, match="empty"):
        engine.add_request("d", [], ok)
    with pytest.raises(InvalidRequest, match="top_p"):
        engine.add_request("e", [5], SamplingParams(top_p=2.0))
    engine.add_request("f", [5], ok)
    with pytest.raises(InvalidRequest, match="already"):
        engine.add_request("f", [5], ok)
    engine.add_request("g", [5], ok)
    engine.add_request("g2", [5], ok)  # "f" will take the one running place, so only two wait
    with pytest.raises(QueueFull):
        engine.add_request("h", [5], ok)
    for rid in ("f", "g", "g2"):
        engine.abort(rid)
    outs = engine.step()
    assert {(o.request_id, o.finish_reason) for o in outs} == {(r, FinishReason.ABORT) for r in ("f", "g", "g2")}


def test_abort_running_and_waiting_frees_blocks(tiny):
    engine = make_engine(tiny, max_num_seqs=2)
    for i, p in enumerate(random_prompts(4, 20, 40, tiny.config.vocab_size, seed=8)):
        engine.add_request(str(i), p, SamplingParams(max_tokens=50, **GREEDY), Priority.BATCH if i else 0)
    engine.step()
    engine.step()
    assert engine.stats().requests_running == 2 and engine.stats().requests_waiting == 2
    for rid in ("0", "3"):
        engine.abort(rid)
    outs = {o.request_id: o for o in engine.step()}
    assert outs["0"].finish_reason is FinishReason.ABORT and outs["3"].finish_reason is FinishReason.ABORT
    assert outs["0"].timings.finished is not None
    for rid in list(engine.requests):
        engine.abort(rid)
    engine.step()


def test_stats_and_timings(tiny):
    engine = make_engine(tiny)
    results = generate(engine, random_prompts(3, 5, 20, tiny.config.vocab_size), SamplingParams(max_tokens=5,
                                                                                                  **GREEDY))
    s = engine.stats()
    assert s.generation_tokens_total == 15 and s.requests_finished_total == 3 and s.prompt_tokens_total > 0
    kv, c = s.kv, tiny.config
    assert kv is not None and s.spec is None  # speculation is off
    assert kv.blocks_used + kv.blocks_cached + kv.blocks_free == kv.blocks_total == 256
    assert kv.blocks_used == 0 and kv.blocks_cached > 0  # the finished prompts stay cached for reuse
    assert kv.dtype == "fp16" and kv.block_size == 16  # the CPU default KV dtype
    assert kv.bytes_per_token == c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * 2  # K and V, fp16
    assert kv.cache_bytes == (256 + 1) * 16 * kv.bytes_per_token  # the pool and its scratch block
    per_seq = {"fp32": 2 * kv.bytes_per_token, "fp16": kv.bytes_per_token, "bf16": kv.bytes_per_token,
               "int8": c.num_hidden_layers * 2 * c.num_key_value_heads * (c.head_dim + 4)}  # + an fp32 scale
    assert kv.seqs_8k_by_dtype == {k: kv.cache_bytes // (8192 * v) for k, v in per_seq.items()}
    assert kv.seqs_8k == kv.seqs_8k_by_dtype["fp16"]
    assert kv.prefix_queries_tokens > 0 and 0.0 <= kv.prefix_hit_rate <= 1.0
    assert s.tokens_per_second > 0 and s.steps_total > 0 and s.engine_alive and s.engine_error is None
    assert s.latency.ttft_ms.p50 is not None and s.latency.ttft_ms.p50 > 0
    assert EngineStats.from_dict(asdict(s)) == s  # what /v1/llmd/stats serves reads back as the same stats
    t = results[0].timings
    assert t.arrival <= t.first_scheduled <= t.first_token <= t.finished
    assert len(t.token_times) == 5 and t.num_generated_tokens == 5 and t.tpot > 0
    assert t.to_dict()["prompt_tokens"] == len(results[0].prompt_token_ids)


# ---- property: random arrivals, aborts, stops, preemptions ------------------------------------------------------
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    events=st.lists(
        st.tuples(st.integers(1, 40), st.integers(1, 12), st.booleans(), st.integers(0, 3), st.integers(0, 6)),
        min_size=1, max_size=8,
    ),
    num_blocks=st.integers(6, 20),
)
def test_random_workload_never_leaks(tiny, events, num_blocks):
    engine = Engine(tiny, EngineConfig(num_kv_blocks=num_blocks, max_num_batched_tokens=24, max_num_seqs=4))
    vocab = tiny.config.vocab_size
    abort_at: dict[str, int] = {}
    finals: dict[str, int] = {}
    tokens: dict[str, list[int]] = {}
    greedy: dict[str, tuple[list[int], SamplingParams]] = {}
    pending = list(enumerate(events))
    step = 0
    while pending or engine.has_work():
        while pending and pending[0][0] <= step:
            i, (plen, max_tokens, sampled, stop_kind, abort_after) = pending.pop(0)
            prompt = [(i * 31 + j * 7) % (vocab - 5) + 5 for j in range(plen)]
            params = SamplingParams(max_tokens=max_tokens, temperature=0.8 if sampled else 0.0, seed=i,
                                    stop_token_ids=[prompt[0]] if stop_kind == 1 else [],
                                    stop=["e"] if stop_kind == 2 else [], ignore_eos=stop_kind != 3)
            engine.add_request(str(i), prompt, params, Priority(i % 2))
            tokens[str(i)] = []
            if not sampled and not abort_after:
                greedy[str(i)] = (prompt, params)
            if abort_after:
                abort_at[str(i)] = step + abort_after
        for rid, when in list(abort_at.items()):
            if when == step:
                engine.abort(rid)
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                assert out.request_id not in finals, "one final output per request"
                finals[out.request_id] = len(out.new_token_ids)
        step += 1
        assert step < 2000, "the workload must finish"
    assert len(finals) == len(events)
    engine.check_no_leaks()
    # greedy requests that were not aborted got exactly what they get alone, preemptions or not
    reference = Engine(tiny, EngineConfig(num_kv_blocks=64, enable_prefix_caching=False))
    for rid, (prompt, params) in greedy.items():
        assert tokens[rid] == generate(reference, [prompt], params)[0].token_ids, rid
    reference.check_no_leaks()
