"""OpenAI dialect: /v1/chat/completions, /v1/completions (with `suffix` for fill-in-the-middle), /v1/models."""

from __future__ import annotations

import time
import uuid

from aiohttp import web

from ..engine.types import SamplingParams
from .core import Generation, ServerState, output_reason, state_of
from .responses import timings_dict
from .streaming import EventStream, pump
from .validation import (LOGPROBS_TOP, MAX_TOKENS, MIN_P, PENALTY, REPEAT_PENALTY, SEED, STOP, TEXT, TOP_K, TOP_P,
                         ApiError, Field, check_fields, parse_messages, read_json, require)

DEFAULT_MAX_TOKENS = 2048  # when the client sends none; also capped by the context left

COMMON = {
    "model": Field("str", max_len=512),
    "stream": Field("bool"),
    "stream_options": Field("dict"),
    "temperature": Field("number", 0, 2),
    "top_p": TOP_P,
    "max_tokens": MAX_TOKENS,
    "stop": STOP,
    "seed": SEED,
    "presence_penalty": PENALTY,
    "frequency_penalty": PENALTY,
    "n": Field("int", 1, 1),
    "user": Field("str", max_len=512),
    # vLLM-style extensions many clients send
    "top_k": TOP_K,
    "min_p": MIN_P,
    "repetition_penalty": REPEAT_PENALTY,
    "ignore_eos": Field("bool"),
}
CHAT_FIELDS = {**COMMON, "max_completion_tokens": MAX_TOKENS, "logprobs": Field("bool"), "top_logprobs": LOGPROBS_TOP}
COMPLETION_FIELDS = {**COMMON, "prompt": Field("str|list"), "suffix": TEXT, "echo": Field("bool"),
                     "logprobs": LOGPROBS_TOP}


def _params(f: dict, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens or DEFAULT_MAX_TOKENS,
        temperature=float(f.get("temperature", 1.0)),
        top_p=float(f.get("top_p", 1.0)) or 1e-6,
        top_k=max(f.get("top_k", 0), 0),
        min_p=float(f.get("min_p", 0.0)),
        repetition_penalty=float(f.get("repetition_penalty", 1.0)) or 1.0,
        presence_penalty=float(f.get("presence_penalty", 0.0)),
        frequency_penalty=float(f.get("frequency_penalty", 0.0)),
        seed=f.get("seed"),
        stop=f.get("stop", []),
        ignore_eos=f.get("ignore_eos", False),
        logprobs=logprobs,
    )


def _reject_unsupported(body: dict) -> None:
    """Refuse features this server lacks instead of ignoring them: a client asking for JSON output or a tool call
    would silently get prose. Their neutral values (text output, no tools, no bias, best_of 1) are fine."""
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        kind = fmt.get("type") if isinstance(fmt, dict) else fmt
        raise ApiError(400, f"response_format {kind!r} (structured output) is not supported; only {{\"type\": "
                            f"\"text\"}}", param="response_format")
    if body.get("tools") and body.get("tool_choice") != "none":
        raise ApiError(400, "tools (function calling) are not supported by this server", param="tools")
    if body.get("logit_bias"):
        raise ApiError(400, "logit_bias is not supported by this server", param="logit_bias")
    if body.get("best_of") not in (None, 1):
        raise ApiError(400, "best_of must be 1: one choice per request is supported", param="best_of")


def _check_common(state: ServerState, body: dict, table: dict) -> dict:
    if body.get("n") not in (None, 1):
        raise ApiError(400, "n must be 1: one choice per request is supported", param="n")
    _reject_unsupported(body)
    f = check_fields(body, table)
    state.check_model(f.get("model"))
    opts = f.get("stream_options")
    if opts is not None:
        if not f.get("stream"):
            raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")
        check_fields(opts, {"include_usage": Field("bool")}, prefix="stream_options.")
    return f


def _usage(gen: Generation, prompt_len: int, generated: int) -> dict:
    t = gen.timings
    prompt = t.num_prompt_tokens if t and t.num_prompt_tokens else prompt_len
    completion = t.num_generated_tokens if t and t.num_generated_tokens else generated
    cached = t.num_cached_tokens if t else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _piece(tok, token_id: int) -> str:
    return tok.decode([token_id], skip_special_tokens=False)


def _chat_logprobs(tok, items) -> dict:
    content = []
    for lp in items:
        piece = _piece(tok, lp.token_id)
        content.append({
            "token": piece, "logprob": lp.logprob, "bytes": list(piece.encode("utf-8")),
            "top_logprobs": [{"token": (p := _piece(tok, tid)), "logprob": v, "bytes": list(p.encode("utf-8"))}
                             for tid, v in lp.top],
        })
    return {"content": content}


def _completion_logprobs(tok, items, offset: int) -> dict:
    tokens, lps, tops, offsets = [], [], [], []
    for lp in items:
        piece = _piece(tok, lp.token_id)
        tokens.append(piece)
        lps.append(lp.logprob)
        tops.append({_piece(tok, tid): v for tid, v in lp.top})
        offsets.append(offset)
        offset += len(piece)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = state_of(request)
    body = await read_json(request, state.max_body_bytes)
    require(body, "messages")
    f = _check_common(state, body, CHAT_FIELDS)
    messages = parse_messages(body["messages"])
    if "top_logprobs" in f and not f.get("logprobs"):
        raise ApiError(400, "top_logprobs requires logprobs: true", param="top_logprobs")
    logprobs = f.get("top_logprobs", 0) if f.get("logprobs") else None
    params = _params(f, f.get("max_completion_tokens", f.get("max_tokens")), logprobs)
    state = await state.use_model(request, f.get("model"))  # a bad request never loads a model: checked above
    engine = state.require_engine()
    prompt_ids = await state.encode_chat(messages)
    state.check_length(prompt_ids, params, "messages")
    tok = engine.tokenizer
    rid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), state.model_name

    async with Generation(state, request, prompt_ids, params) as gen:
        if not f.get("stream"):
            res = await gen.collect()
            return web.json_response({
                "id": rid, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": res.text},
                             "logprobs": _chat_logprobs(tok, res.logprobs) if logprobs is not None else None,
                             "finish_reason": res.finish_reason, "stop_reason": gen.stop_reason}],
                "usage": _usage(gen, len(prompt_ids), len(res.token_ids)),
                "timings": timings_dict(gen.timings),
            })

        include_usage = bool((f.get("stream_options") or {}).get("include_usage"))
        generated = 0
        first = True

        def chunk(delta: dict, finish: str | None, lp=None, extra: dict | None = None) -> dict:
            c = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                 "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}]}
            if include_usage:
                c["usage"] = None
            return {**c, **(extra or {})}

        def render(out):
            nonlocal generated, first
            generated += len(out.new_token_ids)
            finish = output_reason(out)
            events = []
            if first:
                first = False
                events.append(chunk({"role": "assistant", "content": ""}, None))
            if out.text_delta or out.logprobs or finish:
                lp = _chat_logprobs(tok, out.logprobs) if logprobs is not None and out.logprobs else None
                delta = {"content": out.text_delta} if out.text_delta else {}
                extra = {"timings": timings_dict(gen.timings)} if finish else None
                events.append(chunk(delta, finish, lp, extra))
            return events

        def tail():
            events = []
            if include_usage:
                events.append({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                               "choices": [], "usage": _usage(gen, len(prompt_ids), generated)})
            return events + ["[DONE]"]

        return await pump(gen, EventStream(request, "sse", state.write_timeout), render, tail, _stream_error)


async def completions(request: web.Request) -> web.StreamResponse:
    state = state_of(request)
    body = await read_json(request, state.max_body_bytes)
    require(body, "prompt")
    f = _check_common(state, body, COMPLETION_FIELDS)
    logprobs = f.get("logprobs")
    params = _params(f, f.get("max_tokens"), logprobs)
    state = await state.use_model(request, f.get("model"))
    engine = state.require_engine()
    prompt = f["prompt"]
    suffix = f.get("suffix")
    if isinstance(prompt, list):
        if suffix:
            raise ApiError(400, "suffix needs a text prompt, not token ids", param="suffix")
        vocab = engine.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise ApiError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        prompt_ids, prompt_text = prompt, None
    elif len(prompt) > TEXT.max_len:
        raise ApiError(400, f"prompt must be at most {TEXT.max_len} characters", param="prompt")
    elif suffix:
        prompt_ids, prompt_text = await state.fim_prompt(prompt, suffix), prompt
    else:
        prompt_ids, prompt_text = await state.encode(prompt, True), prompt
    state.check_length(prompt_ids, params)
    tok = engine.tokenizer
    echo = prompt_text if f.get("echo") and prompt_text is not None else ""
    rid, created, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), state.model_name

    async with Generation(state, request, prompt_ids, params) as gen:
        if not f.get("stream"):
            res = await gen.collect()
            return web.json_response({
                "id": rid, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": echo + res.text, "finish_reason": res.finish_reason,
                             "stop_reason": gen.stop_reason,
                             "logprobs": _completion_logprobs(tok, res.logprobs, len(echo))
                             if logprobs is not None else None}],
                "usage": _usage(gen, len(prompt_ids), len(res.token_ids)),
                "timings": timings_dict(gen.timings),
            })

        include_usage = bool((f.get("stream_options") or {}).get("include_usage"))
        generated = 0
        offset = len(echo)
        pending_echo = echo

        def render(out):
            nonlocal generated, offset, pending_echo
            generated += len(out.new_token_ids)
            finish = output_reason(out)
            if not (out.text_delta or out.logprobs or finish or pending_echo):
                return []
            lp = None
            if logprobs is not None and out.logprobs:
                lp = _completion_logprobs(tok, out.logprobs, offset)
            offset += len(out.text_delta)
            c = {"id": rid, "object": "text_completion", "created": created, "model": model,
                 "choices": [{"index": 0, "text": pending_echo + out.text_delta, "logprobs": lp,
                              "finish_reason": finish}]}
            pending_echo = ""
            if include_usage:
                c["usage"] = None
            if finish:
                c["timings"] = timings_dict(gen.timings)
            return [c]

        def tail():
            events = []
            if include_usage:
                events.append({"id": rid, "object": "text_completion", "created": created, "model": model,
                               "choices": [], "usage": _usage(gen, len(prompt_ids), generated)})
            return events + ["[DONE]"]

        return await pump(gen, EventStream(request, "sse", state.write_timeout), render, tail, _stream_error)


def _stream_error(exc: ApiError) -> dict:
    return {"error": {"message": exc.message, "type": "server_error", "param": None, "code": None}}


def _model_card(state: ServerState) -> dict:
    return {"id": state.model_name, "object": "model", "created": int(state.started_wall), "owned_by": "llmd"}


async def list_models(request: web.Request) -> web.Response:
    """Every model this daemon can serve (loaded or not), with where it lives (llmd.server.listing)."""
    state = state_of(request)
    if state.models is not None:
        from .listing import openai_models

        return web.json_response({"object": "list", "data": await openai_models(state)})
    data = [_model_card(state)] if state.status == "ready" else []
    return web.json_response({"object": "list", "data": data})


async def get_model(request: web.Request) -> web.Response:
    state = state_of(request)
    if state.models is not None:
        from .listing import openai_model

        return web.json_response(await openai_model(state, request.match_info["name"]))
    state.require_engine()
    state.check_model(request.match_info["name"])
    return web.json_response(_model_card(state))


def setup_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{name:.+}", get_model)
