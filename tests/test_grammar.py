"""Grammar-constrained decoding (engine/grammar.py, llguidance) on CPU fp32.

Every constrained output parses and validates against its schema (or matches its regex / grammar), in greedy and
every sampling mode; a constrained greedy request gives the same tokens alone, in a batch of 16 next to free
requests with chunked prefill, on a prefix-cache hit, after preemption by recompute, and with speculation on
(prompt lookup and a draft model); EOS is allowed only where the grammar accepts, and a finished grammar ends the
request; bad constraints are ConstraintErrors; the async front compiles off the engine thread without stalling it.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time

import jsonschema
import pytest
import torch

from llmd.engine import AsyncEngine, Engine, EngineConfig, FinishReason, SamplingParams, generate
from llmd.engine import grammar as grammar_mod
from llmd.engine.grammar import GrammarCompiler, step_masks
from llmd.engine.types import Constraint, ConstraintError

from engine_testing import make_engine, no_leaked_blocks  # noqa: F401  (autouse leak check)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# The tiny model's weights are random: without these options (the schema's own x-guidance) it spends its tokens on
# the whitespace JSON allows between values.
COMPACT = {"whitespace_pattern": None, "whitespace_flexible": False}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "pet": {"enum": ["cat", "dog", "fish"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "pet", "tags"],
    "additionalProperties": False,
    "x-guidance": COMPACT,
}
GREEDY = dict(temperature=0.0)


def person() -> Constraint:
    return Constraint("json_schema", json.dumps(PERSON))


def assert_person(result) -> None:
    assert result.finish_reason is FinishReason.STOP, (result.finish_reason, result.text)
    jsonschema.validate(json.loads(result.text), PERSON)


@pytest.fixture(scope="module")
def tiny(tiny_llama_loaded):
    return tiny_llama_loaded


PREAMBLE = "The quick brown fox jumps over the lazy dog. A paged cache stores keys and values in fixed-size blocks. "


def prompts_for(tok, n: int) -> list[list[int]]:
    """Prompts sharing a preamble of a few KV blocks (prefix-cache hits), each with its own tail."""
    words = ["fox", "cache", "Paris", "code", "tokens", "stack", "world", "models"]
    return [tok.encode(f"{PREAMBLE}The {words[i % 8]} number {i} is") for i in range(n)]


def test_constrained_greedy_output_validates_and_the_grammar_ends_the_request(tiny):
    prompts = prompts_for(tiny.tokenizer, 4)
    free = generate(make_engine(tiny), prompts, SamplingParams(max_tokens=60, **GREEDY))
    constrained = generate(make_engine(tiny), prompts, SamplingParams(max_tokens=200, constraint=person(), **GREEDY))
    for f, c in zip(free, constrained):
        assert_person(c)
        assert c.token_ids[-1] not in tiny.config.eos_token_ids  # ended by the finished grammar, not by EOS
        with pytest.raises(ValueError):
            json.loads(f.text)  # the random model left alone writes no JSON: the mask did the work


def test_constrained_greedy_is_exact_batched_cached_preempted_and_speculating(tiny):
    """16 requests, every other one constrained; each one's tokens equal its run alone in a fresh engine."""
    prompts = prompts_for(tiny.tokenizer, 16)
    params = [SamplingParams(max_tokens=120 if i % 2 == 0 else 40, constraint=person() if i % 2 == 0 else None,
                             ignore_eos=i % 2 == 1, **GREEDY) for i in range(16)]
    alone = [generate(make_engine(tiny), [p], q)[0].token_ids for p, q in zip(prompts, params)]
    engine = make_engine(tiny, max_num_batched_tokens=48)  # chunked prefill next to decodes
    batched = generate(engine, prompts, params)
    assert [r.token_ids for r in batched] == alone
    for r in batched[::2]:
        assert_person(r)
    again = generate(engine, prompts, params)  # the prompts' blocks are in the prefix cache now
    assert sum(r.timings.num_cached_tokens for r in again) > 0
    assert [r.token_ids for r in again] == alone
    tight = make_engine(tiny, num_kv_blocks=12, block_size=16)
    preempted = generate(tight, prompts, params)
    assert tight.stats().num_preemptions > 0
    assert [r.token_ids for r in preempted] == alone
    for kw in (dict(speculative_mode="ngram"), dict(speculative_mode="draft", draft_model=tiny),
               dict(speculative_mode="draft", draft_model="self:1", num_speculative_tokens=3)):
        spec = make_engine(tiny, max_num_batched_tokens=64, **kw)
        assert [r.token_ids for r in generate(spec, prompts, params)] == alone, kw
        assert spec.stats().spec.proposed_total > 0
    spec = make_engine(tiny, speculative_mode="draft", draft_model=tiny)
    one = generate(spec, prompts[:1], params[:1])[0]
    assert one.token_ids == alone[0] and spec.stats().spec.accepted_total > 0


def test_prompt_lookup_proposes_what_the_grammar_forces(tiny):
    """The keys of the schema are forced text: with speculation on they come as proposals, mostly accepted."""
    prompt = prompts_for(tiny.tokenizer, 1)
    params = SamplingParams(max_tokens=120, constraint=person(), **GREEDY)
    plain = generate(make_engine(tiny), prompt, params)[0]
    engine = make_engine(tiny, speculative_mode="ngram")
    spec = generate(engine, prompt, params)[0]
    assert spec.token_ids == plain.token_ids
    stats = engine.stats()
    assert stats.spec.accepted_total >= 8, stats  # '{"name":"' and the other keys at least
    compiler = engine.grammars
    m = compiler.compile(Constraint("regex", "The quick brown fox (a|b)")).matcher()
    assert m.forced_tokens(3) == tiny.tokenizer.encode("The quick brown")


@pytest.mark.parametrize("sampling", [
    dict(temperature=1.0),
    dict(temperature=1.3, top_k=20),
    dict(temperature=0.9, top_p=0.8),
    dict(temperature=1.0, min_p=0.05),
    dict(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5),
    dict(temperature=0.0, repetition_penalty=1.5, frequency_penalty=1.0),
])
def test_every_sampling_mode_stays_within_the_grammar(tiny, sampling):
    prompts = prompts_for(tiny.tokenizer, 4)
    params = [SamplingParams(max_tokens=200, seed=s, constraint=person(), **sampling) for s in range(4)]
    results = generate(make_engine(tiny), prompts, params)
    for r in results:
        assert_person(r)
    # seeded: the same tokens alone as in the batch, and with speculation (sampled: rejection sampling)
    alone = generate(make_engine(tiny), prompts[1:2], params[1:2])[0]
    assert alone.token_ids == results[1].token_ids
    for kw in (dict(speculative_mode="ngram"), dict(speculative_mode="draft", draft_model="self:1")):
        for r in generate(make_engine(tiny, **kw), prompts, params):
            assert_person(r)


def test_regex_lark_gbnf_and_json_object(tiny):
    prompts = prompts_for(tiny.tokenizer, 3)
    cases = [
        (Constraint("regex", r"[a-c]{3}-[0-9]{2}"), lambda t: re.fullmatch(r"[a-c]{3}-[0-9]{2}", t)),
        (Constraint("lark", 'start: ("yes" | "no") " " NUM\nNUM: /[0-9]{1,3}/'),
         lambda t: re.fullmatch(r"(yes|no) [0-9]{1,3}", t)),
        (Constraint("gbnf", 'root ::= "(" item ("," item){0,3} ")"\nitem ::= [a-z] [a-z]?'),
         lambda t: re.fullmatch(r"\([a-z]{1,2}(,[a-z]{1,2}){0,3}\)", t)),
    ]
    for constraint, check in cases:
        for r in generate(make_engine(tiny), prompts, SamplingParams(max_tokens=40, constraint=constraint, **GREEDY)):
            assert r.finish_reason is FinishReason.STOP and check(r.text), (constraint, r.text)
    r = generate(make_engine(tiny), prompts[:1], SamplingParams(max_tokens=300, temperature=0.7, seed=1,
                                                                constraint=Constraint("json_object", "")))[0]
    if r.finish_reason is FinishReason.STOP:
        assert isinstance(json.loads(r.text), dict)
    else:  # an open object may run past max_tokens; what there is still starts as one
        assert r.finish_reason is FinishReason.LENGTH and r.text.startswith("{")


def test_logprobs_of_a_constrained_output_are_the_raw_distributions(tiny):
    """Logprobs are taken before the mask (finite, the model's own), and asking for them changes no token."""
    prompt = prompts_for(tiny.tokenizer, 1)
    plain = generate(make_engine(tiny), prompt, SamplingParams(max_tokens=120, constraint=person(), **GREEDY))[0]
    for kw in ({}, dict(speculative_mode="draft", draft_model=tiny)):
        r = generate(make_engine(tiny, **kw), prompt, SamplingParams(max_tokens=120, constraint=person(), logprobs=3,
                                                                     **GREEDY))[0]
        assert r.token_ids == plain.token_ids
        assert [lp.token_id for lp in r.logprobs] == r.token_ids
        assert all(lp.logprob > -1e9 and len(lp.top) == 3 and all(v > -1e9 for _, v in lp.top) for lp in r.logprobs)


def test_lark_grammars_may_name_special_tokens(tiny):
    """Special tokens are marked for llguidance, so a lark grammar can require one (<|name|>) and free text cannot
    produce it."""
    tok = tiny.tokenizer
    compiler = GrammarCompiler(tok, tiny.config.vocab_size, sorted(tok.eos_token_ids))
    header = tok.backend.token_to_id("<|start_header_id|>")
    m = compiler.compile(Constraint("lark", 'start: "ab" <|start_header_id|> "c"')).matcher()
    ab, c = tok.encode("ab"), tok.encode("c")
    assert m.valid_prefix_len(ab + [header] + c) == len(ab) + 1 + len(c)
    assert m.valid_prefix_len(ab + tok.encode("<|", add_special_tokens=False)) == len(ab)
    free = compiler.compile(Constraint("regex", ".{0,20}")).matcher()
    assert free.valid_prefix_len([header]) == 0


def test_stop_strings_and_max_tokens_cut_a_constrained_output(tiny):
    prompt = prompts_for(tiny.tokenizer, 1)
    full = generate(make_engine(tiny), prompt, SamplingParams(max_tokens=200, constraint=person(), **GREEDY))[0]
    assert_person(full)
    short = generate(make_engine(tiny), prompt, SamplingParams(max_tokens=5, constraint=person(), **GREEDY))[0]
    assert short.finish_reason is FinishReason.LENGTH and short.token_ids == full.token_ids[:5]
    cut = generate(make_engine(tiny), prompt, SamplingParams(max_tokens=200, stop=['"age"'], constraint=person(),
                                                             **GREEDY))[0]
    assert (cut.finish_reason, cut.stop_reason) == (FinishReason.STOP, '"age"')
    assert full.text.startswith(cut.text) and '"age"' not in cut.text


def _token_of(tok, text: str) -> int:
    (token,) = tok.encode(text)
    return token


def test_eos_is_allowed_only_where_the_grammar_accepts(tiny):
    tok = tiny.tokenizer
    eos = sorted(set(tiny.config.eos_token_ids) | tok.eos_token_ids)
    compiler = GrammarCompiler(tok, tiny.config.vocab_size, eos)
    a = _token_of(tok, "a")

    def allowed(matcher) -> set[int]:
        masks = step_masks([(matcher, [])])
        logits = torch.zeros(1, tiny.config.vocab_size)
        masks.apply(logits)
        return set(torch.nonzero(logits[0] == 0).flatten().tolist())

    m = compiler.compile(Constraint("regex", "a{2,3}")).matcher()
    assert a in allowed(m) and not set(eos) & allowed(m)
    assert m.accept(a) and not set(eos) & allowed(m)  # "a": not yet accepting
    assert m.accept(a) and set(eos) <= allowed(m) and a in allowed(m)  # "aa": accepting, may go on
    assert m.accept(a) and m.is_finished and allowed(m) == set(eos)  # "aaa": only EOS can follow
    assert all(t < tiny.config.vocab_size for t in allowed(m))
    # ids past the tokenizer's vocabulary (the padded embedding rows) are never allowed
    fresh = compiler.compile(Constraint("regex", "[^x]{0,4}")).matcher()
    assert max(allowed(fresh)) < tok.vocab_size


def test_mask_rows_for_a_proposal_equal_step_by_step_masks_and_roll_back(tiny):
    tok = tiny.tokenizer
    compiler = GrammarCompiler(tok, tiny.config.vocab_size, sorted(tok.eos_token_ids))
    text = '{"name":"ab","age":7,"pet":"cat","tags":[]}'
    tokens = tok.encode(text)
    m = compiler.compile(person()).matcher()
    assert m.valid_prefix_len(tokens) == len(tokens)
    assert m.valid_prefix_len(tokens[:3] + tok.encode("zz")) == 3
    proposal = tokens[:5] + tok.encode("zz")  # five valid tokens, then what the grammar rejects
    masks = step_masks([(None, [1]), (m, proposal)])
    assert masks.rows == [2, 3, 4, 5, 6, 7]  # after the free sequence's 2 rows: 1 + 5 rows, none past the reject
    ref = compiler.compile(person()).matcher()
    for j in range(6):
        one = step_masks([(ref, [])])
        assert torch.equal(one.bitmask[0], masks.bitmask[j]), j
        if j < 5:
            assert ref.accept(proposal[j])
    assert torch.equal(step_masks([(m, [])]).bitmask, step_masks([(compiler.compile(person()).matcher(), [])]).bitmask)
    # a proposal that completes the grammar and goes on to EOS (which llguidance does not count for rollback)
    for t in tokens[:-1]:
        assert m.accept(t)
    eos = min(tok.eos_token_ids)
    masks = step_masks([(m, [tokens[-1], eos, tokens[0]])])
    assert masks.rows == [0, 1]  # the row before "}" and the one before EOS: nothing after EOS is ever sampled
    assert m.accept(tokens[-1]) and m.is_finished  # the state is where it was


@pytest.mark.parametrize("constraint,message", [
    (Constraint("json_schema", '{"type": "objec"}'), "invalid json_schema"),
    (Constraint("json_schema", '{"type": "object",'), "not valid JSON"),
    (Constraint("json_schema", '[1, 2]'), "must be an object"),
    (Constraint("json_schema", '{"enum": []}'), "json_schema"),
    (Constraint("json_schema", '{"type": "integer", "minimum": 5, "maximum": 1}'), "json_schema"),
    (Constraint("lark", "start: foo"), "unknown name"),
    (Constraint("regex", "(unclosed"), "regex"),
    (Constraint("gbnf", 'root ::= "a" undefined_rule'), "gbnf"),
    (Constraint("json_schema", json.dumps({"type": "object", "properties": {"a": {"enum": list(range(5000))}}})),
     "alternatives"),
    (Constraint("json_schema", '{"items": ' * 60 + "{}" + "}" * 60), "nests deeper"),
    (Constraint("regex", "a" * (grammar_mod.MAX_CONSTRAINT_CHARS + 1)), "at most"),
])
def test_bad_constraints_are_constraint_errors(tiny, constraint, message):
    compiler = GrammarCompiler(tiny.tokenizer, tiny.config.vocab_size, sorted(tiny.tokenizer.eos_token_ids))
    with pytest.raises(ConstraintError, match=message):
        compiler.compile(constraint)
    with pytest.raises(ConstraintError, match=message):  # the failure is cached, and raised again
        compiler.compile(constraint)
    engine = make_engine(tiny)
    with pytest.raises(ConstraintError):
        engine.add_request("r", [5, 6, 7], SamplingParams(constraint=constraint))
    assert not engine.requests


def test_compiled_grammars_are_cached_in_a_bounded_lru(tiny):
    compiler = GrammarCompiler(tiny.tokenizer, tiny.config.vocab_size, sorted(tiny.tokenizer.eos_token_ids),
                               cache_size=3)
    first = compiler.compile(person())
    assert compiler.compile(Constraint("json_schema", json.dumps(PERSON))) is first
    for i in range(3):
        compiler.compile(Constraint("regex", f"x{{{i + 1}}}"))
    assert compiler.cached(person()) is None and len(compiler._cache) == 3
    with pytest.raises(ConstraintError, match="kind"):
        SamplingParams(constraint=Constraint("yaml", "")).validate()


def test_smollm2_schema_output_is_exact_batched_and_speculating(smollm2_gguf):
    """The bundled model, fp32: a JSON-schema answer to a chat prompt, alone, among 16, and with speculation."""
    from llmd.model.loader import load_model

    loaded = load_model(smollm2_gguf, dtype=torch.float32, device="cpu")
    tok = loaded.tokenizer
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer", "minimum": 0, "maximum": 10**8}},
              "required": ["city", "population"], "additionalProperties": False}
    constraint = Constraint("json_schema", json.dumps(schema))
    topics = ["France", "Japan", "Peru", "Kenya"]
    prompts = [tok.encode_chat([{"role": "user", "content": f"Name the capital of {topics[i % 4]} and its "
                                 f"population, as JSON (#{i})."}]) for i in range(16)]
    params = [SamplingParams(max_tokens=40, constraint=constraint if i % 2 == 0 else None, ignore_eos=i % 2 == 1,
                             **GREEDY) for i in range(16)]
    alone = generate(Engine(loaded, EngineConfig(num_kv_blocks=64)), prompts[:1], params[:1])[0]
    assert alone.finish_reason is FinishReason.STOP
    jsonschema.validate(json.loads(alone.text), schema)
    batch = generate(Engine(loaded, EngineConfig(num_kv_blocks=256)), prompts, params)
    assert batch[0].token_ids == alone.token_ids
    for r in batch[::2]:
        jsonschema.validate(json.loads(r.text), schema)
    spec = Engine(loaded, EngineConfig(num_kv_blocks=64, speculative_mode="ngram"))
    assert generate(spec, prompts[:1], params[:1])[0].token_ids == alone.token_ids


# ---- the async front ----------------------------------------------------------------------------------------------
@pytest.fixture
async def aengine(tiny):
    engine = Engine(tiny, EngineConfig(num_kv_blocks=128, max_num_seqs=4, max_queue=8))
    front = AsyncEngine(engine)
    front.start()
    yield front
    await front.shutdown()
    engine.check_no_leaks()


async def collect(stream):
    tokens, text, last = [], "", None
    async for out in stream:
        tokens += out.new_token_ids
        text += out.text_delta
        last = out
    return tokens, text, last


async def test_async_compile_reports_bad_constraints_and_serves_good_ones(aengine, tiny):
    bad = Constraint("json_schema", '{"type": "objec"}')
    with pytest.raises(ConstraintError, match="invalid json_schema"):
        await aengine.compile_constraint(bad)
    with pytest.raises(ConstraintError):  # cached failure: refused at submit
        aengine.submit([5, 6, 7], SamplingParams(constraint=bad))
    other_bad = Constraint("regex", "(x")
    stream = aengine.submit([5, 6, 7], SamplingParams(constraint=other_bad))  # not compiled yet: fails in-stream
    _tokens, _text, last = await collect(stream)
    assert last.finished and last.error and "regex" in last.error
    params = SamplingParams(max_tokens=200, constraint=person(), **GREEDY)
    prompt = prompts_for(tiny.tokenizer, 1)[0]
    tokens, text, last = await collect(aengine.submit(prompt, params))
    ref = generate(Engine(tiny, EngineConfig(num_kv_blocks=64)), [prompt], params)[0]
    assert (tokens, text, last.finish_reason) == (ref.token_ids, ref.text, FinishReason.STOP)
    jsonschema.validate(json.loads(text), PERSON)


async def test_a_slow_compile_does_not_stall_other_requests(aengine, tiny, monkeypatch):
    compiler = aengine.engine.grammars
    real = compiler._compile

    def slow(constraint):
        time.sleep(1.5)
        return real(constraint)

    monkeypatch.setattr(compiler, "_compile", slow)
    prompt = prompts_for(tiny.tokenizer, 1)[0]
    slow_stream = aengine.submit(prompt, SamplingParams(max_tokens=200, constraint=person(), **GREEDY))
    start = time.monotonic()
    free_tokens, _text, free_last = await collect(aengine.submit([5, 6, 7], SamplingParams(max_tokens=8, **GREEDY)))
    free_done = time.monotonic() - start
    assert len(free_tokens) == 8 and free_done < 1.2, free_done
    _tokens, text, last = await collect(slow_stream)
    assert last.finish_reason is FinishReason.STOP and time.monotonic() - start >= 1.5
    jsonschema.validate(json.loads(text), PERSON)
    # aborted while its grammar compiles: the stream ends, nothing is left behind
    waiting = aengine.submit(prompt, SamplingParams(max_tokens=20, constraint=Constraint("regex", "[a-z]{3}")))
    waiting.abort()
    _t, _x, last = await collect(waiting)
    assert last.finished and last.finish_reason is FinishReason.ABORT
    await asyncio.sleep(1.8)  # the compile finishing later must not resurrect it
    assert not aengine.engine.requests


def test_random_constrained_traffic_leaks_nothing(tiny):
    rng = random.Random(3)
    engine = make_engine(tiny, num_kv_blocks=24, speculative_mode="auto", draft_model="self:1",
                         max_num_batched_tokens=40)
    prompts = prompts_for(tiny.tokenizer, 10)
    live = set()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=rng.randrange(5, 120), temperature=rng.choice([0, 1]),
                                                      constraint=person() if i % 3 else None))
        live.add(f"r{i}")
        for out in engine.step():
            if out.finished:
                live.discard(out.request_id)
        if live and rng.random() < 0.3:
            engine.abort(rng.choice(sorted(live)))
    while engine.has_work():
        for out in engine.step():
            if out.finished:
                live.discard(out.request_id)
