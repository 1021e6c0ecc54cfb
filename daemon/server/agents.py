"""What the two agent APIs (Anthropic Messages, OpenAI Responses) share: their flat tool definitions, their checks
of an agent's history, the order of an answer's parts, and errors renamed to the dialect's own field names.

Both APIs define a tool flat (`{name, description, input_schema | parameters}`) where chat completions nest it under
`function`; both keep tool calls and their results as items of their own. Each is turned into the normalised history
of tools.spec (assistant `tool_calls` with arguments as objects, `{"role": "tool", "tool_call_id", "name"}`), so the
tool plans, grammars and parsers of the chat dialects serve them unchanged.
"""

from __future__ import annotations

import json
from typing import Any

from ..tools.parsers import Piece, ToolCall
from ..tools.spec import Function, parse_tool, tool_list, unique_tools
from .core import Generation
from .validation import MAX_TEXT_CHARS, ApiError, bad_field

MAX_BLOCKS = 1024  # content blocks in one message, or items in one Responses input


def renamed(exc: ApiError, renames: dict[str, str]) -> ApiError:
    """The same error with the field names of another shape (e.g. `tools[0].function.parameters` ->
    `tools[0].input_schema`): each `old` part of the param becomes `new`, and so does the param where the message
    names it."""
    if not exc.param:
        return exc
    param = exc.param
    for old, new in renames.items():
        param = param.replace(old, new)
    message = exc.message.replace(exc.param, param, 1)
    return ApiError(exc.status, message, param=param, kind=exc.kind, headers=exc.headers)


def flat_tool(tool: dict, where: str, schema_key: str) -> Function:
    """One flat tool definition `{name, description, <schema_key>, strict}`, its type already judged."""
    nested = {"type": "function", "function": {"name": tool.get("name"), "description": tool.get("description"),
                                               "parameters": tool.get(schema_key), "strict": tool.get("strict")}}
    try:
        return parse_tool(nested, where)
    except ApiError as exc:
        raise renamed(exc, {".function.parameters": f".{schema_key}", ".function.": "."}) from None


def flat_tools(value: Any, name: str, schema_key: str, allowed_types: tuple[str | None, ...]) -> tuple[Function, ...]:
    """Flat tool definitions: any `type` outside `allowed_types` (the provider's hosted tools: web search, code
    execution, ...) is refused naming the field."""
    tools = []
    for i, tool in enumerate(tool_list(value, name)):
        where = f"{name}[{i}]"
        if not isinstance(tool, dict):
            raise bad_field(where, "must be an object")
        if tool.get("type") not in allowed_types:
            raise bad_field(f"{where}.type", f"{tool.get('type')!r} is not supported: only function tools "
                                              "(the client runs them) are")
        tools.append((f"{where}.name", flat_tool(tool, where, schema_key)))
    return unique_tools(tools)


def text_of(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise bad_field(where, "must be a string")
    if len(value) > MAX_TEXT_CHARS:
        raise bad_field(where, f"must be at most {MAX_TEXT_CHARS} characters")
    return value


def call_entry(call_id: Any, name: Any, arguments: Any, where: str, id_key: str, args_key: str) -> dict:
    """One past tool call in the normalised shape; `arguments` is an object (Anthropic) or a JSON string."""
    if not isinstance(call_id, str) or not call_id:
        raise bad_field(f"{where}.{id_key}", "is required (a non-empty string)")
    if not isinstance(name, str) or not name:
        raise bad_field(f"{where}.name", "is required (a non-empty string)")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            raise bad_field(f"{where}.{args_key}", "must be a JSON object (as a string)") from None
    if not isinstance(arguments, dict):
        raise bad_field(f"{where}.{args_key}", "must be a JSON object")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def parts_in_order(piece: Piece) -> list[tuple[str, str | ToolCall]]:
    """A parsed piece as ordered parts: its thought, its text, then its calls (the order a model writes them)."""
    parts: list[tuple[str, str | ToolCall]] = []
    if piece.reasoning:
        parts.append(("reasoning", piece.reasoning))
    if piece.content:
        parts.append(("text", piece.content))
    parts.extend(("call", call) for call in piece.calls)
    return parts


def token_counts(gen: Generation, generated: int) -> tuple[int, int, int]:
    """(prompt tokens, of which read from the prefix cache, generated tokens)."""
    t = gen.timings
    prompt = t.num_prompt_tokens if t and t.num_prompt_tokens else len(gen.prompt_ids)
    cached = t.num_cached_tokens if t else 0
    done = t.num_generated_tokens if t and t.num_generated_tokens else generated
    return prompt, cached, done
