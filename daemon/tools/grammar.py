"""The constraints the server composes for the engine (llguidance grammars: JSON schema, GBNF, lark).

- An answer format alone is a JSON schema (or the client's GBNF) as it is.
- Tool calls are a lark grammar: the family's markers around `%json {...}` bodies that validate against each
  allowed tool's parameters; `required` or a named function allows only calls, the generic fallback's `auto` allows
  text (or the answer format) as the other alternative.
- A named function is exactly one call, whatever parallel_tool_calls says: the grammar is complete after it, so
  the engine stops there. `auto` and `required` with parallel calls allow call after call; the output parser ends
  the answer at a call that repeats an earlier one (tools/parsers.py), and the server stops the request there.
- A reasoning model's thought stays free: a lazy `<think> ... </think>` rule comes first, the answer rule after it.
- Gemma 4 writes calls in its own syntax, between special-token markers (gemma4.py), and its thought, in a
  `<|channel>thought` channel, may be left out.
- Harmony (gpt-oss) writes messages framed by special tokens, which the grammar names as tokens (`<|channel|>`):
  an optional free `analysis` message, then the answer: a `final` message (its text, or the answer format), or one
  call, `commentary to=functions.NAME <|constrain|>json` with the arguments' JSON as its body. One call: its
  <|call|> ends the generation (the next call comes in the next turn, after the result).

JSON inside the grammars is compact (llguidance's `whitespace_flexible: false`): small models otherwise tend to
emit whitespace until max_tokens, and compact JSON is still JSON to every client. Schemas compile leniently, after
tools.schema's exact rewrites: a keyword the library does not implement is left out (the request's check logged it,
or refused it under `strict`). A tool's arguments get an `$id` inside the call's body, so their `$ref`s resolve
against them.

The engine compiles them (AsyncEngine.compile_constraint); an invalid or unsatisfiable one is a 400 naming the request
field (core.run).
"""

from __future__ import annotations

import json

from ..engine.types import Constraint
from . import gemma4
from .families import THINK_TAGS, ToolFormat
from .schema import prepared
from .spec import AnswerFormat, Function, ToolSpec

COMPACT = {"whitespace_flexible": False, "whitespace_pattern": None}  # None: not the engine's default


def _compact(schema: dict) -> dict:
    """The grammar's options on a schema: compact and lenient (a client's own x-guidance keeps its other options)."""
    return {**schema, "x-guidance": {"lenient": True, **schema.get("x-guidance", COMPACT)}}


def _json(schema: dict) -> str:
    return "%json " + json.dumps(_compact(schema), ensure_ascii=False)


def answer_schema(fmt: AnswerFormat) -> dict:
    return {"type": "object"} if fmt.kind == "json_object" else prepared(json.loads(fmt.text))


def answer_constraint(fmt: AnswerFormat) -> Constraint:
    """A format on its own (no tools, no thought)."""
    if fmt.kind == "gbnf":
        return Constraint("gbnf", fmt.text)
    return Constraint("json_schema", json.dumps(_compact(answer_schema(fmt)), ensure_ascii=False))


def _call_body(fn: Function, args_key: str) -> dict:
    args = {"$id": f"urn:llmd:tool:{fn.name}", **prepared(fn.parameters)}  # a $ref "#/..." means the arguments
    return {"type": "object", "properties": {"name": {"const": fn.name}, args_key: args},
            "required": ["name", args_key], "additionalProperties": False}


def _xml_function(i: int, fn: Function) -> list[str]:
    """Qwen3-Coder's call body: <function=NAME>, then each parameter (required ones always, in the schema's order)
    as <parameter=P> with a string as written (free up to its closing tag, or one of its enum's), any other value
    as JSON."""
    params = prepared(fn.parameters)
    props = params.get("properties") or {}
    required = set(params.get("required") or [])
    defs = {k: params[k] for k in ("$defs", "definitions") if k in params}  # what a parameter's $ref may name
    rules, parts = [], []
    for k, (pname, schema) in enumerate(props.items()):
        schema = schema if isinstance(schema, dict) else {}
        head = json.dumps(f"<parameter={pname}>\n")
        enum = schema.get("enum")
        if schema.get("type") == "string" and isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
            choices = " | ".join(json.dumps(v) for v in enum)
            rules.append(f'p_{i}_{k}: {head} ({choices}) "\\n</parameter>\\n"')
        elif schema.get("type") == "string" and len(schema) <= 2:  # a plain string (maybe with a description)
            rules.append(f'p_{i}_{k}[lazy]: {head} /(.|\\n)*/ "\\n</parameter>\\n"')
        else:
            rules.append(f'p_{i}_{k}: {head} {_json({**defs, **schema})} "\\n</parameter>\\n"')
        parts.append(f"p_{i}_{k}" + ("" if pname in required else "?"))
    rules.append(f"fn_{i}: {json.dumps(f'<function={fn.name}>' + chr(10))} {' '.join(parts)} \"</function>\"")
    return rules


def _call_rules(fmt: ToolFormat, spec: ToolSpec) -> list[str]:
    """Rules defining `calls`: one call, or several when parallel calls are allowed and no function is named."""
    fns = spec.allowed()
    many = spec.parallel and spec.choice in ("auto", "required")
    if fmt.name == "gemma4":
        return gemma4.call_rules(fns, many)
    if fmt.name == "qwen3_coder":
        rules = [rule for i, fn in enumerate(fns) for rule in _xml_function(i, fn)]
    else:
        rules = [f"fn_{i}: {_json(_call_body(fn, fmt.args_key))}" for i, fn in enumerate(fns)]
    rules.append("fn: " + " | ".join(f"fn_{i}" for i in range(len(fns))))
    if fmt.name == "llama3":
        rules.append("call: fn")
        sep = '";"'
    elif fmt.name == "mistral":  # the [TOOL_CALLS] marker is a special token: the bare array is what the text keeps
        rules.append('calls: "[" fn ("," fn)* "]"' if many else 'calls: "[" fn "]"')
        return rules
    else:
        rules.append('call: "<tool_call>\\n" fn "\\n</tool_call>"')
        sep = '"\\n"'
    rules.append(f"calls: call ({sep} call)*" if many else "calls: call")
    return rules


def _not_starting_with(marker: str) -> str:
    """A regex for a first stretch of text that cannot grow into `marker` (so text and calls never overlap), e.g.
    for "<ab": ([^<]|<([^a]|a[^b])). Any other text, "<div>" included, stays possible."""
    def esc(c: str) -> str:
        return "\\" + c if c in "\\^]-[/" else c

    head, *rest = marker
    if not rest:
        return f"[^{esc(head)}]"
    return f"([^{esc(head)}]|{_re_lit(head)}{_not_starting_with(''.join(rest))})"


def _re_lit(c: str) -> str:
    return "\\" + c if c in ".^$*+?()[]{}|\\/" else c


def grammar_has_calls(fmt: ToolFormat, spec: ToolSpec, answer: AnswerFormat | None) -> bool:
    """Whether the grammar writes the calls. A native template's model calls freely under auto, unless the answer
    has a format, which would shut calls out."""
    return spec.choice != "none" and (spec.forced or not fmt.native or answer is not None)


def lark_grammar(fmt: ToolFormat | None, spec: ToolSpec | None, answer: AnswerFormat | None,
                 thought: str | None, tags: tuple[str, str] = THINK_TAGS) -> Constraint | None:
    """The whole answer's grammar, or None when nothing constrains it.
    thought: None (no thought), "open" (the model opens `<think>` itself), "opened" (the prompt ends inside it);
    tags: what opens and closes the thought (Gemma 4's channel: its own rules)."""
    rules: list[str] = []
    forced = spec is not None and spec.forced
    calls = fmt is not None and spec is not None and grammar_has_calls(fmt, spec, answer)
    if calls:
        rules += _call_rules(fmt, spec)  # type: ignore[arg-type]
    if answer is not None and answer.kind != "gbnf":
        rules.append(f"text: {_json(answer_schema(answer))}")
    elif calls and not forced:
        rules.append("text: TEXT")
        rules.append(f"TEXT: /{_not_starting_with('<tool_call>')}(.|\\n)*/")  # the generic fallback's text
    if not rules:
        return None
    body = "calls" if forced else "text | calls" if calls else "text"
    if thought is None:
        return Constraint("lark", "\n".join([f"start: {body}", *rules]))
    if tags == gemma4.THOUGHT_TAGS:
        think = gemma4.thought_rules(thought == "opened")
        head = ["start: think answer" if thought == "opened" else "start: think? answer", *think]
    else:
        opener = f"{json.dumps(tags[0])} " if thought == "open" else ""
        head = ["start: think answer", f'think[lazy]: {opener}/(.|\\n)*/ {json.dumps(tags[1])}']
    head.append(f'answer: /[ \\n]*/ ({body})')
    return Constraint("lark", "\n".join(head + rules))


def harmony_grammar(spec: ToolSpec | None, answer: AnswerFormat | None) -> Constraint | None:
    """gpt-oss's output under the request's tools and answer format, or None when nothing constrains it (see the
    module docstring). The prompt ends with `<|start|>assistant`: the output opens with a message's channel."""
    calls = spec is not None and grammar_has_calls(ToolFormat("harmony", True), spec, answer)
    rules: list[str] = []
    body: list[str] = []
    if answer is not None and answer.kind != "gbnf":
        rules.append(f'final: <|channel|> "final" <|message|> {_json(answer_schema(answer))}')
        body.append("final")
    if calls:
        fns = spec.allowed()  # type: ignore[union-attr]
        for i, fn in enumerate(fns):
            head = json.dumps(f"commentary to=functions.{fn.name} ")
            args = {"$id": f"urn:llmd:tool:{fn.name}", **prepared(fn.parameters)}
            rules.append(f'fn_{i}: <|channel|> {head} <|constrain|> "json" <|message|> {_json(args)}')
        rules.append("calls: " + " | ".join(f"fn_{i}" for i in range(len(fns))))
        body = ["calls"] if spec.forced else [*body, "calls"]  # type: ignore[union-attr]
    if not body:
        return None
    head = ["start: analysis? (" + " | ".join(body) + ")",
            'analysis: <|channel|> "analysis" <|message|> THOUGHT <|end|> <|start|> "assistant"',
            "THOUGHT: /(.|\\n)*/"]
    return Constraint("lark", "\n".join(head + rules))
