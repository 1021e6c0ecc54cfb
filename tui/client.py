"""An HTTP client of the llmd daemon: the only way the TUI talks to the engine.

It tries the Unix socket first (no port, file permissions guard it), then 127.0.0.1:8471. Streaming calls are async
iterators; leaving the `async for` early closes the HTTP response, which is how a generation is aborted on the daemon
(the server aborts a request whose client went away).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8471
# One SSE line never needs to be longer than this; a longer one means a broken or hostile peer.
MAX_LINE_BYTES = 1 << 20


class DaemonUnavailable(Exception):
    """No daemon answers, or the connection dropped in the middle of a response."""


class DaemonError(Exception):
    """The daemon answered with an error (bad request, queue full, engine dead...)."""

    def __init__(self, status: int, message: str):
        self.status = status
        super().__init__(f"{message} (HTTP {status})")


def default_socket_path() -> Path:
    from llmd.config import runtime_socket_path  # the daemon's own rule for where its socket lives

    return runtime_socket_path()


@dataclass
class Endpoint:
    """Where the daemon is: a Unix socket path or a host and port."""

    socket_path: Path | None = None
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT

    def describe(self) -> str:
        return f"unix:{self.socket_path}" if self.socket_path else f"http://{self.host}:{self.port}"


@dataclass
class ChatChunk:
    """One piece of a streamed chat answer. `timings` and `usage` come with the final chunk."""

    text: str = ""
    finish_reason: str | None = None
    timings: dict[str, Any] | None = None
    usage: dict[str, Any] | None = None
    model: str | None = None


@dataclass
class ModelEntry:
    """One model the daemon can serve, as /v1/models lists it: where it lives and whether it is loaded."""

    name: str
    source: str = ""  # bundled, pulled, hf-cache, ollama, config, remote...
    where: str = ""  # its file or folder, or a remote model's URL
    loaded: bool = False
    size: int = 0  # bytes; 0 when unknown


@dataclass
class ChatRequest:
    messages: list[dict[str, Any]]
    model: str | None = None
    temperature: float | None = None
    max_tokens: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"messages": self.messages, "stream": True, "stream_options": {"include_usage": True}}
        if self.model:
            body["model"] = self.model
        if self.temperature is not None:
            body["temperature"] = self.temperature
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        body.update(self.extra)
        return body


class DaemonClient:
    """Talks to one daemon. Candidates are tried in order until one answers `/health`."""

    def __init__(
        self,
        candidates: list[Endpoint] | None = None,
        api_key: str | None = None,
        connect_timeout: float = 2.0,
    ):
        if candidates is None:
            candidates = [Endpoint(socket_path=default_socket_path()), Endpoint()]
        self.candidates = candidates
        self.api_key = api_key
        self.connect_timeout = connect_timeout
        self.endpoint: Endpoint | None = None
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    def for_url(cls, url: str, api_key: str | None = None) -> DaemonClient:
        """A client for an explicit http://host:port base URL."""
        rest = url.split("://", 1)[-1].rstrip("/")
        host, _, port = rest.partition(":")
        return cls([Endpoint(host=host or DEFAULT_HOST, port=int(port or DEFAULT_PORT))], api_key=api_key)

    def describe(self) -> str:
        if self.endpoint:
            return self.endpoint.describe()
        return " or ".join(c.describe() for c in self.candidates)

    # --- connection -------------------------------------------------------------------------------------------

    def _make_session(self, endpoint: Endpoint) -> aiohttp.ClientSession:
        if endpoint.socket_path:
            connector: aiohttp.BaseConnector = aiohttp.UnixConnector(path=str(endpoint.socket_path))
            base = "http://localhost"
        else:
            connector = aiohttp.TCPConnector()
            base = f"http://{endpoint.host}:{endpoint.port}"
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        # No total timeout: answers stream for as long as they take. sock_connect bounds a dead endpoint.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout)
        return aiohttp.ClientSession(base_url=base, connector=connector, headers=headers, timeout=timeout)

    async def _ensure_session(self) -> aiohttp.ClientSession:
        if self._session is not None and not self._session.closed:
            return self._session
        last_error: Exception | None = None
        for endpoint in self.candidates:
            if endpoint.socket_path and not endpoint.socket_path.exists():
                continue
            session = self._make_session(endpoint)
            try:
                async with session.get("/health", timeout=aiohttp.ClientTimeout(total=self.connect_timeout)) as resp:
                    await resp.read()
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                last_error = exc
                await session.close()
                continue
            self.endpoint, self._session = endpoint, session
            return session
        detail = f": {last_error}" if last_error else ""
        raise DaemonUnavailable(f"no llmd daemon answers at {self.describe()}{detail}")

    async def reset(self) -> None:
        """Forget the current connection; the next call probes the candidates again."""
        if self._session is not None:
            await self._session.close()
        self._session, self.endpoint = None, None

    async def close(self) -> None:
        await self.reset()

    async def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        session = await self._ensure_session()
        try:
            async with session.request(method, path, **kwargs) as resp:
                payload = await _read_json(resp)
                return resp.status, payload
        except (aiohttp.ClientConnectionError, OSError) as exc:
            where = self.describe()
            await self.reset()
            raise DaemonUnavailable(f"lost the connection to the daemon at {where}") from exc

    # --- plain calls ------------------------------------------------------------------------------------------

    async def health(self) -> dict[str, Any]:
        """{"status": "ok", "model": ...} or {"status": "loading", ...}; raises DaemonUnavailable if none answers."""
        _status, payload = await self._request("GET", "/health")
        return payload if isinstance(payload, dict) else {"status": "unknown"}

    async def models(self) -> list[str]:
        return [m.name for m in await self.model_entries()]

    async def model_entries(self) -> list[ModelEntry]:
        """Every servable model, the loaded ones first (llmd's `llmd` extension of /v1/models; plain servers give
        names only)."""
        status, payload = await self._request("GET", "/v1/models")
        _raise_for(status, payload)
        out = []
        for m in payload.get("data", []) if isinstance(payload, dict) else []:
            if not isinstance(m, dict) or not isinstance(m.get("id"), str):
                continue
            ext = m.get("llmd")
            if not isinstance(ext, dict):
                ext = {}
            out.append(ModelEntry(m["id"], str(ext.get("source") or ""), str(ext.get("where") or ""),
                                  bool(ext.get("loaded")), int(ext.get("size") or 0)))
        return out

    async def load_model(self, name: str) -> None:
        """Load a model now (Ollama's empty-prompt request); returns once it is ready. DaemonError carries the
        daemon's reason when it cannot (not found, too big for the memory budget, a broken file)."""
        status, payload = await self._request("POST", "/api/generate", json={"model": name, "stream": False})
        _raise_for(status, payload)

    async def stats(self) -> dict[str, Any]:
        status, payload = await self._request("GET", "/v1/llmd/stats")
        _raise_for(status, payload)
        return payload

    # --- streams ----------------------------------------------------------------------------------------------

    async def _sse(self, method: str, path: str, **kwargs: Any) -> AsyncIterator[dict[str, Any]]:
        """Yield each `data:` JSON object of an SSE response; stops at `[DONE]`. Closing the generator closes the
        response, which tells the daemon to abort the request."""
        session = await self._ensure_session()
        try:
            async with session.request(method, path, **kwargs) as resp:
                if resp.status != 200:
                    _raise_for(resp.status, await _read_json(resp))
                while True:
                    line = await resp.content.readline()
                    if not line:
                        break
                    if len(line) > MAX_LINE_BYTES:
                        raise DaemonError(resp.status, "the daemon sent an oversized event")
                    text = line.decode("utf-8", errors="replace").strip()
                    if not text.startswith("data:"):
                        continue  # comments, keep-alives, `event:` lines
                    data = text[5:].strip()
                    if data == "[DONE]":
                        break
                    try:
                        event = json.loads(data)
                    except json.JSONDecodeError:
                        continue
                    if isinstance(event, dict) and "error" in event and "choices" not in event:
                        raise DaemonError(resp.status, _error_message(event))
                    yield event
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError) as exc:
            where = self.describe()
            await self.reset()
            raise DaemonUnavailable(f"the daemon at {where} closed the connection in the middle of the answer") from exc
        except (aiohttp.ClientConnectionError, OSError) as exc:
            where = self.describe()
            await self.reset()
            raise DaemonUnavailable(f"lost the connection to the daemon at {where}") from exc

    async def chat_stream(self, request: ChatRequest) -> AsyncIterator[ChatChunk]:
        """Stream an OpenAI chat completion as ChatChunks."""
        finished = False
        async for event in self._sse("POST", "/v1/chat/completions", json=request.body()):
            chunk = ChatChunk(model=event.get("model"), timings=event.get("timings"), usage=event.get("usage"))
            for choice in event.get("choices") or []:
                delta = choice.get("delta") or {}
                chunk.text += delta.get("content") or ""
                chunk.finish_reason = choice.get("finish_reason") or chunk.finish_reason
            finished = finished or chunk.finish_reason is not None
            yield chunk
        if not finished:
            # A clean end of stream without a finish_reason means the daemon went away mid-answer.
            raise DaemonUnavailable(f"the daemon at {self.describe()} ended the stream in the middle of the answer")

    async def stats_stream(self) -> AsyncIterator[dict[str, Any]]:
        """The daemon's stats, pushed once a second."""
        async for event in self._sse("GET", "/v1/llmd/stats", params={"stream": "1"}):
            yield event


async def _read_json(resp: aiohttp.ClientResponse) -> Any:
    body = await resp.read()
    try:
        return json.loads(body) if body else {}
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {"error": {"message": body[:200].decode("utf-8", errors="replace")}}


def _error_message(payload: Any) -> str:
    if isinstance(payload, dict):
        err = payload.get("error", payload)
        if isinstance(err, dict):
            return str(err.get("message") or err)
        return str(err)
    return str(payload)


def _raise_for(status: int, payload: Any) -> None:
    if status >= 400:
        raise DaemonError(status, _error_message(payload))
