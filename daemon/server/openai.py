"""OpenAI dialect: /v1/chat/completions, /v1/completions (with `suffix` for fill-in-the-middle), /v1/models.

Field rules (what the API accepts and has no meaning here is accepted and ignored, the fields named in one DEBUG
line; only what would silently change the answer is refused):
- honoured: model, messages / prompt, stream, stream_options.include_usage (stream_options without stream is a 400,
  as OpenAI answers), temperature, top_p, max_tokens / max_completion_tokens, stop, seed, presence_penalty,
  frequency_penalty, n (1), logprobs, top_logprobs, tools (function tools; a `strict: true` one refuses a schema
  the grammar cannot enforce, others compile leniently: tools.schema), tool_choice, parallel_tool_calls,
  response_format (text, json_object, json_schema with the same `strict` rule), reasoning_effort (none: thinking
  off, any other: on; a hint, so a model without thinking ignores it; a template that reads `reasoning_effort`,
  gpt-oss's, gets it as low, medium or high: tools.plan), chat_template_kwargs, and the vLLM-style
  top_k, min_p, repetition_penalty, ignore_eos; for completions also suffix (FIM) and echo.
- accepted with no effect: user, store, metadata, service_tier, prompt_cache_key, safety_identifier, prediction
  (a speed hint), verbosity, modalities ["text"], logit_bias and best_of at their neutral values (empty, 1), and
  any field this list does not name; web_search_options (a hosted search) with a WARNING line.
- refused with a 400 naming the field: n above 1, best_of above 1, a logit_bias, modalities other than text and
  an audio output (the answer would lack them), and the legacy functions / function_call (send tools: ignoring
  them would hide the tools from the model).
"""

from __future__ import annotations

import json
import logging
import time
import uuid

from aiohttp import web

from ..engine.types import RequestOutput, SamplingParams
from .core import Generation, GenerationResult, Renderer, ServerState, output_reason, run, state_of
from ..tools.parsers import Piece
from ..tools.spec import AnswerFormat, ToolSpec, check_schema, normalise_history, parse_tool_choice, parse_tools
from .intake import ChatPrompt, FimPrompt, Intake, TextPrompt, TokenPrompt, checked_params, given_fields
from .responses import logprob_items, timings_dict
from .validation import (LOGPROBS_TOP, MAX_TOKENS, MIN_P, PENALTY, REPEAT_PENALTY, SEED, STOP, TEXT, TOP_K, TOP_P,
                         ApiError, Field, bad_field, check_fields, log_ignored, parse_messages, read_json, require)

log = logging.getLogger("llmd.server")

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
CHAT_FIELDS = {**COMMON, "max_completion_tokens": MAX_TOKENS, "logprobs": Field("bool"), "top_logprobs": LOGPROBS_TOP,
               "parallel_tool_calls": Field("bool"), "chat_template_kwargs": Field("dict"),
               "reasoning_effort": Field("str", choices=("none", "minimal", "low", "medium", "high", "xhigh")),
               "modalities": Field("list", max_len=8)}
COMPLETION_FIELDS = {**COMMON, "prompt": Field("str|list"), "suffix": TEXT, "echo": Field("bool"),
                     "logprobs": LOGPROBS_TOP}
# the fields that have an effect here (log_ignored names the others at DEBUG)
CHAT_HONOURED = {*CHAT_FIELDS, "messages", "tools", "tool_choice", "response_format"} - {"user", "modalities"}
COMPLETION_HONOURED = {*COMPLETION_FIELDS, "response_format"} - {"user"}


# the request fields that set a SamplingParams field (a model's default options fill the others: intake.py)
GIVEN = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
         "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
         "frequency_penalty": "frequency_penalty", "seed": "seed", "stop": "stop", "max_tokens": "max_tokens",
         "max_completion_tokens": "max_tokens"}


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
    """Refuse features this server lacks instead of ignoring them. Their neutral values (no bias, best_of 1) are
    fine."""
    if body.get("logit_bias"):
        raise ApiError(400, "logit_bias is not supported by this server", param="logit_bias")
    if body.get("best_of") not in (None, 1):
        raise ApiError(400, "best_of must be 1: one choice per request is supported", param="best_of")
    for legacy in ("functions", "function_call"):
        if body.get(legacy):
            raise bad_field(legacy, "(the legacy form of tools) is not supported: send tools and tool_choice")
    if any(m != "text" for m in body.get("modalities") or []):
        raise bad_field("modalities", "other than text are not supported")
    if body.get("audio") is not None:
        raise bad_field("audio", "output is not supported: answers are text")
    if body.get("web_search_options") is not None:
        log.warning("web_search_options: no web search here; the model answers from what it knows")


def _check_common(state: ServerState, body: dict, table: dict, honoured: set[str], route: str) -> dict:
    if body.get("n") not in (None, 1):
        raise ApiError(400, "n must be 1: one choice per request is supported", param="n")
    f = check_fields(body, table)
    _reject_unsupported(body)
    state.check_model(f.get("model"))
    log_ignored(body, honoured, route)
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


def _include_usage(f: dict) -> bool:
    return bool((f.get("stream_options") or {}).get("include_usage"))


def response_format(value) -> AnswerFormat | None:
    """OpenAI's response_format: text, json_object, or json_schema {name, schema, strict}."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise bad_field("response_format", "must be {\"type\": \"text\" | \"json_object\" | \"json_schema\"}")
    if value["type"] == "text":
        return None
    if value["type"] == "json_object":
        return AnswerFormat("json_object", "", "response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_field("response_format.json_schema", "must be an object with name and schema")
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise bad_field("response_format.json_schema.name", "is required (a string)")
    strict = spec.get("strict") or False
    if not isinstance(strict, bool):
        raise bad_field("response_format.json_schema.strict", "must be true or false")
    schema = check_schema(spec.get("schema", {}), "response_format.json_schema.schema", strict)
    return AnswerFormat("json_schema", json.dumps(schema, ensure_ascii=False), "response_format")


def tool_spec(body: dict, f: dict) -> ToolSpec | None:
    tools = body.get("tools")
    functions = parse_tools(tools) if tools is not None else ()
    choice = parse_tool_choice(body.get("tool_choice"), functions)
    if not functions:
        return None
    return ToolSpec(functions, choice, f.get("parallel_tool_calls", True))


RESERVED_TEMPLATE_NAMES = {"messages", "tools", "documents", "add_generation_prompt"}
TEMPLATE_EFFORTS = ("low", "medium", "high")  # the reasoning_effort a template (gpt-oss's) is written for


def _template_kwargs(kwargs: dict) -> dict:
    """vLLM's chat_template_kwargs: extra template variables (enable_thinking, ...), a few plain names."""
    if len(kwargs) > 16:
        raise bad_field("chat_template_kwargs", "may hold at most 16 variables")
    for name, value in kwargs.items():
        if not name.isidentifier() or name.startswith("_") or name in RESERVED_TEMPLATE_NAMES:
            raise bad_field(f"chat_template_kwargs.{name}", "is not a template variable a request may set")
    if "enable_thinking" in kwargs and not isinstance(kwargs["enable_thinking"], bool):
        raise bad_field("chat_template_kwargs.enable_thinking", "must be true or false")
    if "reasoning_effort" in kwargs and kwargs["reasoning_effort"] not in TEMPLATE_EFFORTS:
        raise bad_field("chat_template_kwargs.reasoning_effort", "must be " + ", ".join(TEMPLATE_EFFORTS))
    return dict(kwargs)


def parse_chat(body: dict, state: ServerState) -> Intake:
    require(body, "messages")
    f = _check_common(state, body, CHAT_FIELDS, CHAT_HONOURED, "/v1/chat/completions")
    messages = normalise_history(body["messages"], parse_messages(body["messages"]))
    if "top_logprobs" in f and not f.get("logprobs"):
        raise ApiError(400, "top_logprobs requires logprobs: true", param="top_logprobs")
    logprobs = f.get("top_logprobs", 0) if f.get("logprobs") else None
    params = checked_params(_params(f, f.get("max_completion_tokens", f.get("max_tokens")), logprobs))
    kwargs = _template_kwargs(f.get("chat_template_kwargs") or {})
    think = f["reasoning_effort"] != "none" if "reasoning_effort" in f else None
    prompt = ChatPrompt(messages, tool_spec(body, f), think=think, think_hint=True, template_kwargs=kwargs,
                        effort=f.get("reasoning_effort"))
    return Intake(f.get("model"), prompt, params, bool(f.get("stream")), length_field="messages",
                  answer=response_format(body.get("response_format")), include_usage=_include_usage(f),
                  given=given_fields(f, GIVEN))


def parse_completion(body: dict, state: ServerState) -> Intake:
    require(body, "prompt")
    f = _check_common(state, body, COMPLETION_FIELDS, COMPLETION_HONOURED, "/v1/completions")
    params = checked_params(_params(f, f.get("max_tokens"), f.get("logprobs")))
    prompt, suffix = f["prompt"], f.get("suffix")
    if isinstance(prompt, list):
        if suffix:
            raise ApiError(400, "suffix needs a text prompt, not token ids", param="suffix")
        kind = TokenPrompt(prompt)
    elif len(prompt) > TEXT.max_len:
        raise ApiError(400, f"prompt must be at most {TEXT.max_len} characters", param="prompt")
    elif suffix:
        kind = FimPrompt(prompt, suffix)
    else:
        kind = TextPrompt(prompt)
    return Intake(f.get("model"), kind, params, bool(f.get("stream")), include_usage=_include_usage(f),
                  answer=response_format(body.get("response_format")), given=given_fields(f, GIVEN),
                  echo=bool(f.get("echo")) and isinstance(kind, (TextPrompt, FimPrompt)))


class _Answer(Renderer):
    """What both OpenAI renderers share: the id, the creation time, usage and the stream's end. A quiet stream sends
    SSE comments (the Renderer's keep-alive)."""

    obj = ""

    def __init__(self, intake: Intake, model: str, prefix: str):
        self.intake = intake
        self.id, self.created, self.model = f"{prefix}-{uuid.uuid4().hex}", int(time.time()), model
        self.generated = 0

    def head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def usage(self, gen: Generation, generated: int) -> dict:
        return _usage(gen, len(gen.prompt_ids), generated)

    def chunk(self, choice: dict, gen: Generation, finish: str | None) -> dict:
        c = {**self.head(self.obj), "choices": [choice]}
        if self.intake.include_usage:
            c["usage"] = None
        if finish:
            c["timings"] = timings_dict(gen.timings)
        return c

    def tail(self, gen: Generation) -> list:
        events = []
        if self.intake.include_usage:
            events.append({**self.head(self.obj), "choices": [], "usage": self.usage(gen, self.generated)})
        return events + ["[DONE]"]

    def error(self, exc: ApiError) -> dict:
        return _stream_error(exc)


def _message_calls(calls) -> list[dict]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_json}}
            for c in calls]


class ChatAnswer(_Answer):
    """Content, reasoning_content and tool_calls from the generation's OutputParser. Streamed, the role chunk opens
    the stream at once; a call's id, type and name come once, then its arguments; a stop after calls is
    finish_reason "tool_calls". A call max_tokens cuts is dropped from a whole answer; streamed, the part already
    sent is marked incomplete by finish_reason "length"."""

    obj = "chat.completion.chunk"

    def __init__(self, intake: Intake, model: str):
        super().__init__(intake, model, "chatcmpl")
        self.index: dict[str, int] = {}  # call id -> its index in tool_calls

    def _head(self, call_id: str, name: str) -> dict:
        return {"index": self.index[call_id], "id": call_id, "type": "function",
                "function": {"name": name, "arguments": ""}}

    def _logprobs(self, gen: Generation, items) -> dict | None:
        if self.intake.params.logprobs is None:
            return None
        return logprob_items(gen.engine.tokenizer, items, "chat")

    @staticmethod
    def _finish(gen: Generation, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and gen.output.calls else reason

    def whole(self, gen: Generation, res: GenerationResult) -> dict:
        piece = res.piece
        message: dict = {"role": "assistant", "content": piece.content if piece.content or not piece.calls else None}
        if piece.reasoning:
            message["reasoning_content"] = piece.reasoning
        if piece.calls:
            message["tool_calls"] = _message_calls(piece.calls)
        return {**self.head("chat.completion"),
                "choices": [{"index": 0, "message": message, "logprobs": self._logprobs(gen, res.logprobs),
                             "finish_reason": self._finish(gen, res.finish_reason), "stop_reason": gen.stop_reason}],
                "usage": self.usage(gen, len(res.token_ids)), "timings": timings_dict(gen.timings)}

    def _choice(self, delta: dict, lp=None, finish: str | None = None) -> dict:
        return {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}

    def opening(self, gen: Generation) -> list:
        return [self.chunk(self._choice({"role": "assistant", "content": ""}), gen, None)]

    def events(self, gen: Generation, out: RequestOutput, piece: Piece) -> list:
        self.generated += len(out.new_token_ids)
        finish = output_reason(out)
        events = []
        lp = self._logprobs(gen, out.logprobs) if out.logprobs else None
        deltas = []
        if piece.reasoning:
            deltas.append({"reasoning_content": piece.reasoning})
        if piece.content:
            deltas.append({"content": piece.content})
        for d in piece.deltas:  # calls streamed as they are written (a grammar keeps them valid)
            if d.name is not None:
                self.index[d.id] = len(self.index)
                deltas.append({"tool_calls": [self._head(d.id, d.name)]})
            elif d.arguments:
                deltas.append({"tool_calls": [{"index": self.index[d.id], "function": {"arguments": d.arguments}}]})
        for call in piece.calls:
            if call.streamed:
                continue
            self.index[call.id] = len(self.index)
            deltas += [{"tool_calls": [self._head(call.id, call.name)]},
                       {"tool_calls": [{"index": self.index[call.id], "function": {"arguments": call.arguments_json}}]}]
        if lp and not deltas and not finish:
            deltas.append({})
        for i, delta in enumerate(deltas):
            events.append(self.chunk(self._choice(delta, lp if i == 0 else None), gen, None))
        if finish:
            events.append(self.chunk(self._choice({}, lp if not deltas else None, self._finish(gen, finish)), gen,
                                     finish))
        return events


class CompletionAnswer(_Answer):
    obj = "text_completion"

    def __init__(self, intake: Intake, model: str):
        super().__init__(intake, model, "cmpl")
        prompt = intake.prompt
        self.echo = (prompt.text if isinstance(prompt, TextPrompt) else prompt.prefix) if intake.echo else ""
        self.pending_echo = self.echo
        self.offset = len(self.echo)

    def _logprobs(self, gen: Generation, items, offset: int) -> dict | None:
        if self.intake.params.logprobs is None:
            return None
        return logprob_items(gen.engine.tokenizer, items, "completion", offset)

    def whole(self, gen: Generation, res: GenerationResult) -> dict:
        return {**self.head("text_completion"),
                "choices": [{"index": 0, "text": self.echo + res.text, "finish_reason": res.finish_reason,
                             "stop_reason": gen.stop_reason, "logprobs": self._logprobs(gen, res.logprobs,
                                                                                        len(self.echo))}],
                "usage": self.usage(gen, len(res.token_ids)), "timings": timings_dict(gen.timings)}

    def events(self, gen: Generation, out: RequestOutput, piece: Piece) -> list:
        self.generated += len(out.new_token_ids)
        finish = output_reason(out)
        if not (out.text_delta or out.logprobs or finish or self.pending_echo):
            return []
        lp = self._logprobs(gen, out.logprobs, self.offset) if out.logprobs else None
        self.offset += len(out.text_delta)
        text, self.pending_echo = self.pending_echo + out.text_delta, ""
        return [self.chunk({"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}, gen, finish)]


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = state_of(request)
    intake = parse_chat(await read_json(request, state.max_body_bytes), state)
    return await run(request, state, intake, ChatAnswer(intake, intake.model or state.model_name))


async def completions(request: web.Request) -> web.StreamResponse:
    state = state_of(request)
    intake = parse_completion(await read_json(request, state.max_body_bytes), state)
    return await run(request, state, intake, CompletionAnswer(intake, intake.model or state.model_name))


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
