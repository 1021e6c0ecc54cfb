"""A small aiohttp server that speaks llmd's HTTP contract, for TUI tests that must force errors, slowness or
disconnects. It runs in its own thread (so sync snapshot tests and async Pilot tests can both use it) or, via
`python tests/tui_fake_daemon.py`, as its own process (for the launcher test).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

ANSWER = (
    "Here is a function:\n\n```python\ndef add(a, b):\n    return a + b\n```\n\nIt **adds** two numbers."
)


def engine_stats(**overrides) -> dict:
    """One model's engine stats as /v1/llmd/stats serves them (the schema: llmd/tui/top_app.py)."""
    stats = {
        "requests_running": 2, "requests_waiting": 1, "num_preemptions": 4, "prompt_tokens_total": 5000,
        "generation_tokens_total": 2500, "requests_finished_total": 17, "steps_total": 900, "last_batch_size": 3,
        "last_step_tokens": 3, "tokens_per_second": 42.5, "engine_alive": True, "engine_error": None,
        "remote_url": None, "spec": None,
        "kv": {"dtype": "fp16", "block_size": 16, "bytes_per_token": 23040, "cache_bytes": 100 * 16 * 23040,
               "blocks_total": 100, "blocks_used": 40, "blocks_cached": 25, "blocks_free": 35,
               "seqs_8k_by_dtype": {"fp32": 0, "fp16": 1, "bf16": 1, "int8": 2}, "prefix_queries_tokens": 1000,
               "prefix_hits_tokens": 620, "prefix_hit_rate": 0.62, "prefix_evictions": 3},
        "latency": {
            "queue_ms": {"p50": 5.0, "p90": 9.0, "p99": 12.0},
            "prefill_ms": {"p50": 40.0, "p90": 60.0, "p99": 80.0},
            "ttft_ms": {"p50": 45.0, "p90": 70.0, "p99": 90.0},
            "decode_ms": {"p50": 300.0, "p90": 500.0, "p99": 700.0},
            "tpot_ms": {"p50": 20.0, "p90": 25.0, "p99": 30.0},
            "e2e_ms": {"p50": 350.0, "p90": 560.0, "p99": 800.0},
        },
    }
    stats.update(overrides)
    return stats


def fixed_stats(second: dict | None = None, **overrides) -> dict:
    """The daemon's stats with fake-model loaded (its engine stats changed by `overrides`) and, given `second`, a
    second model, "other-model", with those engine stats."""
    first = engine_stats(**overrides)
    models = [{"name": "fake-model", "source": "hf", "pinned": True, "size": 270 * 2**20, "stats": first}]
    if second is not None:
        models.append({"name": "other-model", "source": "ollama", "pinned": False, "size": 90 * 2**20,
                       "stats": second})
    return {**first, "model": "fake-model", "uptime_s": 12.0, "status": "ready", "models": models,
            "requests_running": sum(m["stats"]["requests_running"] for m in models),
            "requests_waiting": sum(m["stats"]["requests_waiting"] for m in models)}


@dataclass
class Behaviour:
    """What the fake daemon does; tests change these fields while it runs."""

    answer: str = ANSWER
    chunk_chars: int = 6
    delay_s: float = 0.0          # between chunks
    die_after_chunks: int | None = None  # drop the connection after this many chunks, without a finish
    error_status: int | None = None  # answer chat with this HTTP error
    loading_until: float = 0.0    # /health says "loading" until this time.time()
    models: list[str] = field(default_factory=lambda: ["fake-model", "other-model"])
    loaded: set[str] = field(default_factory=lambda: {"fake-model"})  # /v1/models marks these; /api/generate adds
    load_errors: dict[str, str] = field(default_factory=dict)  # model -> the daemon's reason it cannot load
    load_gate: threading.Event | None = None  # a load answers only once this is set (a test watches it loading)
    spec: bool = False
    stats_interval_s: float = 0.2


class FakeDaemon:
    def __init__(self, behaviour: Behaviour | None = None, socket_path: Path | None = None, port: int | None = None):
        self.behaviour = behaviour or Behaviour()
        self.socket_path = socket_path
        self.port = port or (free_port() if socket_path is None else None)
        self.requests: list[dict] = []
        self.aborted = threading.Event()
        self.finished_requests = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._ready = threading.Event()

    # --- app ----------------------------------------------------------------------------------------------------

    def make_app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/llmd/stats", self.stats)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/api/generate", self.load)
        return app

    async def health(self, request: web.Request) -> web.Response:
        if time.time() < self.behaviour.loading_until:
            return web.json_response({"status": "loading"}, status=503)
        return web.json_response({"status": "ok", "model": "fake-model"})

    async def models(self, request: web.Request) -> web.Response:
        b = self.behaviour
        data = [{"id": m, "object": "model", "llmd": {"source": "config", "where": f"/models/{m}.gguf",
                                                      "loaded": m in b.loaded, "size": 100 << 20}}
                for m in sorted(b.models, key=lambda m: m not in b.loaded)]
        return web.json_response({"object": "list", "data": data})

    async def load(self, request: web.Request) -> web.Response:
        """Ollama's load request (an empty prompt), as llmd answers it."""
        name = (await request.json()).get("model")
        b = self.behaviour
        while b.load_gate is not None and not b.load_gate.is_set():
            await asyncio.sleep(0.01)
        if name in b.load_errors:
            return web.json_response({"error": f"model {name!r} failed to load: {b.load_errors[name]}"}, status=503)
        if name not in b.models:
            return web.json_response({"error": f"model {name!r} not found"}, status=404)
        b.loaded.add(name)
        return web.json_response({"model": name, "response": "", "done": True, "done_reason": "load"})

    async def stats(self, request: web.Request) -> web.StreamResponse:
        if request.query.get("stream") != "1":
            return web.json_response(fixed_stats())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        tick = 0
        while True:
            tick += 1
            stats = fixed_stats(
                tokens_per_second=40.0 + (tick % 5), requests_running=1 + tick % 3, steps_total=900 + tick,
            )
            await resp.write(_sse(stats))
            await asyncio.sleep(self.behaviour.stats_interval_s)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        b = self.behaviour
        if b.error_status:
            return web.json_response({"error": {"message": "the waiting queue is full", "type": "queue_full"}},
                                     status=b.error_status)
        model = body.get("model") or "fake-model"
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        pieces = [b.answer[i:i + b.chunk_chars] for i in range(0, len(b.answer), b.chunk_chars)]
        try:
            for n, piece in enumerate(pieces):
                if b.die_after_chunks is not None and n >= b.die_after_chunks:
                    request.transport.close()  # a daemon dying mid-answer: no finish, no [DONE]
                    return resp
                await resp.write(_sse(_chunk(model, {"content": piece}, None)))
                if b.delay_s:
                    await asyncio.sleep(b.delay_s)
            timings = {
                "queue_ms": 1.5, "prefill_ms": 20.0, "ttft_ms": 21.5, "decode_ms": 300.0, "tpot_ms": 12.5,
                "e2e_ms": 321.5, "prompt_tokens": 40, "cached_prompt_tokens": 32, "generated_tokens": len(pieces),
                "tokens_per_second": 80.0, "spec_proposed": 20 if b.spec else 0, "spec_accepted": 15 if b.spec else 0,
            }
            final = _chunk(model, {}, "stop")
            final["timings"] = timings
            await resp.write(_sse(final))
            usage = {"prompt_tokens": 40, "completion_tokens": len(pieces), "total_tokens": 40 + len(pieces),
                     "prompt_tokens_details": {"cached_tokens": 32}}
            await resp.write(_sse({"choices": [], "usage": usage, "model": model}))
            await resp.write(b"data: [DONE]\n\n")
            self.finished_requests += 1
        except (ConnectionResetError, asyncio.CancelledError):
            # The client went away: this is what an abort looks like to the daemon.
            self.aborted.set()
            raise
        return resp

    # --- lifecycle ----------------------------------------------------------------------------------------------

    async def _start(self) -> None:
        self._runner = web.AppRunner(self.make_app(), handler_cancellation=True)
        await self._runner.setup()
        if self.socket_path:
            site: web.BaseSite = web.UnixSite(self._runner, str(self.socket_path))
        else:
            site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()

    def start(self) -> FakeDaemon:
        def run() -> None:
            self._loop = asyncio.new_event_loop()
            self._loop.run_until_complete(self._start())
            self._ready.set()
            self._loop.run_forever()
            self._loop.run_until_complete(self._runner.cleanup())
            self._loop.close()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        assert self._ready.wait(10), "fake daemon did not start"
        return self

    def stop(self) -> None:
        if self._loop and self._thread:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)


def _chunk(model: str, delta: dict, finish: str | None) -> dict:
    return {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def _sse(obj: dict) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--loading-s", type=float, default=0.0)
    args = parser.parse_args()
    daemon = FakeDaemon(Behaviour(loading_until=time.time() + args.loading_s), port=args.port)

    async def main() -> None:
        await daemon._start()
        await asyncio.Event().wait()

    asyncio.run(main())
