"""The aiohttp application: middlewares (errors + request log, security), shared routes, and the three dialects."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from . import anthropic, embeddings, llamacpp, ollama, openai, responses_api
from .core import LEASES, STATE, ServerState, state_of
from .responses import dialect_for_path, error_response, timings_dict
from .security import SecurityPolicy, make_security_middleware
from .streaming import ERROR_KEY, send_events
from .validation import ApiError

log = logging.getLogger("llmd.server")

STATS_STREAM_INTERVAL_S = 1.0


MAX_LOGGED_ERROR_CHARS = 500


def _error_message(response: web.StreamResponse | None) -> str | None:
    """The message an error response told the client, from its body (every dialect's error shape, and the
    health check's status)."""
    if not isinstance(response, web.Response) or not isinstance(response.body, bytes):
        return None
    try:
        body = json.loads(response.body)
    except ValueError:
        return None
    error = body.get("error", body.get("status")) if isinstance(body, dict) else None
    if isinstance(error, dict):
        error = error.get("message")
    return error if isinstance(error, str) else None


def _log_line(request: web.Request, status: int, started: float, error: str | None = None) -> str:
    parts = [request.remote or "unix", request.method, request.path, str(status)]
    if error:  # why, as the client was told it: one line, bounded
        error = " ".join(error.split())
        parts.append(error if len(error) <= MAX_LOGGED_ERROR_CHARS else error[:MAX_LOGGED_ERROR_CHARS] + "...")
    parts.append(f"total={1000 * (time.monotonic() - started):.1f}ms")
    t = timings_dict(request.get("llmd_timings"))
    if t:
        parts.append(f"prompt={t['prompt_tokens']} cached={t['cached_prompt_tokens']} gen={t['generated_tokens']}")
        for key in ("queue_ms", "prefill_ms", "ttft_ms", "decode_ms", "tpot_ms", "e2e_ms"):
            if t[key] is not None:
                parts.append(f"{key[:-3]}={t[key]:.1f}ms")
    if request.get("llmd_finish"):
        parts.append(f"finish={request['llmd_finish']}")
    return " ".join(parts)


@web.middleware
async def errors_and_log(request: web.Request, handler):
    """Every failure becomes a 4xx/5xx in the dialect's error shape; one INFO line per request with stage timings,
    and for a 4xx/5xx (or an error sent inside a stream) the message the client got."""
    started = time.monotonic()
    dialect = dialect_for_path(request.path)
    status = 500
    response: web.StreamResponse | None = None
    try:
        try:
            response = await handler(request)
        except ApiError as exc:
            response = error_response(dialect, exc.status, exc.message, param=exc.param, kind=exc.kind,
                                      headers=exc.headers)
        except web.HTTPException as exc:  # routing: 404, 405; aiohttp's own 413
            if exc.status < 400:
                raise
            message = {404: f"no route {request.method} {request.path}",
                       405: f"method {request.method} is not allowed on {request.path}"}.get(exc.status, exc.reason)
            response = error_response(dialect, exc.status, message, headers={
                k: v for k, v in exc.headers.items() if k in ("Allow", "Retry-After")})
        except (asyncio.CancelledError, ConnectionError):
            status = 499
            request[ERROR_KEY] = "the client went away"
            raise
        except Exception:  # a bug: log the traceback on the server, answer one line
            log.exception("internal error on %s %s", request.method, request.path)
            response = error_response(dialect, 500, "internal server error (see the daemon log)")
        status = response.status
        if request.get("cors_headers") and not response.prepared:  # errors raised past the security middleware
            response.headers.update(request["cors_headers"])
        if "llmd_timings" in request and not response.prepared:
            from .responses import timings_header
            value = timings_header(request["llmd_timings"])
            if value:
                response.headers["Server-Timing"] = value
        return response
    finally:
        state = state_of(request)
        for served in request.pop(LEASES, []):  # the models this request used are idle again (keep-alive starts)
            if state.models is not None:
                state.models.release(served)
        state.metrics.count_response(status)
        error = request.get(ERROR_KEY) or (_error_message(response) if status >= 400 else None)
        log.info(_log_line(request, status, started, error))


async def health(request: web.Request) -> web.Response:
    state = state_of(request)
    if state.status == "ready":
        return web.json_response({"status": "ok", "model": state.model_name})
    body = {"status": state.status}
    if state.load_error:
        body["error"] = state.load_error
    return web.json_response(body, status=503, headers={"Retry-After": "2"})


async def metrics(request: web.Request) -> web.Response:
    state = state_of(request)
    if state.models is not None:
        text = state.metrics.render({e.name: e.engine.stats() for e in state.models.loaded()})
    else:
        engine: Any = state.engine
        text = state.metrics.render(engine.stats() if engine is not None else None, state.model_name or "loading")
    return web.Response(text=text,
                        content_type="text/plain", charset="utf-8", headers={"X-Content-Type-Options": "nosniff"})


async def llmd_stats(request: web.Request) -> web.StreamResponse:
    state = state_of(request)
    if request.query.get("stream") not in ("1", "true", "yes"):
        return web.json_response(state.stats())
    return await send_events(request, "sse", state.write_timeout, _stats_while_serving(state))


async def _stats_while_serving(state: ServerState) -> AsyncIterator[dict]:
    while state.status != "draining":
        yield state.stats()
        await asyncio.sleep(STATS_STREAM_INTERVAL_S)


def create_app(state: ServerState, policy: SecurityPolicy | None = None) -> web.Application:
    app = web.Application(middlewares=[errors_and_log, make_security_middleware(policy or SecurityPolicy())],
                          client_max_size=state.max_body_bytes + 1)
    app[STATE] = state
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/llmd/stats", llmd_stats)
    openai.setup_routes(app)
    ollama.setup_routes(app)
    llamacpp.setup_routes(app)
    anthropic.setup_routes(app)
    responses_api.setup_routes(app)
    embeddings.setup_routes(app)
    return app


def configure_logging(level: int = logging.INFO) -> None:
    """Logs to stderr (journald captures it under systemd), one line per record."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("llmd")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False


def dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
