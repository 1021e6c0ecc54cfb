"""ModelManager in-process, on real tiny models with real engines (no HTTP): --max-loaded-models evicts the least
recently used idle model, busy models make a load wait (then 503 with Retry-After), pinned models are never
evicted (507 when they hold every place), two names of one file share one engine, `:latest` names a loaded model."""

from __future__ import annotations

import asyncio

import pytest

from llmd.config import Settings
from llmd.engine import SamplingParams
from llmd.server import models as models_mod
from llmd.server.daemon import load_served
from llmd.server.models import ModelManager
from llmd.server.validation import ApiError

MIB = 2**20
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
async def manager(tiny_models, request):
    places = getattr(request, "param", 2)
    paths = {"a": tiny_models["llama"], "b": tiny_models["qwen2"], "b2": tiny_models["qwen2"],
             "c": tiny_models["qwen3"]}
    tables = {k: {"path": str(v)} for k, v in paths.items()}
    tables["c"]["keep_alive"] = "-1"  # a configured model's own default keep-alive
    settings = Settings(model="a", models=tables, max_loaded_models=places,
                        memory_budget=1024 * MIB, kv_cache_bytes=4 * MIB, max_num_seqs=4)
    m = ModelManager(settings, load_served)
    await m.start()
    yield m
    await m.shutdown()


def names(m: ModelManager) -> set[str]:
    return {e.name for e in m.loaded()}


async def test_max_loaded_models_evicts_the_least_recently_used_idle_one(manager):
    b = await manager.acquire("b")
    manager.release(b)
    assert names(manager) == {"a", "b"}
    assert b.keep_alive == 300  # the daemon's default, 5m
    c = await manager.acquire("c")  # two places: a is pinned, b is idle -> b goes
    assert names(manager) == {"a", "c"} and c.engine is not None
    manager.release(c)
    assert c.keep_alive is None and c.expires_at() is None  # its [models.c] keep_alive = "-1": forever
    assert (await manager.acquire("a")).pinned
    # on the CPU every weight is host memory: none is counted apart from the budget (llmd.model.host_table)
    assert manager.describe(c)["host_weight_bytes"] == 0 and c.weight_bytes > 0


async def test_busy_models_make_a_load_wait_then_503(manager, monkeypatch):
    b = await manager.acquire("b")  # in use: it cannot be evicted
    monkeypatch.setattr(models_mod, "ROOM_WAIT_S", 0.3)
    with pytest.raises(ApiError) as err:
        await manager.acquire("c")
    assert err.value.status == 503 and err.value.headers["Retry-After"] and "busy" in err.value.message
    assert names(manager) == {"a", "b"}
    monkeypatch.setattr(models_mod, "ROOM_WAIT_S", 30.0)
    waiting = asyncio.create_task(manager.acquire("c"))
    await asyncio.sleep(0.2)
    assert not waiting.done()  # it waits for b to go idle ...
    manager.release(b)
    c = await asyncio.wait_for(waiting, 30)  # ... and then evicts it
    assert names(manager) == {"a", "c"}
    manager.release(c)


@pytest.mark.parametrize("manager", [1], indirect=True)
async def test_pinned_models_holding_every_place_give_507(manager):
    with pytest.raises(ApiError) as err:
        await manager.acquire("b")
    assert err.value.status == 507 and "pinned models hold" in err.value.message and "1 of 1" in err.value.message
    assert names(manager) == {"a"}


async def test_names_of_one_file_share_its_engine(manager):
    b = await manager.acquire("b")
    b2 = await manager.acquire("b2")
    assert b2 is b and manager.lookup("b2:latest") is b and manager.lookup("b:latest") is b
    manager.release(b)
    manager.release(b2)
    assert b.active == 0 and b.idle_since is not None
    s = manager.stats()
    assert {m["name"] for m in s["models"]} == {"a", "b"} and s["requests_running"] == 0


@pytest.mark.parametrize("table,words", [({"path": "x", "url": "http://h/v1"}, "exactly one of url"),
                                         ({}, "exactly one of url"), ({"url": "ftp://h"}, "http:// or https://"),
                                         ({"path": "x", "keep_alive": "soon"}, "keep_alive"),
                                         ({"path": "x", "colour": "red"}, "unknown key 'colour'"),
                                         ({"url": "http://h", "timeout": 0}, "timeout"),
                                         ({"path": 3}, "path has the wrong type")])
def test_configured_models_are_checked(table, words, tmp_path):
    from llmd.config import ConfigError, configured_models

    with pytest.raises(ConfigError, match=words) as err:
        configured_models({"m": table}, tmp_path / "config.toml")
    assert "[models.m]" in str(err.value)


async def test_two_cold_models_at_once_with_one_free_place(manager):
    """The second load waits while the first model serves its request, then evicts it. (acquire holds a model from
    before its load completes, so no later load or expiry can take it between its load and its request.)"""
    tasks = {asyncio.create_task(manager.acquire(n)) for n in ("b", "c")}  # either may resolve its name first
    done, pending = await asyncio.wait(tasks, timeout=60, return_when=asyncio.FIRST_COMPLETED)
    first = done.pop().result()
    assert first.engine is not None and first.status == "ready" and first.active == 1
    await asyncio.sleep(0.2)
    assert len(pending) == 1 and not next(iter(pending)).done()  # the other waits for room
    manager.release(first)
    second = await asyncio.wait_for(pending.pop(), 60)
    assert second.engine is not None and names(manager) == {"a", second.name} and first.engine is None
    manager.release(second)


@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
def test_a_pool_holds_one_sequence_at_the_full_context_unless_set(tiny_models, tmp_path, kind):
    """A share of the budget smaller than one request of max_model_len tokens would refuse such requests: the pool
    grows to hold one (an explicit --kv-cache-bytes is kept as given); a hybrid's too, whose recurrent states take
    part of the budget."""
    from tiny_models import write_tiny_model

    from llmd.server.daemon import build_engine
    from llmd.store.resolve import resolve

    files = resolve(str(tiny_models[kind] if kind in tiny_models else write_tiny_model(tmp_path / kind, kind)))
    prompt = [5] * 500
    _, engine = build_engine(Settings(max_model_len=512), files, kv_cache_bytes=2**40)
    share = 4 * (engine.runner.kv_cache_bytes // engine.runner.num_blocks)  # 4 blocks: 64 tokens
    _, engine = build_engine(Settings(max_model_len=512), files, kv_cache_bytes=share)
    engine.check_request(prompt, SamplingParams(max_tokens=8))  # 508 tokens fit
    _, small = build_engine(Settings(max_model_len=512, kv_cache_bytes=share), files, kv_cache_bytes=share)
    assert small.runner.kv_cache_bytes < engine.runner.kv_cache_bytes
    with pytest.raises(Exception, match="KV cache"):
        small.check_request(prompt, SamplingParams(max_tokens=8))
