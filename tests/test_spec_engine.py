"""Speculative decoding in the engine (CPU, fp32): greedy output identical to plain decoding with prompt lookup and
with a draft model, alone and in mixed batches with chunked prefill; stops inside accepted runs; draft = target
accepts everything; seeded sampling stays reproducible; no leaked target or draft blocks after random aborts; a
draft with another tokenizer is refused."""

from __future__ import annotations

import random

import pytest
import torch

from llmd.engine import Engine, EngineConfig, FinishReason, SamplingParams, generate
from llmd.engine.spec_draft import TokenizerMismatch
from llmd.model.loader import load_model

from engine_testing import make_engine, no_leaked_blocks  # noqa: F401  (autouse leak check)

GREEDY = dict(temperature=0.0, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tiny_llama_loaded):
    return tiny_llama_loaded


def prompts_for(vocab: int, n: int = 4, seed: int = 0) -> list[list[int]]:
    """Prompts with repeated spans (so prompt lookup finds matches) and plain random ones."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        span = [rng.randrange(5, vocab) for _ in range(rng.randrange(6, 20))]
        out.append(span * 3 if i % 2 == 0 else [rng.randrange(5, vocab) for _ in range(rng.randrange(5, 40))])
    return out


def run_staggered(engine: Engine, prompts, params) -> list[list[int]]:
    """Add request i at step 2i so speculating decodes share steps with other sequences' prefill chunks."""
    tokens = {str(i): [] for i in range(len(prompts))}
    done: set[str] = set()
    step = 0
    while len(done) < len(prompts):
        for i, p in enumerate(prompts):
            if 2 * i == step:
                engine.add_request(str(i), p, params[i] if isinstance(params, list) else params)
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                done.add(out.request_id)
        step += 1
    return [tokens[str(i)] for i in range(len(prompts))]


SPEC_MODES = {
    "ngram": dict(speculative_mode="ngram"),
    "draft_self": dict(speculative_mode="draft", draft_model="same"),
    "draft_first_layer": dict(speculative_mode="draft", draft_model="self:1", num_speculative_tokens=3),
    "auto": dict(speculative_mode="auto", draft_model="self:1", spec_max_batch=3),
}


def spec_kw(tiny, name):
    kw = dict(SPEC_MODES[name])
    if kw.get("draft_model") == "same":
        kw["draft_model"] = tiny  # the target itself as draft: same weights, its own KV pool
    return kw


@pytest.mark.parametrize("mode", sorted(SPEC_MODES))
def test_greedy_output_identical_to_plain_decoding(tiny, mode):
    prompts = prompts_for(tiny.config.vocab_size, n=5)
    params = [SamplingParams(max_tokens=m, **GREEDY) for m in (30, 17, 25, 9, 30)]
    alone = [generate(make_engine(tiny), [p], q)[0].token_ids for p, q in zip(prompts, params)]
    spec_alone = [generate(make_engine(tiny, **spec_kw(tiny, mode)), [p], q)[0].token_ids
                  for p, q in zip(prompts, params)]
    assert spec_alone == alone
    engine = make_engine(tiny, max_num_batched_tokens=24, **spec_kw(tiny, mode))  # chunked prefill + decodes
    mixed = run_staggered(engine, prompts, params)
    assert mixed == alone
    stats = engine.stats()
    assert stats.spec.proposed_total > 0, "the test must actually speculate"
    assert [len(t) for t in mixed] == [q.max_tokens for q in params]


def test_draft_equal_to_target_accepts_nearly_everything(tiny):
    prompts = prompts_for(tiny.config.vocab_size, n=3, seed=1)
    for params in (SamplingParams(max_tokens=24, **GREEDY),
                   SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)):
        engine = make_engine(tiny, speculative_mode="draft", draft_model=tiny, num_speculative_tokens=4)
        results = generate(engine, prompts, params)
        stats = engine.stats()
        assert stats.spec.acceptance_rate >= 0.95, stats
        assert stats.spec.mean_accepted_length > 2.5
        per_request = [r.timings for r in results]
        assert sum(t.spec_proposed for t in per_request) == stats.spec.proposed_total
        assert all(t.spec_accepted <= t.spec_proposed for t in per_request)


def test_stops_inside_an_accepted_run_match_plain_decoding(tiny):
    prompt = prompts_for(tiny.config.vocab_size, n=1, seed=2)[0]
    plain = generate(make_engine(tiny), [prompt], SamplingParams(max_tokens=30, **GREEDY))[0]
    assert len(plain.token_ids) == 30
    stop_id = plain.token_ids[6]
    first_at = plain.token_ids.index(stop_id)
    stop_text = plain.text[len(plain.text) // 2: len(plain.text) // 2 + 3]
    cases = [SamplingParams(max_tokens=30, stop_token_ids=[stop_id], **GREEDY),
             SamplingParams(max_tokens=30, stop=[stop_text], **GREEDY) if stop_text.strip() else None,
             SamplingParams(max_tokens=11, **GREEDY)]
    for params in [c for c in cases if c is not None]:
        off = generate(make_engine(tiny), [prompt], params)[0]
        on_engine = make_engine(tiny, speculative_mode="draft", draft_model=tiny, num_speculative_tokens=5)
        on = generate(on_engine, [prompt], params)[0]
        assert (on.token_ids, on.text, on.finish_reason, on.stop_reason) == (off.token_ids, off.text,
                                                                              off.finish_reason, off.stop_reason)
        assert on_engine.stats().spec.accepted_total > 0
    assert len(generate(make_engine(tiny), [prompt], cases[0])[0].token_ids) == first_at + 1


def test_stop_string_inside_an_accepted_run_reports_its_stop_reason(tiny):
    """The run that ends the request holds several accepted tokens, and the stop string lands inside it: the final
    output (engine, generate() and the async stream's merge) names the stop string, as plain decoding does."""
    prompt = prompts_for(tiny.config.vocab_size, n=1, seed=2)[0]
    plain = generate(make_engine(tiny), [prompt], SamplingParams(max_tokens=40, **GREEDY))[0]
    stop_text = next(plain.text[i:i + 2] for i in range(len(plain.text) // 2, len(plain.text) - 2)
                     if plain.text[i:i + 2].strip() and plain.text.find(plain.text[i:i + 2]) == i)
    params = SamplingParams(max_tokens=40, stop=[stop_text], **GREEDY)
    off = generate(make_engine(tiny), [prompt], params)[0]
    assert off.finish_reason is FinishReason.STOP and off.stop_reason == stop_text
    engine = make_engine(tiny, speculative_mode="draft", draft_model=tiny, num_speculative_tokens=6)
    engine.add_request("r", prompt, params)
    outs = []
    while engine.has_work():
        outs += engine.step()
    last = outs[-1]
    assert last.finished and last.finish_reason is FinishReason.STOP and last.stop_reason == stop_text
    assert len(last.new_token_ids) > 1, "the stop must land inside a multi-token accepted run"
    merged = outs[0]
    for o in outs[1:]:
        merged = merged.merge(o)
    assert (merged.new_token_ids, merged.text_delta, merged.stop_reason) == (off.token_ids, off.text, stop_text)
    on = generate(make_engine(tiny, speculative_mode="draft", draft_model=tiny, num_speculative_tokens=6),
                  [prompt], params)[0]
    assert (on.token_ids, on.text, on.finish_reason, on.stop_reason) == (off.token_ids, off.text,
                                                                          off.finish_reason, off.stop_reason)


def test_greedy_logprobs_match_plain_decoding(tiny):
    prompt = prompts_for(tiny.config.vocab_size, n=1, seed=3)[0]
    params = SamplingParams(max_tokens=12, logprobs=2, **GREEDY)
    off = generate(make_engine(tiny), [prompt], params)[0]
    on = generate(make_engine(tiny, speculative_mode="draft", draft_model=tiny), [prompt], params)[0]
    assert on.token_ids == off.token_ids
    assert [lp.token_id for lp in on.logprobs] == off.token_ids
    for a, b in zip(on.logprobs, off.logprobs):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_seeded_sampling_with_speculation_is_reproducible(tiny):
    prompts = prompts_for(tiny.config.vocab_size, n=3, seed=4)
    params = SamplingParams(max_tokens=20, temperature=1.0, top_k=50, repetition_penalty=1.2, seed=11,
                            ignore_eos=True)
    runs = [[r.token_ids for r in generate(make_engine(tiny, speculative_mode="draft", draft_model="self:1"),
                                           prompts, params)] for _ in range(2)]
    assert runs[0] == runs[1]
    ngram = [[r.token_ids for r in generate(make_engine(tiny, speculative_mode="ngram"), prompts, params)]
             for _ in range(2)]
    assert ngram[0] == ngram[1]


def test_random_aborts_of_speculating_requests_leak_nothing(tiny):
    rng = random.Random(5)
    engine = make_engine(tiny, num_kv_blocks=40, speculative_mode="auto", draft_model="self:1",
                         num_speculative_tokens=4, max_num_batched_tokens=48)
    prompts = prompts_for(tiny.config.vocab_size, n=12, seed=6)
    live: set[str] = set()
    for i, p in enumerate(prompts):
        params = SamplingParams(max_tokens=rng.randrange(5, 40), temperature=rng.choice([0.0, 0.9]),
                                ignore_eos=True)
        engine.add_request(f"r{i}", p, params)
        live.add(f"r{i}")
        for _ in range(rng.randrange(1, 4)):
            for out in engine.step():
                if out.finished:
                    live.discard(out.request_id)
        if live and rng.random() < 0.5:
            victim = rng.choice(sorted(live))
            engine.abort(victim)
    while engine.has_work():
        for out in engine.step():
            if out.finished:
                live.discard(out.request_id)
        if live and rng.random() < 0.2:
            engine.abort(rng.choice(sorted(live)))
    assert engine.stats().spec.proposed_total > 0
    # the autouse fixture checks both pools: every block free or evictable-cached, no draft state left


def test_busy_batch_stops_speculating_in_auto_mode(tiny):
    prompts = prompts_for(tiny.config.vocab_size, n=6, seed=7)
    engine = make_engine(tiny, speculative_mode="auto", spec_max_batch=2)
    generate(engine, prompts, SamplingParams(max_tokens=10, **GREEDY))
    busy = engine.stats().spec.proposed_total
    engine2 = make_engine(tiny, speculative_mode="ngram")
    generate(engine2, prompts, SamplingParams(max_tokens=10, **GREEDY))
    assert busy < engine2.stats().spec.proposed_total


def test_a_draft_with_another_tokenizer_is_refused(tiny, tiny_qwen2):
    other = load_model(tiny_qwen2, dtype=torch.float32, device="cpu")
    with pytest.raises(TokenizerMismatch, match="tokenizer"):
        Engine(tiny, EngineConfig(num_kv_blocks=16, speculative_mode="draft", draft_model=other))


def test_bad_spec_settings_are_refused(tiny):
    with pytest.raises(ValueError, match="speculative_mode"):
        Engine(tiny, EngineConfig(num_kv_blocks=16, speculative_mode="sometimes"))
    with pytest.raises(ValueError, match="needs a draft model"):
        Engine(tiny, EngineConfig(num_kv_blocks=16, speculative_mode="draft"))
