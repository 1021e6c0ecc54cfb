"""SSE and NDJSON writers with bounded buffers and a write-stall timeout, and the timing of a stream (`pump`).

Back-pressure: the transport's write buffer is kept small, and after every event we wait for it to drain below its
high-water mark. A client that stops reading makes that wait last; past `write_timeout` we raise WriteStalled, and the
caller aborts the request in the engine. Only this handler task waits: the engine thread and other streams never do.

A stream opens at once: the dialect's opening events (OpenAI's role chunk, Anthropic's message_start, ...) go out as
soon as the request is accepted, before its prefill. While no output comes (queued, in a long prefill), the prompt's
progress goes out where the dialect has a place for it, and after `keepalive_s` seconds without a write the
dialect's keep-alive (an SSE comment, Anthropic's ping, Ollama's empty chunk): clients with a stall watchdog and
proxies with an idle timeout see the stream alive. `keepalive_s` is a setting (`stream_keepalive`), so tests can
lower it.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from aiohttp import web

if TYPE_CHECKING:
    from .core import Generation, Renderer

# Small buffers: a token event is a few hundred bytes, so these still hold many events, but a stalled reader is
# noticed after tens of kilobytes instead of megabytes.
TRANSPORT_HIGH_WATER = 8 * 1024
SOCKET_SNDBUF = 16 * 1024
KEEPALIVE_S = 10.0  # the default of the stream_keepalive setting
PROGRESS_POLL_S = 0.25  # how often a quiet stream looks at its prompt's progress


class SseComment(str):
    """An SSE comment line (`: text`): every SSE client skips it."""


KEEP_ALIVE = SseComment("keep-alive")


class WriteStalled(Exception):
    """The client did not read for longer than the write timeout."""


class ClientGone(Exception):
    """The client closed the connection."""


ERROR_KEY = "llmd_error"  # request key: the message of an error sent inside a stream (app.py logs it)


class EventStream:
    """One streaming response: `sse` (OpenAI, llama.cpp, stats), `sse_named` (SSE whose events also carry their
    `type` as the event name: Anthropic Messages, OpenAI Responses) or `ndjson` (Ollama)."""

    def __init__(self, request: web.Request, fmt: str, write_timeout: float, headers: dict[str, str] | None = None):
        assert fmt in ("sse", "sse_named", "ndjson")
        self.request = request
        self.fmt = fmt
        self.write_timeout = write_timeout
        ctype = "application/x-ndjson" if fmt == "ndjson" else "text/event-stream"
        self.response = web.StreamResponse(status=200, headers={
            "Content-Type": ctype, "Cache-Control": "no-cache", "X-Accel-Buffering": "no",
            **request.get("cors_headers", {}), **(headers or {}),
        })

    async def open(self) -> None:
        transport = self.request.transport
        if transport is None or transport.is_closing():
            raise ClientGone()
        transport.set_write_buffer_limits(high=TRANSPORT_HIGH_WATER)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_SNDBUF)
            except OSError:
                pass
        await self._guard(self.response.prepare(self.request))

    async def send(self, obj) -> None:
        """Send one event: a dict as JSON, or a raw string (SSE `[DONE]`, or the KEEP_ALIVE comment)."""
        payload = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
        if isinstance(obj, SseComment):
            assert self.fmt != "ndjson", "NDJSON has no comments: a dialect sends an empty chunk instead"
            line = f": {payload}\n\n"
        elif self.fmt == "ndjson":
            line = payload + "\n"
        elif self.fmt == "sse_named" and isinstance(obj, dict):
            line = f"event: {obj['type']}\ndata: {payload}\n\n"
        else:
            line = f"data: {payload}\n\n"
        await self._guard(self._write_and_drain(line.encode("utf-8")))

    async def close(self) -> None:
        try:
            await self._guard(self.response.write_eof())
        except (WriteStalled, ClientGone):
            self.abort_connection()

    def abort_connection(self) -> None:
        transport = self.request.transport
        if transport is not None:
            transport.abort()  # drop the connection without flushing what the client never read

    async def _write_and_drain(self, data: bytes) -> None:
        await self.response.write(data)
        writer = self.response._payload_writer  # public API drains only every 64 KiB; we want every event
        if writer is not None:
            await writer.drain()

    async def _guard(self, coro) -> None:
        try:
            await asyncio.wait_for(coro, self.write_timeout)
        except asyncio.TimeoutError:
            raise WriteStalled() from None
        except (ConnectionError, RuntimeError) as exc:
            # ConnectionResetError / aiohttp's ClientConnectionResetError; RuntimeError when the transport is gone
            if isinstance(exc, RuntimeError) and "transport" not in str(exc).lower() and "closing" not in str(exc).lower():
                raise
            raise ClientGone() from None


class _Ticks:
    """Reads an async iterator with a deadline per wait: `next()` is its next item, None when `tick` seconds pass
    first (the read goes on, the next call waits for it again), or END after its last item."""

    END = object()

    def __init__(self, source, tick: float):
        self._it = source.__aiter__()
        self._tick = tick
        self._read: asyncio.Future | None = None

    async def next(self):
        if self._read is None:
            self._read = asyncio.ensure_future(self._it.__anext__())
        done, _ = await asyncio.wait({self._read}, timeout=self._tick)
        if not done:
            return None
        read, self._read = self._read, None
        try:
            return read.result()
        except StopAsyncIteration:
            return self.END

    def close(self) -> None:
        """Cancel a read in flight (the stream is left early)."""
        if self._read is not None:
            self._read.cancel()


async def send_events(request: web.Request, fmt: str, write_timeout: float,
                      events: AsyncIterator[dict]) -> web.StreamResponse:
    """A stream of events as they come (progress lines, periodic stats): a client that leaves or stalls ends it."""
    es = EventStream(request, fmt, write_timeout)
    try:
        await es.open()
        async for event in events:
            await es.send(event)
        await es.close()
    except WriteStalled:
        es.abort_connection()
    except ClientGone:
        pass
    return es.response


async def pump(gen: Generation, es: EventStream, renderer: Renderer, keepalive_s: float) -> web.StreamResponse:
    """Stream one Generation in a dialect's shapes (core.Renderer): its opening at once, the events of each engine
    output and its parsed text, the tail after the last; while no output comes, the prompt's progress (when it grew)
    and, after `keepalive_s` seconds without a write, the keep-alive.

    A stall or a vanished client aborts the request in the engine (the Generation's exit does the rest)."""
    from .validation import ApiError

    outputs = _Ticks(gen, min(keepalive_s, PROGRESS_POLL_S))
    try:
        await es.open()
        events, quiet_since, computed = renderer.opening(gen), time.monotonic(), 0
        while True:
            for event in events:
                await es.send(event)
            if events:
                quiet_since = time.monotonic()
            item = await outputs.next()
            if item is _Ticks.END:
                break
            if item is not None:
                events = renderer.events(gen, *item)
                continue
            p = gen.progress()
            events = []
            if p is not None and p.computed > computed:
                computed = p.computed
                events = renderer.progress(gen, p)
            if not events and time.monotonic() - quiet_since >= keepalive_s:
                events = renderer.keepalive(gen)
        for event in renderer.tail(gen):
            await es.send(event)
        await es.close()
    except WriteStalled:
        gen.abort("write_stall")
        es.abort_connection()
    except ClientGone:
        gen.abort("disconnect")
    except ApiError as exc:  # the engine failed mid-stream; the status line is already sent
        es.request[ERROR_KEY] = exc.message  # the request's log line says why
        try:
            await es.send(renderer.error(exc))
            await es.close()
        except (WriteStalled, ClientGone):
            es.abort_connection()
    finally:
        outputs.close()
    return es.response
