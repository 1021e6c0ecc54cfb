"""What a request asks for: its tools, its tool choice, its answer format, and a history with calls and results.

Both chat dialects describe tools the same way (OpenAI's `{"type": "function", "function": {name, description,
parameters}}`, which Ollama copied); they differ in the history: OpenAI's assistant `tool_calls` carry `arguments`
as a JSON string and an `id`, Ollama's an object and no id, and Ollama's tool results name the tool in `tool_name`.
Both are normalised to what chat templates expect (transformers' convention): `tool_calls: [{"id", "type":
"function", "function": {"name", "arguments": <object>}}]` and `{"role": "tool", "content", "tool_call_id", "name"}`.
An assistant turn's reasoning (`reasoning_content`, as llmd and vLLM answer it, `reasoning`, or Ollama's `thinking`)
becomes `thinking`, the key gpt-oss's template reads (others ignore it).

Every check raises ApiError (400) naming the field; bounds keep a request's grammar small.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from ..server.validation import MAX_TEXT_CHARS, bad_field
from .schema import check_keywords

MAX_TOOLS = 128
MAX_TOOLS_BYTES = 256 * 1024  # the tools' JSON, which becomes prompt text and grammar
MAX_SCHEMA_BYTES = 256 * 1024  # a response_format / format / json_schema
MAX_SCHEMA_DEPTH = 32
MAX_GRAMMAR_CHARS = 64 * 1024  # a llama.cpp GBNF grammar
NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


@dataclass(frozen=True)
class Function:
    name: str
    description: str
    parameters: dict  # a JSON schema for the arguments (an object)

    def as_tool(self) -> dict:
        """The OpenAI shape chat templates are written for."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolSpec:
    """choice: "auto" | "none" | "required" | the name of one function."""

    functions: tuple[Function, ...]
    choice: str = "auto"
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.choice not in ("auto", "none")

    def allowed(self) -> tuple[Function, ...]:
        """The functions a call may name under the choice."""
        if self.choice in ("auto", "required", "none"):
            return self.functions
        return tuple(f for f in self.functions if f.name == self.choice)


@dataclass(frozen=True)
class AnswerFormat:
    """A constraint on the answer's text. kind: "json_object" | "json_schema" | "gbnf"; `field` is the request field
    it came from (named in a 400)."""

    kind: str
    text: str
    field: str


def schema_depth(value: Any, depth: int = 0) -> int:
    if depth > MAX_SCHEMA_DEPTH:
        return depth
    if isinstance(value, dict):
        return max((schema_depth(v, depth + 1) for v in value.values()), default=depth)
    if isinstance(value, list):
        return max((schema_depth(v, depth + 1) for v in value), default=depth)
    return depth


def check_schema(schema: Any, where: str, strict: bool = False) -> dict:
    """A JSON schema must be an object, within the size and nesting bounds, that the grammar compiles; what the
    grammar cannot enforce is logged, or refused when the request asks for strict validation (tools.schema)."""
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise bad_field(where, "must be a JSON schema (an object)")
    if len(json.dumps(schema)) > MAX_SCHEMA_BYTES:
        raise bad_field(where, f"must be at most {MAX_SCHEMA_BYTES} bytes of JSON")
    if schema_depth(schema) > MAX_SCHEMA_DEPTH:
        raise bad_field(where, f"may nest at most {MAX_SCHEMA_DEPTH} levels")
    for key in ("type", "properties", "required"):
        value = schema.get(key)
        if key == "type" and value is not None and not isinstance(value, (str, list)):
            raise bad_field(f"{where}.type", "must be a string or an array of strings")
        if key == "properties" and value is not None and not isinstance(value, dict):
            raise bad_field(f"{where}.properties", "must be an object")
        if key == "required" and value is not None and not (isinstance(value, list)
                                                             and all(isinstance(v, str) for v in value)):
            raise bad_field(f"{where}.required", "must be an array of strings")
    check_keywords(schema, where, strict)
    return schema


def tool_list(value: Any, name: str) -> list:
    """A tools array within the bounds (count, bytes of JSON)."""
    if not isinstance(value, list):
        raise bad_field(name, "must be an array of tools")
    if len(value) > MAX_TOOLS:
        raise bad_field(name, f"may hold at most {MAX_TOOLS} tools")
    if len(json.dumps(value)) > MAX_TOOLS_BYTES:
        raise bad_field(name, f"must be at most {MAX_TOOLS_BYTES} bytes of JSON")
    return value


def parse_tool(tool: Any, where: str) -> Function:
    """One tool in the OpenAI shape, `{"type": "function", "function": {name, description, parameters, strict}}`."""
    if not isinstance(tool, dict):
        raise bad_field(where, "must be an object")
    if tool.get("type", "function") != "function":
        raise bad_field(f"{where}.type", "must be \"function\"")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise bad_field(f"{where}.function", "must be an object with a name")
    fname = fn.get("name")
    if not isinstance(fname, str) or not fname:
        raise bad_field(f"{where}.function.name", "is required (a non-empty string)")
    if not NAME_RE.match(fname):
        raise bad_field(f"{where}.function.name", "must be 1-64 letters, digits, '_', '.' or '-'")
    desc = fn.get("description") or ""
    if not isinstance(desc, str):
        raise bad_field(f"{where}.function.description", "must be a string")
    strict = fn.get("strict") or False
    if not isinstance(strict, bool):
        raise bad_field(f"{where}.function.strict", "must be true or false")
    params = fn.get("parameters")
    params = {"type": "object", "properties": {}} if params is None else params
    params = check_schema(params, f"{where}.function.parameters", strict)
    if params.get("type", "object") != "object":
        raise bad_field(f"{where}.function.parameters", "must be a schema of type object")
    return Function(fname, desc, params)


def unique_tools(tools: list[tuple[str, Function]]) -> tuple[Function, ...]:
    """(where, function) pairs: no more than MAX_TOOLS, no name defined twice (the second one's `where` named)."""
    if len(tools) > MAX_TOOLS:
        raise bad_field(tools[MAX_TOOLS][0], f"is one tool too many: at most {MAX_TOOLS} are allowed")
    seen: set[str] = set()
    for where, fn in tools:
        if fn.name in seen:
            raise bad_field(where, f"{fn.name!r} is defined twice")
        seen.add(fn.name)
    return tuple(fn for _, fn in tools)


def parse_tools(value: Any, name: str = "tools") -> tuple[Function, ...]:
    tools = tool_list(value, name)
    return unique_tools([(f"{name}[{i}].function.name", parse_tool(tool, f"{name}[{i}]"))
                         for i, tool in enumerate(tools)])


def parse_tool_choice(value: Any, functions: tuple[Function, ...], name: str = "tool_choice") -> str:
    """OpenAI's tool_choice: "auto" | "none" | "required" | {"type": "function", "function": {"name": ...}}."""
    if value is None:
        return "auto" if functions else "none"
    if isinstance(value, str):
        if value not in ("auto", "none", "required"):
            raise bad_field(name, "must be auto, none, required or {\"type\": \"function\", \"function\": {...}}")
        if value == "required" and not functions:
            raise bad_field(name, "required needs tools")
        return value
    if not isinstance(value, dict) or not isinstance(value.get("function"), dict):
        raise bad_field(name, "must be auto, none, required or {\"type\": \"function\", \"function\": {...}}")
    fname = value["function"].get("name")
    if not isinstance(fname, str) or not any(f.name == fname for f in functions):
        raise bad_field(f"{name}.function.name", f"names no tool in tools: {fname!r}")
    return fname


def _arguments(value: Any, where: str) -> dict:
    """A call's arguments: OpenAI sends a JSON string, Ollama an object; templates want the object."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except ValueError:
            raise bad_field(where, "must be a JSON object (as a string)") from None
    if not isinstance(value, dict):
        raise bad_field(where, "must be a JSON object")
    return value


REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")


def _add_reasoning(src: dict, msg: dict, where: str) -> None:
    """The first reasoning text the turn carries, as `thinking` (another shape under those keys means nothing here)."""
    for key in REASONING_KEYS:
        value = src.get(key)
        if not isinstance(value, str) or not value:
            continue
        if len(value) > MAX_TEXT_CHARS:
            raise bad_field(f"{where}.{key}", f"must be at most {MAX_TEXT_CHARS} characters")
        msg["thinking"] = value
        return


def normalise_history(raw: list, messages: list[dict], name: str = "messages") -> list[dict]:
    """Add the assistant calls and the tool results of `raw` (the request's messages) to `messages` (their text,
    already checked by validation.parse_messages). A tool message must follow a call."""
    out: list[dict] = []
    open_ids: list[str] | None = None  # ids of the last assistant turn's calls, while its results come in
    results = 0
    for i, (src, msg) in enumerate(zip(raw, messages)):
        where = f"{name}[{i}]"
        msg = dict(msg)
        if msg["role"] == "assistant":
            _add_reasoning(src, msg, where)
        if msg["role"] == "assistant" and src.get("tool_calls") is not None:
            calls = src["tool_calls"]
            if not isinstance(calls, list):
                raise bad_field(f"{where}.tool_calls", "must be an array")
            norm = []
            for j, call in enumerate(calls):
                cw = f"{where}.tool_calls[{j}]"
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                    raise bad_field(f"{cw}.function.name", "is required")
                cid = call.get("id") or f"c{i:04d}{j:04d}"  # 9 alphanumerics: what Mistral's templates demand
                if not isinstance(cid, str):
                    raise bad_field(f"{cw}.id", "must be a string")
                norm.append({"id": cid, "type": "function",
                             "function": {"name": fn["name"],
                                          "arguments": _arguments(fn.get("arguments"), f"{cw}.function.arguments")}})
            if norm:
                msg["tool_calls"] = norm
                open_ids, results = [c["id"] for c in norm], 0
            else:
                open_ids = None
        elif msg["role"] == "tool":
            if open_ids is None:
                raise bad_field(f"{where}.role", "a tool message must follow an assistant message with tool_calls")
            cid = src.get("tool_call_id")
            if cid is not None and (not isinstance(cid, str) or (open_ids and cid not in open_ids)):
                raise bad_field(f"{where}.tool_call_id", "names no call of the assistant message before it")
            tname = src.get("tool_name", src.get("name"))
            if tname is not None and not isinstance(tname, str):
                raise bad_field(f"{where}.tool_name", "must be a string")
            if cid is None and results < len(open_ids):  # Ollama's results name no id: the calls' order does
                cid = open_ids[results]
            results += 1
            if cid is not None:
                msg["tool_call_id"] = cid
            if tname is not None:
                msg["name"] = tname
        else:
            open_ids = None
        out.append(msg)
    return out
