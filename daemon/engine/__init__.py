"""The engine: paged KV cache, continuous batching with chunked prefill, prefix caching, sampling, async front."""

from .async_engine import AsyncEngine, RequestStream
from .config import EngineConfig
from .engine import Engine, GenerationResult, generate
from .types import FinishReason, Priority, RequestOutput, RequestTimings, SamplingParams, TokenLogprob

__all__ = [
    "AsyncEngine", "Engine", "EngineConfig", "FinishReason", "GenerationResult", "Priority", "RequestOutput",
    "RequestStream", "RequestTimings", "SamplingParams", "TokenLogprob", "generate",
]
