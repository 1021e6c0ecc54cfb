"""Anthropic Messages: `POST /v1/messages` (whole or streamed) and `POST /v1/messages/count_tokens`.

A thin adapter: the body becomes the chat dialects' Intake (system + messages with their tool_use / tool_result
blocks in the normalised history, tools, tool_choice, thinking as the reasoning switch) and the generation's parsed
output (thought, text, calls) is rendered as content blocks, streamed in Anthropic's event sequence (`message_start`,
`ping`, `content_block_start` / `_delta` / `_stop`, `message_delta`, `message_stop`; named SSE events). Errors take
Anthropic's shape `{"type": "error", "error": {"type", "message"}}`, the message naming the field.

Headers: `x-api-key` is accepted as the daemon's token (security.py), `anthropic-version` and `anthropic-beta` are
accepted with any value (the fields a beta unlocks are judged by the rules below).

The rule: what the real API accepts and has no meaning here is accepted and ignored (the fields named in one DEBUG
line); only what would silently change the answer is refused. For each field the `anthropic` package's
`messages.create` can send, and those agents send (Claude Code):
- honoured: model (the served name or an alias), messages, system, max_tokens (a ceiling, as Anthropic defines
  it: generation also ends at the context's end, stop_reason model_context_window_exceeded; at least 1, the cache
  pre-warming `0` is refused),
  stop_sequences, stream, temperature (0..1), top_p, top_k, tools (client tools: `custom` or no type), tool_choice
  (auto, any, tool, none; `disable_parallel_tool_use`), thinking (enabled: on, disabled: off, adaptive /
  between_tools: the template's default; `display: omitted` sends the thinking blocks empty; thinking tokens count
  toward max_tokens, `budget_tokens` is checked but is no separate cap), a reasoning effort for a template that
  reads one (gpt-oss's, which cannot stop thinking): output_config.effort, else thinking's budget_tokens (below
  4096: low, below 16384: medium, else high; disabled: low), output_config.format (and the older
  top-level output_format): a JSON schema the answer follows, through the grammar (leniently: tools.schema; a
  tool's `strict: true` refuses what the grammar cannot enforce).
- accepted with no effect, since they steer Anthropic's hosted service and a local daemon has one of each:
  metadata, service_tier, speed, inference_geo, workspace_id, user_profile_id, diagnostics, output_config.effort
  (but for a template that reads an effort, above), context_management (its edits trim old thinking and tool
  results server-side; a conversation too long for the context is a 400), container and mcp_servers when empty,
  any field this list does not name, and cache_control, at the top level and on system, message, tool and
  tool_result blocks (the prefix cache reuses every shared prefix on its own; usage reports what it read).
- an assistant turn's thinking blocks go with it as `thinking` (gpt-oss's template shows a call's reasoning to
  the model; other templates ignore it); redacted_thinking blocks are dropped.
- refused with a 400 naming the field: a container or MCP servers (hosted code execution, server-side MCP), hosted
  tools (web search, code execution, bash, text editor, ...), content blocks other than text / tool_use /
  tool_result / thinking (images, documents, search results, server tool blocks), a tool_result naming no tool_use
  of the assistant message before it, and a conversation that ends with an assistant turn (prefill: the chat
  template cannot continue a turn).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from aiohttp import web

from ..engine.types import RequestOutput, SamplingParams
from ..tools.parsers import Piece, ToolCall
from ..tools.spec import AnswerFormat, Function, ToolSpec, check_schema
from .agents import MAX_BLOCKS, call_entry, flat_tools, parts_in_order, renamed, text_of, token_counts
from .core import Generation, GenerationResult, Renderer, ServerState, encode_prompt, output_reason, run, state_of
from .intake import ChatPrompt, Intake, checked_params, given_fields
from .validation import (MAX_MESSAGES, STOP, TOP_P, ApiError, Field, bad_field, check_fields, image_part, log_ignored,
                         read_json, require)

FIELDS = {
    "model": Field("str", max_len=512),
    "max_tokens": Field("int", 1, 1 << 20),  # a ceiling: generation also ends at the context's end
    "stream": Field("bool"),
    "stop_sequences": STOP,
    "temperature": Field("number", 0, 1),
    "top_p": TOP_P,
    "top_k": Field("int", 0, 1_000_000),
    "metadata": Field("dict"),
    "service_tier": Field("str", choices=("auto", "standard_only")),
    "speed": Field("str", choices=("standard", "fast")),
    "inference_geo": Field("str", max_len=128),
    "workspace_id": Field("str", max_len=512),
    "user_profile_id": Field("str", max_len=512),
    "cache_control": Field("dict"),
    "diagnostics": Field("dict"),
    "output_config": Field("dict"),
    "output_format": Field("dict"),
    "thinking": Field("dict"),
    "tool_choice": Field("dict"),
}
REFUSED = {  # refused unless empty
    "container": "containers (for hosted code execution) are not supported",
    "mcp_servers": "MCP servers are not supported: the client runs its tools and sends them as tools",
}
HONOURED = ("model", "messages", "system", "max_tokens", "stop_sequences", "stream", "temperature", "top_p", "top_k",
            "tools", "tool_choice", "thinking", "output_config", "output_format")
EFFORTS = ("low", "medium", "high", "xhigh", "max")
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error"}


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "invalid_request_error"), "message": message}}


# --- the request ---------------------------------------------------------------------------------------------------

def _blocks(content: Any, where: str) -> list:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad_field(where, "must be a string or an array of content blocks")
    if len(content) > MAX_BLOCKS:
        raise bad_field(where, f"may hold at most {MAX_BLOCKS} blocks")
    for j, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise bad_field(f"{where}[{j}]", "must be an object with a type")
    return content


def _text_blocks(content: Any, where: str) -> str:
    texts = []
    for j, block in enumerate(_blocks(content, where)):
        if block["type"] != "text":
            raise bad_field(f"{where}[{j}].type", f"{block['type']!r} is not supported here (text only)")
        texts.append(text_of(block.get("text"), f"{where}[{j}].text"))
    return "\n".join(texts)


def _result_text(block: dict, where: str) -> str:
    content = block.get("content", "")
    text = _text_blocks(content, f"{where}.content") if content is not None else ""
    is_error = block.get("is_error", False)
    if not isinstance(is_error, bool):
        raise bad_field(f"{where}.is_error", "must be true or false")
    return f"Error: {text}" if is_error else text


SUPPORTED = {"user": "text, image, tool_result", "assistant": "text, tool_use, thinking, redacted_thinking",
             "system": "text"}


def history(body: dict) -> list[dict]:
    """system + messages in the normalised history: tool_use blocks become the assistant's tool_calls, tool_result
    blocks tool messages (before the user's text of the same turn)."""
    require(body, "messages")
    raw = body["messages"]
    if not isinstance(raw, list):
        raise bad_field("messages", "must be an array of messages")
    if not raw:
        raise bad_field("messages", "must hold at least one message")
    if len(raw) > MAX_MESSAGES:
        raise bad_field("messages", f"may hold at most {MAX_MESSAGES} messages")
    out: list[dict] = []
    if body.get("system") is not None:
        out.append({"role": "system", "content": _text_blocks(body["system"], "system")})
    open_calls: dict[str, str] = {}  # id -> name of the last assistant turn's tool_use blocks
    for i, msg in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise bad_field(where, "must be an object with role and content")
        role = msg.get("role")
        if role not in SUPPORTED:
            raise bad_field(f"{where}.role", "must be user, assistant or system")
        texts, calls, results, thoughts, parts = [], [], [], [], []
        for j, block in enumerate(_blocks(msg.get("content"), f"{where}.content")):
            bw, kind = f"{where}.content[{j}]", block["type"]
            if kind == "text":
                texts.append(text_of(block.get("text"), f"{bw}.text"))
                parts.append({"type": "text", "text": texts[-1]})
            elif role == "user" and kind == "image":
                parts.append(image_part(block, bw))
            elif role == "assistant" and kind == "thinking":
                thoughts.append(text_of(block.get("thinking", ""), f"{bw}.thinking"))
            elif role == "assistant" and kind == "redacted_thinking":
                continue
            elif role == "assistant" and kind == "tool_use":
                calls.append(call_entry(block.get("id"), block.get("name"), block.get("input", {}), bw, "id", "input"))
            elif role == "user" and kind == "tool_result":
                tid = block.get("tool_use_id")
                if not isinstance(tid, str) or tid not in open_calls:
                    raise bad_field(f"{bw}.tool_use_id", "names no tool_use block of the assistant message before it")
                results.append({"role": "tool", "content": _result_text(block, bw), "tool_call_id": tid,
                                "name": open_calls[tid]})
            else:
                raise bad_field(f"{bw}.type", f"{kind!r} is not supported in a {role} message "
                                              f"(supported: {SUPPORTED[role]})")
        if role == "assistant":
            turn: dict = {"role": "assistant", "content": "\n".join(texts)}
            if any(thoughts):
                turn["thinking"] = "\n".join(t for t in thoughts if t)
            if calls:
                turn["tool_calls"] = calls
            out.append(turn)
            open_calls = {c["id"]: c["function"]["name"] for c in calls}
            continue
        out.extend(results)
        if len(parts) > len(texts):  # with images: the blocks in order
            out.append({"role": role, "content": parts})
        elif texts or not results:
            out.append({"role": role, "content": "\n".join(texts)})
        open_calls = {}
    if raw[-1].get("role") == "assistant":
        raise bad_field(f"messages[{len(raw) - 1}].role", "must not be assistant: continuing an assistant turn "
                                                          "(prefill) is not supported")
    return out


def tool_spec(body: dict, f: dict) -> ToolSpec | None:
    functions: tuple[Function, ...] = ()
    if body.get("tools") is not None:
        functions = flat_tools(body["tools"], "tools", "input_schema", (None, "custom"))
    choice = f.get("tool_choice")
    if choice is None:
        return ToolSpec(functions) if functions else None
    kind = choice.get("type")
    parallel = choice.get("disable_parallel_tool_use", False)
    if not isinstance(parallel, bool):
        raise bad_field("tool_choice.disable_parallel_tool_use", "must be true or false")
    if kind not in ("auto", "any", "tool", "none"):
        raise bad_field("tool_choice.type", "must be auto, any, tool or none")
    if kind in ("any", "tool") and not functions:
        raise bad_field("tool_choice", f"{kind} needs tools")
    name = "required" if kind == "any" else kind
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str) or not any(fn.name == name for fn in functions):
            raise bad_field("tool_choice.name", f"names no tool in tools: {name!r}")
    return ToolSpec(functions, name, not parallel) if functions else None


def thinking(f: dict) -> tuple[bool | None, bool]:
    """(the reasoning switch, whether the thought is shown)."""
    value = f.get("thinking")
    if value is None:
        return None, True
    kind = value.get("type")
    if kind not in ("enabled", "disabled", "adaptive", "between_tools"):
        raise bad_field("thinking.type", "must be enabled, disabled, adaptive or between_tools")
    if kind == "disabled":
        return False, True
    display = value.get("display")
    if display not in (None, "summarized", "omitted"):
        raise bad_field("thinking.display", "must be summarized or omitted")
    if kind == "enabled":
        budget = value.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
            raise bad_field("thinking.budget_tokens", "must be a positive integer")
    return (True if kind == "enabled" else None), display != "omitted"


BUDGET_EFFORTS = ((4096, "low"), (16384, "medium"))  # budget_tokens below each bound -> that effort, else high


def effort(f: dict) -> str | None:
    """The reasoning effort (OpenAI's names, tools.plan) for a template that reads one: output_config.effort, else
    what thinking's budget_tokens buys (disabled: none, which gpt-oss reads as low)."""
    config_effort = (f.get("output_config") or {}).get("effort")
    if config_effort is not None:
        return config_effort  # checked by answer_format
    value = f.get("thinking") or {}
    if value.get("type") == "disabled":
        return "none"
    budget = value.get("budget_tokens") if value.get("type") == "enabled" else None
    if budget is None:
        return None
    return next((level for bound, level in BUDGET_EFFORTS if budget < bound), "high")


def answer_format(f: dict) -> AnswerFormat | None:
    config = f.get("output_config") or {}
    if config.get("effort") is not None and config["effort"] not in EFFORTS:
        raise bad_field("output_config.effort", "must be one of " + ", ".join(EFFORTS))
    where, fmt = "output_config.format", config.get("format")
    if fmt is None and f.get("output_format") is not None:
        where, fmt = "output_format", f["output_format"]
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise bad_field(where, "must be {\"type\": \"json_schema\", \"schema\": {...}}")
    schema = check_schema(fmt.get("schema"), f"{where}.schema")
    return AnswerFormat("json_schema", json.dumps(schema, ensure_ascii=False), where)


def _checked(body: dict, state: ServerState) -> dict:
    for name, why in REFUSED.items():
        if body.get(name) not in (None, [], {}):
            raise bad_field(name, why)
    f = check_fields(body, FIELDS)
    state.check_model(f.get("model"), required=True)
    log_ignored(body, HONOURED, "/v1/messages")
    return f


def parse(body: dict, state: ServerState, count_only: bool = False) -> tuple[Intake, bool]:
    """The Intake of a Messages body, and whether thinking is shown."""
    if not count_only:
        require(body, "max_tokens")
    f = _checked(body, state)
    think, show = thinking(f)
    answer = answer_format(f)
    prompt = ChatPrompt(history(body), tool_spec(body, f), think=think, effort=effort(f))
    params = checked_params(SamplingParams(
        max_tokens=f.get("max_tokens", 1), temperature=float(f.get("temperature", 1.0)),
        top_p=float(f.get("top_p", 1.0)) or 1e-6, top_k=f.get("top_k", 0), stop=f.get("stop_sequences", [])))
    given = given_fields(f, {"max_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p",
                             "top_k": "top_k", "stop_sequences": "stop"})
    return Intake(f.get("model"), prompt, params, bool(f.get("stream")), length_field="messages",
                  answer=answer, given=given), show


def _dialect(exc: ApiError) -> ApiError:
    """core names the reasoning switch after the chat dialects' `think`."""
    return renamed(exc, {"think": "thinking"}) if exc.param == "think" else exc


# --- the answer ----------------------------------------------------------------------------------------------------

def _stop_reason(gen: Generation, reason: str | None, calls: int, requested: int) -> tuple[str, str | None]:
    """requested: the client's max_tokens; the server lowers it to what the context has room for."""
    if reason == "length":
        return ("model_context_window_exceeded" if gen.params.max_tokens < requested else "max_tokens"), None
    if calls:
        return "tool_use", None
    stop = gen.stop_reason
    if isinstance(stop, str) and stop in gen.params.stop:
        return "stop_sequence", stop
    return "end_turn", None


def _tool_use(call: ToolCall, with_input: bool = True) -> dict:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": call.arguments if with_input else {}}


class MessageAnswer(Renderer):
    """One Message, whole or as its event stream. Streamed, `message_start` and a `ping` open it at once, a quiet
    stream sends a `ping` now and then, a block opens when the kind of output changes (thought, text, each call) and
    closes before the next; a call's input comes as one input_json_delta (a call max_tokens cuts is dropped:
    stop_reason max_tokens)."""

    fmt = "sse_named"

    def __init__(self, intake: Intake, model: str, show_thinking: bool):
        self.intake, self.model, self.show = intake, model, show_thinking
        self.requested = intake.params.max_tokens if intake.params is not None else 0  # before core caps it
        self.id = f"msg_{uuid.uuid4().hex}"
        self.index = -1
        self.open: str | None = None  # the kind of the block now open
        self.calls = 0
        self.generated = 0

    def _usage(self, gen: Generation, generated: int) -> dict:
        prompt, cached, done = token_counts(gen, generated)
        return {"input_tokens": prompt - cached, "output_tokens": done, "cache_read_input_tokens": cached,
                "cache_creation_input_tokens": 0}

    def _message(self, content: list, stop: tuple[str | None, str | None], usage: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}

    def whole(self, gen: Generation, res: GenerationResult) -> dict:
        piece = res.piece
        content: list[dict] = []
        for kind, value in parts_in_order(piece):
            if kind == "reasoning":
                content.append({"type": "thinking", "thinking": value if self.show else "", "signature": ""})
            elif kind == "text":
                content.append({"type": "text", "text": value})
            else:
                content.append(_tool_use(value))  # type: ignore[arg-type]
        stop = _stop_reason(gen, res.finish_reason, len(piece.calls), self.requested)
        return self._message(content, stop, self._usage(gen, len(res.token_ids)))

    def _open(self, kind: str, value) -> list[dict]:
        events = self._close()
        self.index += 1
        self.open = kind
        block = {"reasoning": {"type": "thinking", "thinking": "", "signature": ""},
                 "text": {"type": "text", "text": ""}}.get(kind) or _tool_use(value, with_input=False)
        return events + [{"type": "content_block_start", "index": self.index, "content_block": block}]

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self.index}]

    def _delta(self, kind: str, value) -> dict:
        if kind == "reasoning":
            delta = {"type": "thinking_delta", "thinking": value if self.show else ""}
        elif kind == "text":
            delta = {"type": "text_delta", "text": value}
        else:
            delta = {"type": "input_json_delta", "partial_json": value.arguments_json}
        return {"type": "content_block_delta", "index": self.index, "delta": delta}

    def opening(self, gen: Generation) -> list:
        return [{"type": "message_start",
                 "message": self._message([], (None, None), {**self._usage(gen, 0), "output_tokens": 0})},
                {"type": "ping"}]  # as Anthropic's own streams begin

    def keepalive(self, gen: Generation) -> list:
        return [{"type": "ping"}]

    def events(self, gen: Generation, out: RequestOutput, piece: Piece) -> list:
        self.generated += len(out.new_token_ids)
        events: list[dict] = []
        finish = output_reason(out)
        for kind, value in parts_in_order(piece):
            if kind != self.open or kind == "call":
                events += self._open(kind, value)
            events.append(self._delta(kind, value))
            self.calls += kind == "call"
        if finish:
            stop_reason, stop_sequence = _stop_reason(gen, finish, self.calls, self.requested)
            events += self._close()
            events.append({"type": "message_delta", "delta": {"stop_reason": stop_reason,
                                                              "stop_sequence": stop_sequence},
                           "usage": self._usage(gen, self.generated)})
            events.append({"type": "message_stop"})
        return events

    def error(self, exc: ApiError) -> dict:
        return error_body(exc.status, exc.message)


# --- routes --------------------------------------------------------------------------------------------------------

async def messages(request: web.Request) -> web.StreamResponse:
    state = state_of(request)
    try:
        intake, show = parse(await read_json(request, state.max_body_bytes), state)
        return await run(request, state, intake, MessageAnswer(intake, intake.model or state.model_name, show))
    except ApiError as exc:
        raise _dialect(exc) from None


async def count_tokens(request: web.Request) -> web.Response:
    state = state_of(request)
    try:
        intake, _ = parse(await read_json(request, state.max_body_bytes), state, count_only=True)
        bound = await state.use_model(request, intake.model)
        ids = (await encode_prompt(bound.require_engine(), bound.with_defaults(intake),
                                   intake.model or state.model_name, bound.template)).ids
    except ApiError as exc:
        raise _dialect(exc) from None
    return web.json_response({"input_tokens": len(ids)})


def setup_routes(app: web.Application) -> None:
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
