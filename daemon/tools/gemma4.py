"""Gemma 4's tool calls and thoughts: its own call syntax, read from the output and written by a grammar.

What the model writes (its markers are special tokens the tokenizer shows, model/tokenizer.py):
- a thought: `<|channel>thought\\n ... <channel|>`, then the answer. The template opens none (thinking on: the
  system turn starts with <|think|>), closes an empty one itself when thinking is off, and opens one after tool
  results when it is on (the prompt then ends inside it);
- calls: `<|tool_call>call:NAME{ARGS}<tool_call|>`, one after another, then `<|tool_response>`, an end of
  generation (the results come back in the same model turn). ARGS is not JSON: `key:value` pairs separated by
  commas, keys bare, strings between `<|"|>` delimiters (a special token, so a string may hold any text),
  numbers, true, false, null, `{...}` objects with bare keys and `[...]` arrays, as the template writes past calls.

A grammar keeps a call to the tools' schemas: the parameters in the template's order (sorted by name), the required
ones always, each value of its schema's type (an enum's strings as listed); objects and arrays are any value of the
syntax. The thought stays free and optional.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection

from .parsers import TaggedParser, ToolCall
from .schema import prepared
from .spec import Function

QUOTE = '<|"|>'
THOUGHT_TAGS = ("<|channel>thought\n", "<channel|>")
CALL_TAGS = ("<|tool_call>", "<tool_call|>")
MAX_DEPTH = 32  # nesting of a call's arguments

_CALL = re.compile(r"^\s*call:([A-Za-z0-9_.\-]{1,64})\s*(\{.*\})\s*$", re.S)
_KEY = re.compile(r"[A-Za-z0-9_.\-$]+")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_WORDS = (("true", True), ("false", False), ("null", None))


class _Reader:
    """A recursive-descent reader of one value of the call syntax; ValueError on anything else."""

    def __init__(self, text: str):
        self.text, self.at = text, 0

    def _skip(self) -> None:
        while self.at < len(self.text) and self.text[self.at] in " \t\r\n":
            self.at += 1

    def _take(self, literal: str) -> bool:
        self._skip()
        if self.text.startswith(literal, self.at):
            self.at += len(literal)
            return True
        return False

    def _string(self) -> str:
        end = self.text.find(QUOTE, self.at)
        if end < 0:
            raise ValueError("an unclosed string")
        value, self.at = self.text[self.at:end], end + len(QUOTE)
        return value

    def value(self, depth: int = 0):
        if depth > MAX_DEPTH:
            raise ValueError("too deep")
        if self._take(QUOTE):
            return self._string()
        if self._take("{"):
            return self._mapping(depth + 1)
        if self._take("["):
            return self._sequence(depth + 1)
        for word, value in _WORDS:
            if self._take(word):
                return value
        m = _NUMBER.match(self.text, self.at)
        if not m:
            raise ValueError(f"no value at {self.at}")
        self.at = m.end()
        return float(m.group()) if any(c in m.group() for c in ".eE") else int(m.group())

    def _key(self) -> str:
        if self._take(QUOTE):  # the template quotes keys inside tool declarations; accept them here too
            return self._string()
        m = _KEY.match(self.text, self.at)
        if not m:
            raise ValueError(f"no key at {self.at}")
        self.at = m.end()
        return m.group()

    def _mapping(self, depth: int) -> dict:
        out: dict = {}
        if self._take("}"):
            return out
        while True:
            self._skip()
            key = self._key()
            if not self._take(":"):
                raise ValueError("a key without ':'")
            out[key] = self.value(depth)
            if self._take("}"):
                return out
            if not self._take(","):
                raise ValueError("no ',' or '}' after a value")

    def _sequence(self, depth: int) -> list:
        out: list = []
        if self._take("]"):
            return out
        while True:
            out.append(self.value(depth))
            if self._take("]"):
                return out
            if not self._take(","):
                raise ValueError("no ',' or ']' after an item")

    def whole(self):
        value = self.value()
        self._skip()
        if self.at != len(self.text):
            raise ValueError("text after the value")
        return value


def parse_arguments(text: str) -> dict | None:
    """`{key:value,...}` in the call syntax as a dict; None when it is not that."""
    try:
        value = _Reader(text).whole()
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def parse_call(body: str, names: Collection[str]) -> ToolCall | None:
    """`call:NAME{ARGS}` (a call's body, between its markers) naming one of `names`; None otherwise."""
    m = _CALL.match(body)
    if not m or m.group(1) not in names:
        return None
    args = parse_arguments(m.group(2))
    return None if args is None else ToolCall(m.group(1), args)


class Gemma4Parser(TaggedParser):
    """Calls between Gemma 4's call markers, anywhere in the answer; the rest as TaggedParser (text before a call is
    content, a malformed call is given back as text, a cut one dropped). Calls come whole at their closing marker."""

    def __init__(self, names: Collection[str]):
        super().__init__(names, *CALL_TAGS)

    def _body(self, body: str) -> list[ToolCall] | None:
        call = parse_call(body, self.names)
        return [call] if call else None


# ---- the grammar -----------------------------------------------------------------------------------------------

# any value of the syntax (lark; <|"|> and the markers are special tokens, written as such)
VALUE_RULES = [
    "g4_value: g4_str | G4_NUM | \"true\" | \"false\" | \"null\" | g4_obj | g4_arr",
    'g4_str: <|"|> G4_TEXT <|"|>',
    "G4_TEXT: /(.|\\n)*/",
    "G4_NUM: /-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?/",
    "G4_INT: /-?(0|[1-9][0-9]*)/",
    'g4_obj: "{" (g4_pair ("," g4_pair)*)? "}"',
    'g4_pair: G4_KEY ":" g4_value',
    "G4_KEY: /[A-Za-z0-9_]+/",
    'g4_arr: "[" (g4_value ("," g4_value)*)? "]"',
]
_BY_TYPE = {"string": "g4_str", "integer": "G4_INT", "number": "G4_NUM", "boolean": '("true" | "false")',
            "null": '"null"', "object": "g4_obj", "array": "g4_arr"}


def _value(schema) -> str:
    """The grammar of one parameter's value, by its schema's type (any value where the schema says no one type)."""
    schema = schema if isinstance(schema, dict) else {}
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        return '<|"|> (' + " | ".join(json.dumps(v) for v in enum) + ') <|"|>'
    kind = schema.get("type")
    return _BY_TYPE.get(kind, "g4_value") if isinstance(kind, str) else "g4_value"


def _function(i: int, fn: Function) -> list[str]:
    """`call:NAME{...}`: the parameters sorted by name, each after a comma but the first, optional ones may be left
    out. s_i_k: the parameters from the k-th on, the first of those written having no comma."""
    params = prepared(fn.parameters)
    props = sorted((params.get("properties") or {}).items())
    required = set(params.get("required") or [])
    rules = [f"p_{i}_{k}: {json.dumps(name + ':')} {_value(schema)}" for k, (name, schema) in enumerate(props)]

    def rest(k: int) -> str:
        return " ".join(f'("," p_{i}_{j})' + ("" if props[j][0] in required else "?") for j in range(k, len(props)))

    k = 0
    while k < len(props):  # s_i_k, and s_i_{k+1} only while the k-th may be left out
        head = f"p_{i}_{k} {rest(k + 1)}".strip()
        if props[k][0] in required or k + 1 == len(props):
            rules.append(f"s_{i}_{k}: {head}")
            break
        rules.append(f"s_{i}_{k}: {head} | s_{i}_{k + 1}")
        k += 1
    args = "" if not props else f"s_{i}_0" + ("" if required & {n for n, _ in props} else "?")
    rules.append(f"fn_{i}: {json.dumps('call:' + fn.name + '{')} {args} \"}}\"")
    return rules


def call_rules(fns: tuple[Function, ...], many: bool) -> list[str]:
    """Rules defining `calls`: one call, or calls one after another when `many`."""
    rules = [rule for i, fn in enumerate(fns) for rule in _function(i, fn)]
    rules.append("fn: " + " | ".join(f"fn_{i}" for i in range(len(fns))))
    rules.append("call: <|tool_call> fn <tool_call|>")
    rules.append("calls: call+" if many else "calls: call")
    return rules + VALUE_RULES


def thought_rules(opened: bool) -> list[str]:
    """`think`: a free thought up to the channel's end, its opening written by the model unless the prompt has it."""
    opener = "" if opened else '<|channel> "thought\\n" '
    return [f"think: {opener}G4_THOUGHT <channel|>", "G4_THOUGHT: /(.|\\n)*/"]
