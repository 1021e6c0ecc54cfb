"""OpenAI Responses: `POST /v1/responses`, whole or streamed; `GET` / `DELETE /v1/responses/{id}` for stored ones.

A thin adapter: `instructions` + `input` (a string, or items: messages, function_call, function_call_output) become
the chat dialects' Intake; the parsed output becomes output items (reasoning, message with output_text,
function_call), streamed as Responses events (`response.created`, `response.in_progress`,
`response.output_item.added`, `response.content_part.added`, `response.output_text.delta` / `.done`,
`response.reasoning_text.delta` / `.done`, `response.function_call_arguments.delta` / `.done`,
`response.output_item.done`, then `response.completed`, or `response.incomplete` when max_output_tokens cut it).
Errors take the OpenAI shape, naming the field.

Stored responses (response_store.py): as OpenAI does, a response is stored unless `store` is false, in memory and
bounded (the last 256, 32 MiB of conversation); `previous_response_id` continues one (its conversation with its
answer, without its instructions), and names no stored response -> 400.

Namespaces (Codex groups its MCP tools so): a `{"type": "namespace", "name", "tools": [function tools]}` is
flattened into its functions, each named for the model as Codex flattens them (`ToolName`'s canonical flat name):
the namespace and the function's name joined by `__`, stray underscores at the joint trimmed (`mcp__docs` +
`search` -> `mcp__docs__search`). A call the model makes comes back as OpenAI returns it, the function's own `name`
with its `namespace` beside it (Codex routes calls by the pair); a function_call item sent back with a namespace is
shown to the model under the joined name. tool_choice names such a function by its joined name, by `name` with
`namespace`, or by its bare name when only one namespace has it.

Field rules (what the API accepts and has no meaning here is accepted and ignored, the fields named in one DEBUG
line; only what would silently change the answer is refused):
- honoured: model, input, instructions, previous_response_id, store, tools (function tools and namespaces of them),
  tool_choice (auto, none, required, a function), parallel_tool_calls, max_output_tokens (a ceiling: generation also
  ends at the context's end), temperature, top_p, text.format (text, json_object, json_schema; schemas compile
  leniently, `strict: true` refuses what the grammar cannot enforce: tools.schema; the same for a tool's
  `strict`), reasoning.effort (none: thinking off; minimal..max: on; absent: the template's default; a hint, so a
  model without thinking ignores it; a template that reads `reasoning_effort`, gpt-oss's, gets it as low, medium
  or high: tools.plan), stream, metadata (echoed back).
- accepted with no effect, since they steer OpenAI's hosted service: user, safety_identifier, prompt_cache_key,
  prompt_cache_retention, service_tier, client_metadata, include (nothing is encrypted, so there is nothing to
  include), truncation "disabled", text.verbosity, reasoning.summary / generate_summary (the thought is returned
  whole as reasoning_text), stream_options, and any field this list does not name.
- left out with one WARNING line per request: tools the daemon cannot offer the model, hosted ones (web_search,
  file_search, code_interpreter, computer_use_preview, image_generation, mcp, tool_search, ...) and those whose
  calls are items other than function calls (local_shell, shell, apply_patch, custom), in a namespace too.
- refused with a 400 naming the field: conversation, background, prompt (stored prompt templates), truncation
  "auto", top_logprobs, max_tool_calls, a tool_choice naming a hosted tool, input items other than messages,
  function calls and their outputs (a reasoning item's reasoning_text goes with the assistant turn after it as
  `thinking`, which gpt-oss's template shows with a call and others ignore; so does a stored response's),
  content parts other than text, and a function_call_output whose call_id names no function_call before it (in the
  input or the continued response).
"""

from __future__ import annotations

import copy
import json
import logging
import time
import uuid
from typing import Any

from aiohttp import web

from ..engine.types import RequestOutput, SamplingParams
from ..tools.parsers import Piece, ToolCall
from ..tools.spec import AnswerFormat, Function, ToolSpec, check_schema, tool_list, unique_tools
from .agents import MAX_BLOCKS, call_entry, flat_tool, parts_in_order, renamed, text_of, token_counts
from .core import Generation, GenerationResult, Renderer, ServerState, output_reason, run, state_of
from .intake import ChatPrompt, Intake, checked_params, given_fields
from .response_store import ResponseStore
from .validation import (TEXT, TOP_P, ApiError, Field, bad_field, check_fields, log_ignored, message_content,
                         read_json, require)

log = logging.getLogger("llmd.server")

DEFAULT_MAX_TOKENS = 2048
FIELDS = {
    "model": Field("str", max_len=512),
    "instructions": TEXT,
    "max_output_tokens": Field("int", 1, 1 << 20),  # a ceiling: generation also ends at the context's end
    "temperature": Field("number", 0, 2),
    "top_p": TOP_P,
    "stream": Field("bool"),
    "store": Field("bool"),
    "parallel_tool_calls": Field("bool"),
    "metadata": Field("dict"),
    "text": Field("dict"),
    "reasoning": Field("dict"),
    "stream_options": Field("dict"),
    "include": Field("list", max_len=64),
    "truncation": Field("str", choices=("auto", "disabled")),
    "user": Field("str", max_len=512),
    "safety_identifier": Field("str", max_len=512),
    "prompt_cache_key": Field("str", max_len=1024),
    "service_tier": Field("str", max_len=64),
}
REFUSED = {
    "conversation": "(the Conversations API) is not supported: send the conversation as input, or continue a stored "
                    "response with previous_response_id",
    "prompt": "(stored prompt templates) is not supported",
    "background": "is not supported: responses run in the foreground",
    "top_logprobs": "is not supported on /v1/responses",
    "max_tool_calls": "is not supported: use parallel_tool_calls false for at most one call",
}
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
HONOURED = ("model", "input", "instructions", "previous_response_id", "store", "tools", "tool_choice",
            "parallel_tool_calls", "max_output_tokens", "temperature", "top_p", "text", "reasoning", "stream",
            "metadata", "truncation")


# --- the request ---------------------------------------------------------------------------------------------------

def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return text_of(content, where)
    if not isinstance(content, list):
        raise bad_field(where, "must be a string or an array of content parts")
    if len(content) > MAX_BLOCKS:
        raise bad_field(where, f"may hold at most {MAX_BLOCKS} parts")
    texts = []
    for j, part in enumerate(content):
        pw = f"{where}[{j}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise bad_field(pw, "must be an object with a type")
        if part["type"] in ("input_text", "output_text", "text"):
            texts.append(text_of(part.get("text"), f"{pw}.text"))
        elif part["type"] == "refusal":
            texts.append(text_of(part.get("refusal"), f"{pw}.refusal"))
        else:
            raise bad_field(f"{pw}.type", f"{part['type']!r} is not supported (text parts only)")
    return "".join(texts)


ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


def conversation(body: dict, previous: list[dict] | None = None) -> list[dict]:
    """The stored conversation of previous_response_id (if any) and `input` in the normalised history: consecutive
    function_call items join the assistant turn before them, function_call_output items become tool messages."""
    require(body, "input")
    out: list[dict] = list(previous or [])
    items = body["input"]
    if isinstance(items, str):
        return out + [{"role": "user", "content": text_of(items, "input")}]
    if not isinstance(items, list) or not items:
        raise bad_field("input", "must be a string or a non-empty array of items")
    if len(items) > MAX_BLOCKS:
        raise bad_field("input", f"may hold at most {MAX_BLOCKS} items")
    calls = {c["id"]: c["function"]["name"] for m in out for c in m.get("tool_calls", [])}  # call_id -> name
    thought = ""  # reasoning items' text, for the assistant turn after them
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_field(where, "must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = ROLES.get(item.get("role"))
            if role is None:
                raise bad_field(f"{where}.role", "must be user, assistant, system or developer")
            content = item.get("content")
            if role == "user" and isinstance(content, list) and any(
                    isinstance(p, dict) and p.get("type") == "input_image" for p in content):
                out.append({"role": role, "content": message_content(content, f"{where}.content")})  # with images
            else:
                out.append({"role": role, "content": _content_text(content, f"{where}.content")})
            if role == "assistant" and thought:
                out[-1]["thinking"] = thought
            thought = ""
        elif kind == "function_call":
            call = call_entry(item.get("call_id"), _call_name(item, where), item.get("arguments"), where,
                              "call_id", "arguments")
            if not (out and out[-1]["role"] == "assistant"):
                out.append({"role": "assistant", "content": ""})
            # a new dict: a stored turn this call continues stays as it was stored
            out[-1] = {**out[-1], "tool_calls": [*out[-1].get("tool_calls", []), call]}
            if thought:
                out[-1]["thinking"], thought = thought, ""
            calls[call["id"]] = call["function"]["name"]
        elif kind == "function_call_output":
            cid = item.get("call_id")
            if not isinstance(cid, str) or cid not in calls:
                raise bad_field(f"{where}.call_id", "names no function_call item before it")
            out.append({"role": "tool", "content": _content_text(item.get("output"), f"{where}.output"),
                        "tool_call_id": cid, "name": calls[cid]})
        elif kind == "reasoning":
            thought += _reasoning_text(item, where)
        else:
            raise bad_field(f"{where}.type", f"{kind!r} is not supported (message, function_call, "
                                             "function_call_output, reasoning)")
    return out


def _reasoning_text(item: dict, where: str) -> str:
    """A reasoning item's reasoning_text parts (its summary and encrypted content mean nothing here)."""
    parts = item.get("content")
    if not isinstance(parts, list):
        return ""
    if len(parts) > MAX_BLOCKS:
        raise bad_field(f"{where}.content", f"may hold at most {MAX_BLOCKS} parts")
    return "".join(text_of(p.get("text"), f"{where}.content[{j}].text") for j, p in enumerate(parts)
                   if isinstance(p, dict) and p.get("type") == "reasoning_text")


def instructions(body: dict) -> list[dict]:
    """`instructions` as the system turn; those of a previous response are not carried on (as OpenAI does)."""
    if body.get("instructions") is None:
        return []
    return [{"role": "system", "content": text_of(body["instructions"], "instructions")}]


def history(body: dict, previous: list[dict] | None = None) -> list[dict]:
    return instructions(body) + conversation(body, previous)


def joined(namespace: str, name: str) -> str:
    """A namespace's function as the model sees it (Codex's flat name for it)."""
    return f"{namespace.rstrip('_')}__{name.lstrip('_')}"


def _call_name(item: dict, where: str) -> Any:
    """A function_call item's name as the model saw it: joined with its namespace, if it has one."""
    namespace, name = item.get("namespace"), item.get("name")
    if namespace is None or not isinstance(name, str) or not name:
        return name  # call_entry names what is wrong with the name
    if not isinstance(namespace, str) or not namespace:
        raise bad_field(f"{where}.namespace", "must be a non-empty string")
    return joined(namespace, name)


Namespaced = dict[str, tuple[str, str]]  # joined name -> (namespace, the function's own name)


def function_tools(value: Any) -> tuple[tuple[Function, ...], Namespaced]:
    """The function tools, with the functions of each namespace under their joined names. Tools of other types are
    left out, named in one warning."""
    tools: list[tuple[str, Function]] = []
    namespaced: Namespaced = {}
    left_out: list[str] = []
    for i, tool in enumerate(tool_list(value, "tools")):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad_field(where, "must be an object")
        if tool.get("type") == "function":
            tools.append((f"{where}.name", flat_tool(tool, where, "parameters")))
        elif tool.get("type") == "namespace":
            namespace, members = tool.get("name"), tool.get("tools")
            if not isinstance(namespace, str) or not namespace:
                raise bad_field(f"{where}.name", "is required (a non-empty string)")
            for j, member in enumerate(tool_list(members, f"{where}.tools")):
                mw = f"{where}.tools[{j}]"
                if not isinstance(member, dict):
                    raise bad_field(mw, "must be an object")
                if member.get("type") != "function":
                    left_out.append(f"{member.get('type')} (in namespace {namespace})")
                    continue
                name = member.get("name")
                if not isinstance(name, str) or not name:
                    raise bad_field(f"{mw}.name", "is required (a non-empty string)")
                fn = flat_tool({**member, "name": joined(namespace, name)}, mw, "parameters")
                namespaced[fn.name] = (namespace, name)
                tools.append((f"{mw}.name", fn))
        else:
            left_out.append(str(tool.get("type")))
    if left_out:
        log.warning("/v1/responses: tools left out (only function tools, which the client runs, are served here): "
                    "%s", ", ".join(left_out))
    return unique_tools(tools), namespaced


def _chosen(value: dict, functions: tuple[Function, ...], namespaced: Namespaced) -> str:
    """The function a tool_choice names: by its joined name, by name and namespace, or by a bare name only one
    namespace has."""
    name, namespace = value.get("name"), value.get("namespace")
    if isinstance(name, str) and isinstance(namespace, str):
        name = joined(namespace, name)
    if isinstance(name, str) and any(fn.name == name for fn in functions):
        return name
    bare = [flat for flat, (_, own) in namespaced.items() if own == name]
    if len(bare) > 1:
        raise bad_field("tool_choice.name", f"{name!r} is in several namespaces ({', '.join(bare)}): name one")
    if not bare:
        raise bad_field("tool_choice.name", f"names no tool in tools: {name!r}")
    return bare[0]


def tool_spec(body: dict, f: dict) -> tuple[ToolSpec | None, Namespaced]:
    """The tools and the choice, and which of the tools are namespaced."""
    functions: tuple[Function, ...] = ()
    namespaced: Namespaced = {}
    if body.get("tools") is not None:
        functions, namespaced = function_tools(body["tools"])
    value = body.get("tool_choice")
    if value is None:
        choice = "auto" if functions else "none"
    elif isinstance(value, str):
        if value not in ("auto", "none", "required"):
            raise bad_field("tool_choice", "must be auto, none, required or {\"type\": \"function\", \"name\": ...}")
        if value == "required" and not functions:
            raise bad_field("tool_choice", "required needs tools")
        choice = value
    elif isinstance(value, dict) and value.get("type") == "function":
        choice = _chosen(value, functions, namespaced)
    else:
        raise bad_field("tool_choice", "must be auto, none, required or {\"type\": \"function\", \"name\": ...}")
    spec = ToolSpec(functions, choice, f.get("parallel_tool_calls", True)) if functions else None
    return spec, namespaced


def answer_format(f: dict) -> AnswerFormat | None:
    text = f.get("text") or {}
    if text.get("verbosity") not in (None, "low", "medium", "high"):
        raise bad_field("text.verbosity", "must be low, medium or high")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in ("text", "json_object", "json_schema"):
        raise bad_field("text.format", "must be {\"type\": \"text\" | \"json_object\" | \"json_schema\", ...}")
    if kind == "text":
        return None
    if kind == "json_object":
        return AnswerFormat("json_object", "", "text.format")
    if not isinstance(fmt.get("name"), str) or not fmt["name"]:
        raise bad_field("text.format.name", "is required (a string)")
    strict = fmt.get("strict") or False
    if not isinstance(strict, bool):
        raise bad_field("text.format.strict", "must be true or false")
    schema = check_schema(fmt.get("schema"), "text.format.schema", strict)
    return AnswerFormat("json_schema", json.dumps(schema, ensure_ascii=False), "text.format")


def reasoning(f: dict) -> bool | None:
    effort = (f.get("reasoning") or {}).get("effort")
    if effort is None:
        return None
    if effort not in EFFORTS:
        raise bad_field("reasoning.effort", "must be one of " + ", ".join(EFFORTS))
    return effort != "none"


def previous_conversation(body: dict, store: ResponseStore) -> list[dict] | None:
    rid = body.get("previous_response_id")
    if rid is None:
        return None
    if not isinstance(rid, str):
        raise bad_field("previous_response_id", "must be a string")
    stored = store.get(rid)
    if stored is None:
        raise bad_field("previous_response_id", f"names no stored response: {rid!r} (this daemon keeps the last "
                                                f"{store.max_responses}, in memory)")
    return stored.conversation


def parse(body: dict, state: ServerState, store: ResponseStore) -> tuple[Intake, list[dict], Namespaced]:
    """The Intake, the conversation a stored answer continues (without the instructions), and the namespaced
    tools."""
    for name, why in REFUSED.items():
        if body.get(name) not in (None, "", [], {}):
            raise bad_field(name, why)
    f = check_fields(body, FIELDS)
    if f.get("truncation") == "auto":
        raise bad_field("truncation", "auto is not supported: a conversation too long for the context is a 400")
    state.check_model(f.get("model"))
    log_ignored(body, HONOURED, "/v1/responses")
    conv = conversation(body, previous_conversation(body, store))
    tools, namespaced = tool_spec(body, f)
    prompt = ChatPrompt(instructions(body) + conv, tools, think=reasoning(f), think_hint=True,
                        effort=(f.get("reasoning") or {}).get("effort"))
    params = checked_params(SamplingParams(
        max_tokens=f.get("max_output_tokens", DEFAULT_MAX_TOKENS), temperature=float(f.get("temperature", 1.0)),
        top_p=float(f.get("top_p", 1.0)) or 1e-6))
    given = given_fields(f, {"max_output_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p"})
    return Intake(f.get("model"), prompt, params, bool(f.get("stream")), length_field="input",
                  answer=answer_format(f), given=given), conv, namespaced


def _dialect(exc: ApiError) -> ApiError:
    """core names the reasoning switch after the chat dialects' `think`."""
    return renamed(exc, {"think": "reasoning.effort"}) if exc.param == "think" else exc


# --- the answer ----------------------------------------------------------------------------------------------------

def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def answer_turns(items: list[dict]) -> list[dict]:
    """A response's output items as the assistant turn of the normalised history (its thought as `thinking`)."""
    text = "".join(c["text"] for i in items if i["type"] == "message" for c in i["content"])
    thought = "".join(c["text"] for i in items if i["type"] == "reasoning" for c in i["content"])
    calls = [{"id": i["call_id"], "type": "function",
              "function": {"name": joined(i["namespace"], i["name"]) if i.get("namespace") else i["name"],
                           "arguments": json.loads(i["arguments"] or "{}")}}
             for i in items if i["type"] == "function_call"]
    turn: dict = {"role": "assistant", "content": text}
    if thought:
        turn["thinking"] = thought
    if calls:
        turn["tool_calls"] = calls
    return [turn]


class ResponseAnswer(Renderer):
    """One Response, whole or as its event stream. Streamed, `response.created` and `response.in_progress` open it
    at once (a quiet stream then sends SSE comments), an output item opens when the kind of output changes (thought,
    text, each call) and is done before the next opens. When max_output_tokens cuts the answer, the response and
    its last text or thought are incomplete; a call comes only whole (one it cuts is dropped)."""

    fmt = "sse_named"

    def __init__(self, intake: Intake, body: dict, model: str, store: ResponseStore | None = None,
                 conv: list[dict] | None = None, namespaced: Namespaced | None = None):
        """store: where the finished response goes (None: not stored); conv: the conversation it answers;
        namespaced: the tools that are a namespace's functions."""
        self.intake, self.body, self.model = intake, body, model
        self.store, self.conv = store, conv or []
        self.namespaced = namespaced or {}
        self.id, self.created = _id("resp"), int(time.time())
        self.seq = 0
        self.items: list[dict] = []  # output items so far (streamed: the open one is the last)
        self.open: str | None = None
        self.generated = 0

    # the Response object
    def response(self, gen: Generation, status: str, generated: int | None) -> dict:
        b = self.body
        fmt = (b.get("text") or {}).get("format") or {"type": "text"}
        out = {"id": self.id, "object": "response", "created_at": self.created, "status": status,
               "model": self.model, "output": list(self.items), "error": None,
               "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
               "instructions": b.get("instructions"), "metadata": b.get("metadata") or {},
               "max_output_tokens": b.get("max_output_tokens"), "parallel_tool_calls": b.get("parallel_tool_calls",
                                                                                            True),
               "temperature": b.get("temperature", 1.0), "top_p": b.get("top_p", 1.0),
               "tool_choice": b.get("tool_choice", "auto"), "tools": b.get("tools") or [],
               "text": {"format": fmt}, "reasoning": b.get("reasoning") or {"effort": None, "summary": None},
               "store": self.store is not None, "previous_response_id": b.get("previous_response_id"),
               "truncation": "disabled", "usage": None}
        if generated is not None:
            prompt, cached, done = token_counts(gen, generated)
            thought = sum(len(gen.engine.tokenizer.encode(i["content"][0]["text"], add_special_tokens=False))
                          for i in self.items if i["type"] == "reasoning" and i["content"])
            out["usage"] = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
                            "output_tokens": done, "output_tokens_details": {"reasoning_tokens": min(thought, done)},
                            "total_tokens": prompt + done}
        return out

    @staticmethod
    def _status(finish: str | None) -> str:
        return "incomplete" if finish == "length" else "completed"

    # items, whole
    @staticmethod
    def _reasoning(text: str, status: str = "completed") -> dict:
        return {"type": "reasoning", "id": _id("rs"), "summary": [], "status": status,
                "content": [{"type": "reasoning_text", "text": text}] if text else []}

    @staticmethod
    def _message(text: str | None, status: str = "completed") -> dict:
        content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        return {"type": "message", "id": _id("msg"), "role": "assistant", "status": status, "content": content}

    def _call(self, call: ToolCall, status: str = "completed") -> dict:
        item = {"type": "function_call", "id": _id("fc"), "call_id": call.id, "name": call.name,
                "arguments": call.arguments_json if status == "completed" else "", "status": status}
        if call.name in self.namespaced:  # as OpenAI returns it: the function's own name, its namespace beside it
            item["namespace"], item["name"] = self.namespaced[call.name]
        return item

    def whole(self, gen: Generation, res: GenerationResult) -> dict:
        for kind, value in parts_in_order(res.piece):
            self.items.append(self._reasoning(value) if kind == "reasoning" else self._message(value)
                              if kind == "text" else self._call(value))  # type: ignore[arg-type]
        status = self._status(res.finish_reason)
        if self.items and status == "incomplete" and self.items[-1]["type"] != "function_call":
            self.items[-1]["status"] = "incomplete"  # the text max_output_tokens cut
        return self._stored(self.response(gen, status, len(res.token_ids)))

    def _stored(self, response: dict) -> dict:
        """Keep the finished response (and its conversation with the answer) when asked to."""
        if self.store is not None:
            self.store.put(response, self.conv + answer_turns(self.items))
        return response

    # items, streamed
    def _event(self, kind: str, **fields) -> dict:
        self.seq += 1  # items change as text arrives: each event holds a copy of them as they are now
        return {"type": kind, "sequence_number": self.seq - 1, **copy.deepcopy(fields)}

    def _start(self, kind: str, value) -> list[dict]:
        events = self._finish_item()
        self.open = kind
        item = (self._reasoning("", "in_progress") if kind == "reasoning" else
                self._message(None, "in_progress") if kind == "text" else self._call(value, "in_progress"))
        self.items.append(item)
        index = len(self.items) - 1
        events.append(self._event("response.output_item.added", output_index=index, item=dict(item)))
        if kind == "text":
            item["content"].append({"type": "output_text", "text": "", "annotations": [], "logprobs": []})
            events.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                      content_index=0, part=dict(item["content"][0])))
        elif kind == "reasoning":
            item["content"].append({"type": "reasoning_text", "text": ""})
        return events

    def _delta(self, kind: str, value) -> list[dict]:
        item, index = self.items[-1], len(self.items) - 1
        if kind == "call":
            item["arguments"] = value.arguments_json
            return [self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                delta=item["arguments"])]
        item["content"][0]["text"] += value
        name = "response.output_text.delta" if kind == "text" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "text" else {}
        return [self._event(name, item_id=item["id"], output_index=index, content_index=0, delta=value, **extra)]

    def _finish_item(self, status: str = "completed") -> list[dict]:
        if self.open is None:
            return []
        kind, self.open = self.open, None
        item, index = self.items[-1], len(self.items) - 1
        item["status"] = "completed" if kind == "call" else status  # calls come only whole
        ids = {"item_id": item["id"], "output_index": index}
        if kind == "call":
            events = [self._event("response.function_call_arguments.done", **ids, name=item["name"],
                                  arguments=item["arguments"])]
        elif kind == "text":
            part = item["content"][0]
            events = [self._event("response.output_text.done", **ids, content_index=0, text=part["text"],
                                  logprobs=[]),
                      self._event("response.content_part.done", **ids, content_index=0, part=dict(part))]
        else:
            events = [self._event("response.reasoning_text.done", **ids, content_index=0,
                                  text=item["content"][0]["text"])]
        return events + [self._event("response.output_item.done", output_index=index, item=dict(item))]

    def opening(self, gen: Generation) -> list:
        head = self.response(gen, "in_progress", None)
        return [self._event("response.created", response=head), self._event("response.in_progress", response=head)]

    def events(self, gen: Generation, out: RequestOutput, piece: Piece) -> list:
        self.generated += len(out.new_token_ids)
        events: list[dict] = []
        finish = output_reason(out)
        for kind, value in parts_in_order(piece):
            if kind != self.open or kind == "call":
                events += self._start(kind, value)
            events += self._delta(kind, value)
        if finish:
            status = self._status(finish)
            events += self._finish_item(status)
            response = self._stored(self.response(gen, status, self.generated))
            events.append(self._event(f"response.{status}", response=response))
        return events

    def error(self, exc: ApiError) -> dict:
        return self._event("error", code="server_error", message=exc.message, param=exc.param)


STORE = web.AppKey("llmd_response_store", ResponseStore)


async def create_response(request: web.Request) -> web.StreamResponse:
    state, store = state_of(request), request.app[STORE]
    body = await read_json(request, state.max_body_bytes)
    try:
        intake, conv, namespaced = parse(body, state, store)
        keep = store if body.get("store", True) else None  # OpenAI stores by default
        answer = ResponseAnswer(intake, body, intake.model or state.model_name, keep, conv, namespaced)
        return await run(request, state, intake, answer)
    except ApiError as exc:
        raise _dialect(exc) from None


def _stored(request: web.Request):
    rid = request.match_info["response_id"]
    stored = request.app[STORE].get(rid)
    if stored is None:
        raise ApiError(404, f"no stored response {rid!r}", param="response_id", kind="not_found_error")
    return rid, stored


async def get_response(request: web.Request) -> web.Response:
    _, stored = _stored(request)
    return web.json_response(stored.response)


async def delete_response(request: web.Request) -> web.Response:
    rid, _ = _stored(request)
    request.app[STORE].delete(rid)
    return web.json_response({"id": rid, "object": "response", "deleted": True})


def setup_routes(app: web.Application) -> None:
    app[STORE] = ResponseStore()
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/responses/{response_id}", get_response)
    app.router.add_delete("/v1/responses/{response_id}", delete_response)
