"""Error shapes per dialect, the per-response timings object and the one logprob renderer."""

from __future__ import annotations

from aiohttp import web

from ..engine.types import RequestTimings

_OPENAI_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
    429: "rate_limit_error", 500: "server_error", 503: "service_unavailable",
}


def dialect_for_path(path: str) -> str:
    if path.startswith("/v1/"):
        return "openai"
    if path.startswith("/api/") or path == "/":
        return "ollama"
    return "llamacpp"


def error_response(dialect: str, status: int, message: str, *, param: str | None = None, kind: str | None = None,
                   headers: dict[str, str] | None = None) -> web.Response:
    if dialect == "openai":
        body = {"error": {"message": message, "type": kind if kind and kind != "invalid_request_error" and status < 500
                          else _OPENAI_TYPES.get(status, "invalid_request_error"),
                          "param": param, "code": kind if kind not in (None, "invalid_request_error") else None}}
    elif dialect == "ollama":
        body = {"error": message}
    else:  # llama.cpp server shape
        body = {"error": {"code": status, "message": message,
                          "type": _OPENAI_TYPES.get(status, "invalid_request_error")}}
    return web.json_response(body, status=status, headers=headers)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)


def timings_dict(t: RequestTimings | None) -> dict:
    """The contract's `timings` object carried by every completion response."""
    if t is None:
        return {}
    decode = t.decode_time
    tps = None
    if decode and t.num_generated_tokens > 1:
        tps = round((t.num_generated_tokens - 1) / decode, 3)
    return {
        "queue_ms": _ms(t.queue_time),
        "prefill_ms": _ms(t.prefill_time),
        "ttft_ms": _ms(t.ttft),
        "decode_ms": _ms(decode),
        "tpot_ms": _ms(t.tpot),
        "e2e_ms": _ms(t.e2e),
        "prompt_tokens": t.num_prompt_tokens,
        "cached_prompt_tokens": t.num_cached_tokens,
        "generated_tokens": t.num_generated_tokens,
        "tokens_per_second": tps,
        "spec_proposed": t.spec_proposed,
        "spec_accepted": t.spec_accepted,
    }


def timings_header(t: RequestTimings | None) -> str:
    """A Server-Timing header value, so that every response (also non-JSON ones) carries its stage timings."""
    d = timings_dict(t)
    parts = [f"{k[:-3]};dur={v}" for k, v in d.items() if k.endswith("_ms") and v is not None]
    return ", ".join(parts)


def logprob_items(tok, items, style: str, offset: int = 0):
    """Token logprobs in a dialect's shape. style: "chat" (OpenAI chat: content entries with bytes), "completion"
    (OpenAI completions: parallel lists with text offsets from `offset`), "llamacpp" (completion_probabilities)."""
    items = items or []

    def piece(token_id: int) -> str:
        return tok.decode([token_id], skip_special_tokens=False)

    if style == "chat":
        def entry(token_id: int, logprob: float) -> dict:
            p = piece(token_id)
            return {"token": p, "logprob": logprob, "bytes": list(p.encode("utf-8"))}

        return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]}
                            for lp in items]}
    if style == "completion":
        tokens, offsets = [piece(lp.token_id) for lp in items], []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in items],
                "top_logprobs": [{piece(i): v for i, v in lp.top} for lp in items], "text_offset": offsets}
    assert style == "llamacpp", style
    return [{"id": lp.token_id, "token": piece(lp.token_id), "logprob": lp.logprob,
             "top_logprobs": [{"id": i, "token": piece(i), "logprob": v} for i, v in lp.top]} for lp in items]
