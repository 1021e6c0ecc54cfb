"""A sliding-window model end to end (a tiny random-weight Mistral, window 16, contexts to 4x and more past it):
logits equal to transformers' MistralForCausalLM (eager, fp32) past the window; the engine's invariants (design.md
§5) on CPU fp32 with the blocks the window has passed dropped from every sequence: batched == alone, prefix hit ==
miss, preempted == not, speculation on == off, the CPU layer stack == the module path; and the memory: a sequence
holds at most its window's blocks, so contexts far longer than the pool run."""

from __future__ import annotations

import random

import pytest
import torch

from engine_testing import make_engine, no_leaked_blocks  # noqa: F401  (autouse leak check)
from llmd.engine import SamplingParams, generate
from llmd.kernels import cpu_ops
from llmd.model.loader import load_model
from llmd.model.simple import SingleSequence
from tiny_models import write_tiny_model

WINDOW = 16
GREEDY = dict(temperature=0.0, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def mistral_folder(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("mistral_window") / "m", "mistral", seed=7,
                            sliding_window=WINDOW)


@pytest.fixture(scope="module")
def mistral(mistral_folder):
    return load_model(mistral_folder, dtype=torch.float32, device="cpu")


def prompts(n, lo, hi, vocab, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def test_config_reads_the_real_window_not_a_context_cap(mistral):
    c = mistral.config
    assert c.sliding_window == WINDOW and c.max_position_embeddings == 512
    assert c.layer_windows == [WINDOW] * c.num_hidden_layers


def test_logits_match_transformers_past_the_window(mistral, mistral_folder):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(mistral_folder, dtype=torch.float32,
                                               attn_implementation="eager").eval()
    ids = prompts(1, 70, 71, mistral.config.vocab_size, seed=1)[0]  # 70 tokens: past 4x the window
    decode = prompts(1, 6, 7, mistral.config.vocab_size, seed=2)[0]
    with torch.no_grad():
        want = ref(torch.tensor([ids + decode])).logits[0].float()
    seq = SingleSequence(mistral, max_tokens=96, block_size=4)
    got = torch.cat([seq.feed(ids[:5]), seq.feed(ids[5:37]), seq.feed(ids[37:])] + [seq.feed([t]) for t in decode])
    assert (got - want).abs().max().item() < 1e-4
    # the window really matters here: the same weights with full attention differ past it
    ref.config.sliding_window = None
    for layer in ref.model.layers:
        layer.self_attn.sliding_window = None
    with torch.no_grad():
        no_window = ref(torch.tensor([ids + decode])).logits[0].float()
    assert (no_window[WINDOW:] - want[WINDOW:]).abs().max().item() > 1e-3


def _held(engine) -> int:
    return max((len(s.block_ids) - s.num_dropped_blocks for s in engine.requests.values()), default=0)


def test_a_sequence_holds_only_its_windows_blocks(mistral):
    """A pool of 10 blocks of 4 tokens (40 slots) runs prompts of 70 tokens and 130-token contexts, alone and 3 at a
    time, and never holds more per sequence than the window (+ one chunk) spans; the result equals a roomy pool's."""
    ps = prompts(3, 60, 71, mistral.config.vocab_size, seed=3)
    params = SamplingParams(max_tokens=60, **GREEDY)
    roomy = generate(make_engine(mistral, block_size=4, num_kv_blocks=256), ps, params)
    engine = make_engine(mistral, block_size=4, num_kv_blocks=24, max_num_batched_tokens=8)
    peak = 0
    for i, p in enumerate(ps):
        engine.add_request(str(i), p, params)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(ps))}
    while engine.has_work():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
        peak = max(peak, _held(engine))
    assert peak <= engine.block_manager.max_blocks_held(130, 8) <= (WINDOW + 8) // 4 + 2
    assert [out[str(i)] for i in range(len(ps))] == [r.token_ids for r in roomy]
    assert engine.stats()["kv_blocks_total"] * 4 < 130 * 3  # the pool could never hold the contexts whole


def test_greedy_identical_alone_and_batched(mistral):
    ps = prompts(8, 2, 80, mistral.config.vocab_size, seed=4)
    params = SamplingParams(max_tokens=40, **GREEDY)
    alone = [generate(make_engine(mistral, enable_prefix_caching=False, block_size=4), [p], params)[0].token_ids
             for p in ps]
    engine = make_engine(mistral, block_size=4, max_num_batched_tokens=24)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(ps))}
    step = 0
    while step < 2 * len(ps) or engine.has_work():
        if step % 2 == 0 and step // 2 < len(ps):
            engine.add_request(str(step // 2), ps[step // 2], params)
        for o in engine.step():
            tokens[o.request_id].extend(o.new_token_ids)
        step += 1
    assert [tokens[str(i)] for i in range(len(ps))] == alone


def test_prefix_hit_equals_miss_past_the_window(mistral):
    """A hit of 64 tokens (4x the window): the new sequence claims only the hit's blocks its window reads."""
    shared = prompts(1, 66, 67, mistral.config.vocab_size, seed=5)[0]
    first, second = shared + [7, 8, 9], shared + [11, 12, 13, 14]
    params = SamplingParams(max_tokens=20, **GREEDY)
    (miss,) = generate(make_engine(mistral, enable_prefix_caching=False, block_size=4), [second], params)
    engine = make_engine(mistral, block_size=4)
    generate(engine, [first], params)
    (hit,) = generate(engine, [second], params)
    assert hit.timings.num_cached_tokens == 64
    assert hit.token_ids == miss.token_ids


def test_preempted_equals_not(mistral):
    ps = prompts(6, 20, 70, mistral.config.vocab_size, seed=6)
    params = SamplingParams(max_tokens=40, **GREEDY)
    ample = generate(make_engine(mistral, block_size=4), ps, params)
    engine = make_engine(mistral, block_size=4, num_kv_blocks=16, max_num_batched_tokens=16)
    tight = generate(engine, ps, params)
    assert engine.stats()["num_preemptions"] > 0
    assert [r.token_ids for r in tight] == [r.token_ids for r in ample]


@pytest.mark.parametrize("spec", [dict(speculative_mode="ngram"),
                                  dict(speculative_mode="draft", draft_model="self:1", num_speculative_tokens=3)])
def test_speculation_on_equals_off(mistral, spec):
    rng = random.Random(8)
    ps = []
    for i in range(4):  # repeated spans, so prompt lookup proposes; contexts past 4x the window
        span = [rng.randrange(5, mistral.config.vocab_size) for _ in range(rng.randrange(6, 14))]
        ps.append(span * 6 if i % 2 == 0 else [rng.randrange(5, mistral.config.vocab_size) for _ in range(50)])
    params = SamplingParams(max_tokens=30, **GREEDY)
    off = [r.token_ids for r in generate(make_engine(mistral, block_size=4), ps, params)]
    engine = make_engine(mistral, block_size=4, max_num_batched_tokens=16, **spec)
    on = [r.token_ids for r in generate(engine, ps, params)]
    assert engine.stats()["spec_proposed_total"] > 0
    assert on == off


@pytest.mark.skipif(cpu_ops.load() is None, reason="no C compiler for the CPU kernels")
def test_cpu_layer_stack_equals_module_path(mistral_folder):
    """int8 weights run through the C layer stack (kernels/cpu_stack.c, each layer's window passed to its
    attention): the same greedy tokens as the module path."""
    from llmd.model import cpu_stack

    q8 = load_model(mistral_folder, dtype=torch.float32, device="cpu", quant="int8")
    ps = prompts(3, 40, 70, q8.config.vocab_size, seed=9)
    params = SamplingParams(max_tokens=30, **GREEDY)
    q8.model._cpu_stack = None
    with_stack = [r.token_ids for r in generate(make_engine(q8, block_size=4, max_num_batched_tokens=16), ps,
                                                 params)]
    assert isinstance(q8.model._cpu_stack, cpu_stack.CpuLayerStack)
    q8.model._cpu_stack = False  # the modules, each layer's attention through cpu_ops
    modules = [r.token_ids for r in generate(make_engine(q8, block_size=4, max_num_batched_tokens=16), ps, params)]
    assert with_stack == modules
