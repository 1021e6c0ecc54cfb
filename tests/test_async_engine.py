"""AsyncEngine: the engine thread behind an asyncio front, on the tiny Llama (real model, real engine)."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from llmd.engine import AsyncEngine, Engine, EngineConfig, FinishReason, SamplingParams, generate
from llmd.errors import EngineDead, InvalidRequest, QueueFull

GREEDY = dict(temperature=0.0, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tiny_llama_loaded):
    return tiny_llama_loaded


@pytest.fixture
async def aengine(tiny):
    engine = Engine(tiny, EngineConfig(num_kv_blocks=128, max_num_seqs=4, max_queue=8))
    front = AsyncEngine(engine)
    front.start()
    yield front
    await front.shutdown()
    engine.check_no_leaks()  # no leaked blocks after every test


async def collect(stream):
    tokens, text, outs = [], "", []
    async for out in stream:
        outs.append(out)
        tokens += out.new_token_ids
        text += out.text_delta
    return tokens, text, outs


async def test_streams_match_offline_generate(aengine, tiny):
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15], [20] * 30]
    params = SamplingParams(max_tokens=12, **GREEDY)
    streams = [aengine.submit(p, params) for p in prompts]
    results = await asyncio.gather(*(collect(s) for s in streams))
    reference = generate(Engine(tiny, EngineConfig(num_kv_blocks=64)), prompts, params)
    for (tokens, text, outs), ref in zip(results, reference):
        assert tokens == ref.token_ids and text == ref.text
        assert outs[-1].finished and outs[-1].finish_reason is FinishReason.LENGTH
        assert outs[-1].timings.num_generated_tokens == 12
        assert len(outs) > 1, "tokens arrive incrementally"


async def test_abort_ends_stream_within_a_step(aengine):
    stream = aengine.submit([5, 6, 7], SamplingParams(max_tokens=400, **GREEDY))
    first = await stream.__anext__()
    assert first.new_token_ids
    stream.abort()
    started = time.monotonic()
    tokens, _, outs = await collect(stream)
    assert outs[-1].finish_reason is FinishReason.ABORT
    assert time.monotonic() - started < 2.0
    assert len(tokens) < 399
    for _ in range(50):  # the engine thread frees the blocks right after emitting the abort
        if aengine.stats().kv.blocks_used == 0:
            break
        await asyncio.sleep(0.02)
    assert aengine.stats().kv.blocks_used == 0


async def test_invalid_and_overflow_refused_at_submit(aengine):
    with pytest.raises(InvalidRequest) as e:
        aengine.submit([5], SamplingParams(temperature=-1))
    assert e.value.field == "temperature"
    with pytest.raises(InvalidRequest, match="max_model_len|pool"):
        aengine.submit(list(range(5, 600)), SamplingParams(max_tokens=4))
    stream = aengine.submit([5], SamplingParams(max_tokens=2), request_id="dup")
    with pytest.raises(InvalidRequest, match="already"):
        aengine.submit([5], SamplingParams(max_tokens=2), request_id="dup")
    await collect(stream)
    streams, refused = [], 0
    for _ in range(30):  # 4 running places and a queue of 8: the engine thread cannot admit 30 at once
        try:
            streams.append(aengine.submit([5, 6], SamplingParams(max_tokens=3)))
        except QueueFull:
            refused += 1
    assert refused > 0 and len(streams) >= 4 + 8  # a burst fills the free running places before the queue
    await asyncio.gather(*(collect(s) for s in streams))


async def test_slow_reader_gets_everything_through_a_bounded_buffer(tiny):
    engine = Engine(tiny, EngineConfig(num_kv_blocks=64))
    front = AsyncEngine(engine, stream_buffer=2)
    front.start()
    try:
        stream = front.submit([5, 6, 7], SamplingParams(max_tokens=30, **GREEDY))
        while not stream.finished:
            await asyncio.sleep(0.05)  # read nothing until the request is over
        assert len(stream._buf) <= 2
        tokens, text, outs = await collect(stream)
        ref = generate(Engine(tiny, EngineConfig(num_kv_blocks=64)), [[5, 6, 7]], SamplingParams(max_tokens=30,
                                                                                                  **GREEDY))[0]
        assert tokens == ref.token_ids and text == ref.text and outs[-1].finished
    finally:
        await front.shutdown()
    engine.check_no_leaks()


async def test_a_full_stream_buffer_keeps_the_stop_reason(tiny):
    """With speculation on and a reader that lags, merged outputs keep the stop string that ended the request."""
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9]
    params = SamplingParams(max_tokens=40, **GREEDY)
    plain = generate(Engine(tiny, EngineConfig(num_kv_blocks=64)), [prompt], params)[0]
    stop_text = plain.text[len(plain.text) // 2:len(plain.text) // 2 + 2]
    params = SamplingParams(max_tokens=40, stop=[stop_text], **GREEDY)
    ref = generate(Engine(tiny, EngineConfig(num_kv_blocks=64)), [prompt], params)[0]
    assert ref.stop_reason == stop_text
    engine = Engine(tiny, EngineConfig(num_kv_blocks=64, speculative_mode="draft", draft_model=tiny))
    front = AsyncEngine(engine, stream_buffer=1)
    front.start()
    try:
        stream = front.submit(prompt, params)
        while not stream.finished:
            await asyncio.sleep(0.05)
        tokens, text, outs = await collect(stream)
        assert len(outs) == 1, "everything was merged into the one buffered output"
        assert (tokens, text, outs[-1].finish_reason, outs[-1].stop_reason) == (
            ref.token_ids, ref.text, FinishReason.STOP, stop_text)
        assert engine.stats().spec.accepted_total > 0
    finally:
        await front.shutdown()
    engine.check_no_leaks()


async def test_engine_failure_fails_requests_and_shows_in_stats(tiny):
    engine = Engine(tiny, EngineConfig(num_kv_blocks=64))
    front = AsyncEngine(engine)
    front.start()
    real_execute = engine.runner.execute
    calls = {"n": 0}

    def broken(scheduled):  # fault injection: the third forward raises
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated device fault")
        return real_execute(scheduled)

    try:
        streams = [front.submit([5 + i, 6, 7], SamplingParams(max_tokens=50, **GREEDY)) for i in range(3)]
        engine.runner.execute = broken  # after the submits: the engine thread may step between them
        results = await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams)), timeout=20)
        for _, _, outs in results:
            assert outs[-1].finished and "simulated device fault" in outs[-1].error
        stats = front.stats()
        assert stats.engine_alive is False and "simulated device fault" in (stats.engine_error or "")
        with pytest.raises(EngineDead):
            front.submit([5], SamplingParams(max_tokens=2))
    finally:
        await front.shutdown()
    engine.check_no_leaks()


async def test_shutdown_ends_open_streams(tiny):
    engine = Engine(tiny, EngineConfig(num_kv_blocks=64))
    front = AsyncEngine(engine)
    front.start()
    stream = front.submit([5, 6], SamplingParams(max_tokens=400, **GREEDY))
    await stream.__anext__()
    await front.shutdown()
    _, _, outs = await asyncio.wait_for(collect(stream), timeout=5)
    assert outs[-1].finished and outs[-1].finish_reason is FinishReason.ABORT
    engine.check_no_leaks()
