"""The engine: paged KV cache, continuous batching with chunked prefill, prefix caching, sampling, async front.

The names below are imported lazily (PEP 562), so a module that needs only the torch-free `engine.types` or
`engine.config` (the settings, the server's readers of stats, the model's vocabulary) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "AsyncEngine": "async_engine", "RequestStream": "async_engine", "EngineConfig": "config",
    "Engine": "engine", "GenerationResult": "engine", "generate": "engine",
    "EngineStats": "types", "FinishReason": "types", "Priority": "types", "RequestOutput": "types",
    "RequestTimings": "types", "SamplingParams": "types", "TokenLogprob": "types",
}

__all__ = [
    "AsyncEngine", "Engine", "EngineConfig", "EngineStats", "FinishReason", "GenerationResult", "Priority",
    "RequestOutput", "RequestStream", "RequestTimings", "SamplingParams", "TokenLogprob", "generate",
]

if TYPE_CHECKING:
    from .async_engine import AsyncEngine, RequestStream
    from .config import EngineConfig
    from .engine import Engine, GenerationResult, generate
    from .types import EngineStats, FinishReason, Priority, RequestOutput, RequestTimings, SamplingParams, TokenLogprob


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value
