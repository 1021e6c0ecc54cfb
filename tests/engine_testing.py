"""Shared by the engine test modules: engines built through `make_engine` are checked for leaked KV blocks after
every test (import `no_leaked_blocks` into a test module to switch the check on there)."""

from __future__ import annotations

import pytest

from llmd.engine import Engine, EngineConfig

_engines: list[Engine] = []


def make_engine(loaded, **kw) -> Engine:
    kw.setdefault("num_kv_blocks", 256)
    engine = Engine(loaded, EngineConfig(**kw))
    _engines.append(engine)
    return engine


@pytest.fixture(autouse=True)
def no_leaked_blocks():
    """After every test, every engine it built must be idle with each block free or evictable-cached (target pool
    and, with a draft model, the draft's pool too)."""
    _engines.clear()
    yield
    for engine in _engines:
        engine.check_no_leaks()
    _engines.clear()
