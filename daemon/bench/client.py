"""A streaming client for OpenAI-compatible endpoints that times every request.

Client-side times start when the request is actually sent (so a load generator's own waiting never counts as
the server's queue). When the server is llmd, the final chunk carries a `timings` object with the server's own
stages (queue, prefill, decode); the difference between client and server end-to-end time is network + HTTP overhead.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp
from yarl import URL

from ..errors import LlmdError
from .workloads import BenchRequest

API_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
MAX_ERROR_BODY = 300  # characters of an error body worth showing


class BenchError(LlmdError):
    """A problem the user must fix (bad URL, unreachable server, no model): one clear line."""


@dataclass
class RequestResult:
    """What one request did, as seen by the client (seconds) and, when reported, by the server (`timings`, ms)."""

    index: int
    kind: str
    ok: bool = False
    error: str | None = None
    status: int | None = None
    sent_at: float = 0.0          # perf_counter when the request went out
    ttft_s: float | None = None
    e2e_s: float | None = None
    itls_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int = 0
    cached_tokens: int | None = None
    finish_reason: str | None = None
    timings: dict | None = None   # the server's own stage timings (llmd), ms

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        if self.ttft_s is None or self.e2e_s is None or self.completion_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)

    def to_dict(self) -> dict:
        return {
            "index": self.index, "kind": self.kind, "ok": self.ok, "error": self.error, "status": self.status,
            "ttft_ms": _ms(self.ttft_s), "tpot_ms": _ms(self.tpot_s), "e2e_ms": _ms(self.e2e_s),
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens, "finish_reason": self.finish_reason, "timings": self.timings,
        }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)


def normalize_base_url(url: str) -> URL:
    """Accept `host:port`, `http://host:port` or an OpenAI base URL ending in /v1; return the server root."""
    text = url.strip()
    if not text:
        raise BenchError("the URL is empty")
    if "://" not in text:
        text = "http://" + text
    try:
        parsed = URL(text)
    except (ValueError, TypeError) as exc:
        raise BenchError(f"bad URL {url!r}: {exc}") from None
    if parsed.scheme not in ("http", "https"):
        raise BenchError(f"bad URL {url!r}: the scheme must be http or https")
    if not parsed.host:
        raise BenchError(f"bad URL {url!r}: no host")
    try:
        parsed.port  # noqa: B018 - validates the port
    except ValueError:
        raise BenchError(f"bad URL {url!r}: bad port") from None
    path = parsed.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[:-3]
    return parsed.with_path(path or "/").with_query(None).with_fragment(None)


def describe_connection_error(base: URL, exc: BaseException) -> str:
    base = str(base).rstrip("/")
    if isinstance(exc, aiohttp.ClientConnectorError):
        err = exc.os_error
        why = "connection refused" if isinstance(err, ConnectionRefusedError) else (err.strerror or str(err))
        return f"cannot reach {base}: {why} (is the server running? `llmd serve` starts one)"
    if isinstance(exc, asyncio.TimeoutError):
        return f"{base} did not finish the response in time (raise --timeout for a slow server)"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return f"{base} closed the connection"
    if isinstance(exc, aiohttp.ClientPayloadError):
        return f"{base} broke off the response: {exc}"
    return f"{base}: {type(exc).__name__}: {exc}"


class BenchClient:
    """One aiohttp session against one endpoint. Use as `async with BenchClient(url) as client:`."""

    def __init__(self, url: str, *, api: str = "chat", model: str | None = None, api_key: str | None = None,
                 timeout_s: float = 300.0, max_connections: int = 1024, temperature: float = 0.0):
        if api not in API_PATHS:
            raise BenchError(f"unknown API {api!r}: choose chat or completions")
        self.base = normalize_base_url(url)
        self.api = api
        self.model = model
        self.temperature = temperature
        self.timeout_s = timeout_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self.is_llmd = False

    async def __aenter__(self) -> "BenchClient":
        connector = aiohttp.TCPConnector(limit=self._max_connections)
        self._session = aiohttp.ClientSession(
            connector=connector, headers=self._headers,
            timeout=aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=10),
        )
        return self

    async def __aexit__(self, *exc) -> None:
        if self._session is not None:
            await self._session.close()

    def _url(self, path: str) -> URL:
        return self.base.with_path(self.base.path.rstrip("/") + path)

    async def probe(self) -> None:
        """Check the server answers and pick the model; raise BenchError with the reason if not."""
        assert self._session is not None
        try:
            async with self._session.get(self._url("/v1/models"), timeout=aiohttp.ClientTimeout(total=10)) as resp:
                body = await resp.text()
                if resp.status in (401, 403):
                    raise BenchError(f"{self.base} refused the request ({resp.status}): give the key with --api-key")
                if resp.status == 200 and self.model is None:
                    try:
                        models = [m["id"] for m in json.loads(body).get("data", []) if "id" in m]
                    except (ValueError, TypeError, AttributeError, KeyError):
                        models = []
                    if models:
                        self.model = models[0]
        except aiohttp.ClientError as exc:
            raise BenchError(describe_connection_error(self.base, exc)) from None
        except asyncio.TimeoutError as exc:
            raise BenchError(describe_connection_error(self.base, exc)) from None
        if self.model is None:
            raise BenchError(f"{self.base} lists no model at /v1/models: name one with --model")
        self.is_llmd = await self.llmd_stats() is not None

    async def llmd_stats(self) -> dict | None:
        """llmd's engine counters (GET /v1/llmd/stats), or None when the server is not llmd."""
        assert self._session is not None
        try:
            async with self._session.get(self._url("/v1/llmd/stats"), timeout=aiohttp.ClientTimeout(total=10)) as resp:
                if resp.status != 200:
                    return None
                data = await resp.json(content_type=None)
                return data if isinstance(data, dict) else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return None

    def _body(self, req: BenchRequest) -> dict:
        body = {
            "model": self.model, "max_tokens": req.max_tokens, "temperature": self.temperature, "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.api == "chat":
            body["messages"] = req.chat_messages()
        else:
            body["prompt"] = req.completion_prompt()
        return body

    async def send(self, index: int, req: BenchRequest) -> RequestResult:
        """Send one streaming request; never raises for server or network trouble (it is recorded instead)."""
        assert self._session is not None
        result = RequestResult(index=index, kind=req.kind)
        chunk_times: list[float] = []
        result.sent_at = start = time.perf_counter()
        try:
            async with self._session.post(self._url(API_PATHS[self.api]), json=self._body(req)) as resp:
                result.status = resp.status
                if resp.status != 200:
                    text = (await resp.text())[:MAX_ERROR_BODY]
                    result.error = f"HTTP {resp.status}: {_error_message(text)}"
                    return result
                done = await self._read_stream(resp, result, chunk_times)
            end = time.perf_counter()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            result.error = describe_connection_error(self.base, exc)
            return result
        if result.error is None and not done and result.finish_reason is None:
            result.error = "the stream ended before the response was finished"
        if result.timings:
            t = result.timings
            if result.prompt_tokens is None:
                result.prompt_tokens = t.get("prompt_tokens")
            if not result.completion_tokens and t.get("generated_tokens"):
                result.completion_tokens = t["generated_tokens"]
            if result.cached_tokens is None:
                result.cached_tokens = t.get("cached_prompt_tokens")
        if chunk_times:
            result.ttft_s = chunk_times[0] - start
            result.itls_s = [b - a for a, b in zip(chunk_times, chunk_times[1:])]
        result.e2e_s = end - start
        if not result.completion_tokens:
            result.completion_tokens = len(chunk_times)  # one chunk per token is the common case
        result.ok = result.error is None
        return result

    async def _read_stream(self, resp: aiohttp.ClientResponse, result: RequestResult, chunk_times: list[float]) -> bool:
        """Parse the SSE stream; returns True once `data: [DONE]` was seen."""
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                return True
            try:
                event = json.loads(payload)
            except ValueError:
                result.error = "the server sent a malformed stream event"
                return False
            if not isinstance(event, dict):
                continue
            if "error" in event:
                err = event["error"]
                result.error = "error mid-stream: " + (err.get("message", str(err)) if isinstance(err, dict) else str(err))
                return False
            for choice in event.get("choices") or []:
                text = (choice.get("delta") or {}).get("content") if self.api == "chat" else choice.get("text")
                if text:
                    chunk_times.append(time.perf_counter())
                if choice.get("finish_reason"):
                    result.finish_reason = choice["finish_reason"]
            if isinstance(event.get("timings"), dict):
                result.timings = event["timings"]
            usage = event.get("usage")
            if isinstance(usage, dict):
                result.prompt_tokens = usage.get("prompt_tokens", result.prompt_tokens)
                result.completion_tokens = usage.get("completion_tokens") or result.completion_tokens
                details = usage.get("prompt_tokens_details")
                if isinstance(details, dict) and details.get("cached_tokens") is not None:
                    result.cached_tokens = details["cached_tokens"]
        return False


def _error_message(body: str) -> str:
    """The `error.message` of an OpenAI-style error body, else the body itself."""
    try:
        data = json.loads(body)
        err = data.get("error") if isinstance(data, dict) else None
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
    except ValueError:
        pass
    return body.strip() or "(empty body)"
