"""SSE and NDJSON writers with bounded buffers and a write-stall timeout.

Back-pressure: the transport's write buffer is kept small, and after every event we wait for it to drain below its
high-water mark. A client that stops reading makes that wait last; past `write_timeout` we raise WriteStalled, and the
caller aborts the request in the engine. Only this handler task waits: the engine thread and other streams never do.
"""

from __future__ import annotations

import asyncio
import json
import socket

from aiohttp import web

# Small buffers: a token event is a few hundred bytes, so these still hold many events, but a stalled reader is
# noticed after tens of kilobytes instead of megabytes.
TRANSPORT_HIGH_WATER = 8 * 1024
SOCKET_SNDBUF = 16 * 1024


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
        """Send one event: a dict as JSON, or a raw string (SSE `[DONE]`)."""
        payload = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
        if self.fmt == "ndjson":
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


async def pump(gen, es: EventStream, render, tail=None, on_error=None) -> web.StreamResponse:
    """Stream one Generation: `render(out) -> [events]` per engine output, `tail() -> [events]` after the last.

    A stall or a vanished client aborts the request in the engine (the Generation's exit does the rest)."""
    from .validation import ApiError

    try:
        await es.open()
        async for out in gen:
            for event in render(out):
                await es.send(event)
        for event in (tail() if tail else []):
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
            if on_error is not None:
                await es.send(on_error(exc))
            await es.close()
        except (WriteStalled, ClientGone):
            es.abort_connection()
    return es.response
