"""A transparent HTTP proxy that records every exchange, for the real-client tests (tests/test_real_clients.py).

A real agent is pointed at the proxy, the proxy at a real `llmd serve`: each request goes upstream unchanged (only
`Host` and the hop-by-hop headers are the proxy's own, and no compression is asked for, so bodies are recorded as
sent), each response comes back chunk by chunk as it is produced (streams stay streams). Each exchange is kept: the
request's method, path, the headers that steer a dialect, the JSON body, the status, and the response body (errors
whole; successes up to a cap). That is how a test can say which fields an agent sent and what llmd answered.
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
              "transfer-encoding", "upgrade", "host", "content-length", "accept-encoding"}
KEPT_HEADERS = ("user-agent", "anthropic-version", "anthropic-beta", "openai-beta", "content-type", "accept")
BODY_CAP = 1 << 20


@dataclass
class Exchange:
    method: str
    path: str
    headers: dict[str, str]
    body: Any  # the JSON body, else the text, else None
    status: int = 0
    response: str = ""  # up to BODY_CAP characters
    error: str = ""  # the proxy's own failure to reach upstream

    def summary(self) -> str:
        line = f"{self.method} {self.path} -> {self.status or ''}"
        if self.status >= 400:
            line += f" {self.response[:600]}"
        return line + (f" ({self.error})" if self.error else "")


@dataclass
class RecordingProxy:
    upstream: str
    exchanges: list[Exchange] = field(default_factory=list)
    port: int = 0
    _loop: asyncio.AbstractEventLoop | None = None
    _runner: web.AppRunner | None = None
    _thread: threading.Thread | None = None
    _session: aiohttp.ClientSession | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> RecordingProxy:
        ready = threading.Event()
        self._loop = asyncio.new_event_loop()

        def run() -> None:
            assert self._loop is not None
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self._serve())
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="recording-proxy", daemon=True)
        self._thread.start()
        assert ready.wait(30), "the recording proxy did not start"
        return self

    def stop(self) -> None:
        if self._loop is None:
            return
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(30)
        self._loop.close()

    def mark(self) -> int:
        """The number of exchanges so far: `since(mark)` is what came after."""
        return len(self.exchanges)

    def since(self, mark: int) -> list[Exchange]:
        return list(self.exchanges[mark:])

    async def _serve(self) -> None:
        session = self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=30), auto_decompress=False)
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        app.on_cleanup.append(lambda _app: session.close())
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()  # port 0: any free port
        self.port = self._runner.addresses[0][1]

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body: Any = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode(errors="replace")
        ex = Exchange(request.method, request.path_qs,
                      {k: v for k, v in request.headers.items() if k.lower() in KEPT_HEADERS}, body)
        self.exchanges.append(ex)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        assert self._session is not None
        try:
            async with self._session.request(request.method, self.upstream + request.path_qs, headers=headers,
                                             data=raw or None) as up:
                ex.status = up.status
                response = web.StreamResponse(status=up.status, reason=up.reason, headers={
                    k: v for k, v in up.headers.items() if k.lower() not in HOP_BY_HOP})
                await response.prepare(request)
                seen = bytearray()
                try:
                    async for chunk in up.content.iter_any():
                        if len(seen) < BODY_CAP:
                            seen += chunk[:BODY_CAP - len(seen)]
                        await response.write(chunk)
                    await response.write_eof()
                except ConnectionResetError:  # the client hung up (some do once they have the last event)
                    ex.error = "the client hung up"
                finally:
                    ex.response = seen.decode(errors="replace")
                return response
        except aiohttp.ClientError as exc:
            ex.error = f"upstream: {exc!r}"
            if ex.status == 0:
                return web.Response(status=502, text=ex.error)
            raise
