"""Sliding-window models end to end, window 16, contexts to 4x and more past it: a tiny random-weight Mistral (every
layer windowed: one KV group whose old blocks are dropped) and a tiny Qwen2 with use_sliding_window (layer 0
global, layer 1 windowed: two KV groups). Logits equal to transformers' (eager, fp32) past the window; the engine's
invariants (design.md §5) on CPU fp32 while the window layers drop the blocks their window has passed: batched ==
alone, prefix hit == miss (also when the window group has lost part of a hit), preempted == not, speculation on ==
off, the CPU layer stack == the module path; and the memory: a window layer holds at most its window's blocks, so
contexts far longer than its pool run."""

from __future__ import annotations

import random

import pytest
import torch

from engine_testing import make_engine, no_leaked_blocks  # noqa: F401  (autouse leak check)
from llmd.engine import SamplingParams, generate
from llmd.kernels import cpu_ops
from llmd.model.loader import load_model
from simple_driver import SingleSequence
from tiny_models import write_tiny_model

WINDOW = 16
GREEDY = dict(temperature=0.0, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("window_models")
    return {kind: write_tiny_model(root / kind, kind, seed=7, sliding_window=WINDOW) for kind in ("mistral", "qwen2")}


@pytest.fixture(scope="module", params=["mistral", "qwen2"])
def kind(request):
    return request.param


@pytest.fixture(scope="module")
def mistral_folder(folders, kind):
    return folders[kind]


@pytest.fixture(scope="module")
def mistral(mistral_folder):
    """The model under test: the all-window Mistral, or the mixed Qwen2 (the name is the first one's)."""
    return load_model(mistral_folder, dtype=torch.float32, device="cpu")


def prompts(n, lo, hi, vocab, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def test_config_reads_the_real_window_not_a_context_cap(mistral, kind):
    c = mistral.config
    assert c.sliding_window == WINDOW and c.max_position_embeddings == 512
    assert c.layer_windows == ([WINDOW] * c.num_hidden_layers if kind == "mistral" else [None, WINDOW])
    engine = make_engine(mistral, block_size=4)
    assert (engine.window_block_manager is None) == (kind == "mistral")
    assert engine.block_manager.window == (WINDOW if kind == "mistral" else None)


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
    no_window_config = dict(sliding_window=None)
    if hasattr(ref.config, "layer_types"):  # Qwen2
        no_window_config.update(use_sliding_window=False,
                                layer_types=["full_attention"] * ref.config.num_hidden_layers)
    full = AutoModelForCausalLM.from_pretrained(mistral_folder, dtype=torch.float32, attn_implementation="eager",
                                                **no_window_config).eval()
    with torch.no_grad():
        no_window = full(torch.tensor([ids + decode])).logits[0].float()
    assert (no_window[WINDOW:] - want[WINDOW:]).abs().max().item() > 1e-3


def _held(engine) -> int:
    """The most blocks a live sequence holds in the window layers' group."""
    if engine.window_block_manager is not None:
        return max((len(s.window_blocks.held) for s in engine.requests.values()), default=0)
    return max((len(s.block_ids) - s.num_dropped_blocks for s in engine.requests.values()), default=0)


def test_a_sequence_holds_only_its_windows_blocks(mistral, kind):
    """A pool of 10 blocks of 4 tokens (40 slots) runs prompts of 70 tokens and 130-token contexts, alone and 3 at a
    time, and never holds more per sequence than the window (+ one chunk) spans; the result equals a roomy pool's."""
    ps = prompts(3, 60, 71, mistral.config.vocab_size, seed=3)
    params = SamplingParams(max_tokens=60, **GREEDY)
    roomy = generate(make_engine(mistral, block_size=4, num_kv_blocks=256), ps, params)
    if kind == "mistral":
        engine = make_engine(mistral, block_size=4, num_kv_blocks=24, max_num_batched_tokens=8)
    else:  # the budget split between the two groups: the window layer's pool holds just 3 windows (+ a chunk)
        per_layer_block = 4 * 2 * 2 * 16 * 4  # tokens x (K, V) x kv heads x head_dim x fp32
        engine = make_engine(mistral, block_size=4, num_kv_blocks=None, max_num_seqs=3, max_num_batched_tokens=8,
                             kv_cache_bytes=145 * per_layer_block, kv_cache_dtype="fp32")
        assert (engine.block_manager.num_blocks, engine.window_block_manager.num_blocks) == (120, 23)
    window_pool = engine.window_block_manager or engine.block_manager
    peak = 0
    for i, p in enumerate(ps):
        engine.add_request(str(i), p, params)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(ps))}
    while engine.has_work():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
        peak = max(peak, _held(engine))
    assert peak <= window_pool.max_blocks_held(130, 8) <= (WINDOW + 8) // 4 + 2
    assert [out[str(i)] for i in range(len(ps))] == [r.token_ids for r in roomy]
    if kind == "mistral":
        assert engine.stats().kv.blocks_total * 4 < 130 * 3  # the pool could never hold the contexts whole


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


def test_a_hit_the_window_group_has_partly_lost_is_cut_back(folders):
    """Two KV groups: the global layer still caches the whole 64-token prefix, but the window layer's pool lost the
    prefix's last block (evicted): the hit is cut back to the 60 tokens whose window blocks are all there (never
    served with K/V the window layer no longer has); then lost entirely: a miss. Tokens equal a miss's each time."""
    mixed = load_model(folders["qwen2"], dtype=torch.float32, device="cpu")
    shared = prompts(1, 66, 67, mixed.config.vocab_size, seed=5)[0]
    first, second = shared + [7, 8, 9], shared + [11, 12, 13, 14]
    params = SamplingParams(max_tokens=12, **GREEDY)
    (miss,) = generate(make_engine(mixed, enable_prefix_caching=False, block_size=4), [second], params)
    engine = make_engine(mixed, block_size=4)
    generate(engine, [first], params)
    wbm = engine.window_block_manager
    last = wbm.hash_chain(shared, 16)[-1]
    wbm._uncache(wbm.blocks[wbm._cache[last]])  # as an eviction would
    (hit,) = generate(engine, [second], params)
    assert hit.timings.num_cached_tokens == 60
    assert hit.token_ids == miss.token_ids
    wbm.reset_prefix_cache()
    (again,) = generate(engine, [shared + [11, 12, 13, 15]], params)
    assert again.timings.num_cached_tokens == 0
    (miss2,) = generate(make_engine(mixed, enable_prefix_caching=False, block_size=4), [shared + [11, 12, 13, 15]],
                        params)
    assert again.token_ids == miss2.token_ids


def test_preempted_equals_not(mistral, kind):
    ps = prompts(6, 20, 70, mistral.config.vocab_size, seed=6)
    params = SamplingParams(max_tokens=40, **GREEDY)
    ample = generate(make_engine(mistral, block_size=4), ps, params)
    # mistral: 16 blocks, yet 110-token contexts; qwen2: its global layer needs up to 28 blocks per sequence
    engine = make_engine(mistral, block_size=4, num_kv_blocks=16 if kind == "mistral" else 40,
                         max_num_batched_tokens=16)
    tight = generate(engine, ps, params)
    assert engine.stats().num_preemptions > 0
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
    assert engine.stats().spec.proposed_total > 0
    assert on == off


@pytest.mark.skipif(cpu_ops.load() is None, reason="no C compiler for the CPU kernels")
def test_cpu_layer_stack_equals_module_path(mistral_folder, kind):
    """int8 weights run through the C layer stack (kernels/cpu_stack.c, each layer's window passed to its
    attention): the same greedy tokens as the module path, with one KV group (mistral) and with two (qwen2: its
    window layers over their own pool and tables)."""
    from llmd.model import cpu_stack

    q8 = load_model(mistral_folder, dtype=torch.float32, device="cpu", quant="int8")
    ps = prompts(3, 40, 70, q8.config.vocab_size, seed=9)
    params = SamplingParams(max_tokens=30, **GREEDY)

    def run(use_stack: bool) -> list[list[int]]:
        engine = make_engine(q8, block_size=4, max_num_batched_tokens=16)
        assert isinstance(engine.runner.forward, cpu_stack.CompiledCpuForward)
        if not use_stack:
            engine.runner.forward = q8.model  # the modules, each layer's attention through the CPU backend
        tokens = [r.token_ids for r in generate(engine, ps, params)]
        if use_stack:  # the C code ran every step
            assert engine.runner.forward.stack.steps == engine.stats().steps_total > 0
        return tokens

    assert run(True) == run(False)


def test_random_workload_with_aborts_never_leaks(mistral, kind):
    """Arrivals, aborts (running, waiting, mid-prefill), preemption in a small pool and speculation: at idle every
    block of both KV groups is free or cached (the autouse no_leaked_blocks check)."""
    rng = random.Random(12)
    engine = make_engine(mistral, block_size=4, num_kv_blocks=14 if kind == "mistral" else 48,
                         max_num_batched_tokens=12, speculative_mode="ngram")
    live: list[str] = []
    for step in range(160):
        if step < 120 and rng.random() < 0.3:
            rid = f"r{step}"
            span = [rng.randrange(5, mistral.config.vocab_size) for _ in range(rng.randrange(3, 12))]
            engine.add_request(rid, span * rng.randrange(1, 6), SamplingParams(max_tokens=rng.randrange(1, 50),
                                                                               **GREEDY))
            live.append(rid)
        if live and rng.random() < 0.1:
            engine.abort(live.pop(rng.randrange(len(live))))
        for out in engine.step():
            if out.finished and out.request_id in live:
                live.remove(out.request_id)
    while engine.has_work():
        engine.step()
    assert engine.stats().num_preemptions > 0
