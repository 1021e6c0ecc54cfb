"""JSON schemas as real clients write them, through the request checks (tools.spec, tools.schema) and the grammar:
zod 4 (`z.toJSONSchema`, draft 2020-12 and draft-07 targets), zod 3 (zod-to-json-schema), TypeBox (the four in
client_schemas.json, written by client_schemas.mjs) and pydantic (written here, by the installed pydantic).

Each is accepted as sent; what the grammar cannot enforce is logged, and refused only under `strict` when it changes
what is valid; the grammar accepts each schema's valid documents and refuses what the schema refuses (but the
keywords it left out); the bundled model's constrained answers and tool calls validate against the schemas as sent
(jsonschema)."""

from __future__ import annotations

import datetime
import enum
import json
import logging
from pathlib import Path
from typing import Literal, Optional

import jsonschema
import pydantic
import pytest

from llmd.server.validation import ApiError
from llmd.tools.families import ToolFormat
from llmd.tools.grammar import answer_constraint, lark_grammar
from llmd.tools.parsers import OutputParser
from llmd.tools.spec import AnswerFormat, ToolSpec, check_schema, parse_tools

from test_tools_units import check, matcher_for, smol_tokenizer  # noqa: F401  (fixtures)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GENERATED = json.loads((Path(__file__).parent / "client_schemas.json").read_text())


class Color(enum.Enum):
    red = "red"
    blue = "blue"


class Point(pydantic.BaseModel):
    x: int
    y: int


class Shape(pydantic.BaseModel):  # $defs / $ref, title, an enum, anyOf with null, default, format date-time
    kind: Literal["circle", "square"]
    color: Color = Color.red
    corners: list[Point] = pydantic.Field(max_length=2)
    label: Optional[str] = pydantic.Field(default=None, max_length=20, title="Label")
    made: datetime.datetime


class Tagged(pydantic.BaseModel):  # what the grammar cannot enforce: uniqueItems (a set), a look-ahead pattern
    model_config = pydantic.ConfigDict(regex_engine="python-re")
    tags: set[str] = pydantic.Field(max_length=3)
    slug: str = pydantic.Field(pattern=r"^(?!-)[a-z-]{1,12}$")


SCHEMAS = {**{k: v for k, v in GENERATED.items() if k != "generated_by"}, "pydantic_shape": Shape.model_json_schema()}

# per schema: a valid document, then documents the schema refuses
CASES = {
    "zod4_bash_draft7": ({"command": "ls -la", "env": {"LANG": "C"}},
                         [{"command": "ls", "shell": "sh"}, {"command": "ls", "env": {"A": 1}}, {"timeout": 5}]),
    "zod4_todos": ({"todos": [{"content": "Write tests", "status": "pending"}], "estimates": {"tests": 3}},
                   [{"todos": [{"content": "x", "status": "done"}], "estimates": {}},
                    {"todos": [{"content": "x", "status": "pending"}] * 3, "estimates": {}},
                    {"todos": [], "estimates": {}},
                    {"todos": [{"content": "x", "status": "pending"}], "estimates": {"x": 12}}]),
    "zod4_env_names": ({"env": {"LANG": "C"}}, [{"env": {"LANG": 1}}]),
    "zod3_edit": ({"file_path": "/src/app.py", "old_string": "foo", "new_string": "bar"},
                  [{"file_path": "/a", "old_string": "x" * 41, "new_string": ""},
                   {"file_path": "/a", "old_string": "", "new_string": "", "mode": 1}]),
    "typebox_drawing": ({"name": "house", "scores": {}, "where": {"x": 1, "y": 2}, "box": {"w": 3, "h": 4}},
                        [{"name": "house", "scores": {}, "where": {"x": 1, "y": 2, "z": 3}, "box": {"w": 3, "h": 4}},
                         {"name": "house", "scores": {}, "where": {"x": 1, "y": 2}, "box": {"w": 3, "h": 4, "d": 5}},
                         {"name": "house", "scores": {"roof": 10}, "where": {"x": 1, "y": 2}, "box": {"w": 3, "h": 4}},
                         {"name": "", "scores": {}, "where": {"x": 1, "y": 2}, "box": {"w": 3, "h": 4}}]),
    "pydantic_shape": ({"kind": "circle", "corners": [{"x": 0, "y": 1}], "made": "2024-05-01T12:00:00Z"},
                       [{"kind": "circle", "color": "green", "corners": [], "made": "2024-05-01T12:00:00Z"},
                        {"kind": "hexagon", "corners": [], "made": "2024-05-01T12:00:00Z"},
                        {"kind": "circle", "corners": [{"x": 0, "y": 1}] * 3, "made": "2024-05-01T12:00:00Z"},
                        {"kind": "circle", "corners": [{"x": 0, "y": "1"}], "made": "2024-05-01T12:00:00Z"},
                        {"kind": "circle", "corners": []}]),
}


def compact(doc) -> str:
    return json.dumps(doc, separators=(",", ":"))


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_client_schemas_compile_and_the_grammar_holds_them(name, matcher_for, caplog):
    schema = SCHEMAS[name]
    valid, invalid = CASES[name]
    jsonschema.validate(valid, schema)
    with caplog.at_level(logging.INFO, logger="llmd.server"):
        check_schema(schema, "response_format.json_schema.schema")
        # every keyword these use is enforced (propertyNames {"type": "string"}, TypeBox's unevaluatedProperties are
        # rewritten exactly), so strict takes them too; only zod's constraining propertyNames is left out
        if name != "zod4_env_names":
            check_schema(schema, "response_format.json_schema.schema", strict=True)
    assert [r.getMessage() for r in caplog.records if "does not enforce" in r.getMessage()] == (
        ['response_format.json_schema.schema: the grammar does not enforce: Unimplemented keys: ["propertyNames"]']
        if name == "zod4_env_names" else [])
    answer = answer_constraint(AnswerFormat("json_schema", json.dumps(schema), "response_format"))
    check(answer, "response_format")
    assert matcher_for(answer, compact(valid))
    for doc in invalid:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(doc, schema)
        assert not matcher_for(answer, compact(doc)), doc
    # the same schema as a tool's arguments (inside the call's body: its $refs still resolve against it)
    tool = parse_tools([{"type": "function", "function": {"name": "f", "parameters": schema}}])
    call = lark_grammar(ToolFormat("generic", False), ToolSpec(tool, "required", parallel=False), None, None)
    check(call, "tools")
    assert matcher_for(call, '<tool_call>\n{"name":"f","arguments":' + compact(valid) + "}\n</tool_call>")
    assert not matcher_for(call, '<tool_call>\n{"name":"f","arguments":' + compact(invalid[0]) + "}\n</tool_call>")


def test_what_the_grammar_cannot_enforce_is_logged_or_refused_under_strict(matcher_for, caplog):
    schema = Tagged.model_json_schema()
    env_names = SCHEMAS["zod4_env_names"]
    for where, s in (("tools[0].function.parameters", schema), ("text.format.schema", env_names)):
        with pytest.raises(ApiError) as strict:
            check_schema(s, where, strict=True)
        assert strict.value.status == 400 and strict.value.param == where
        assert "strict" in strict.value.message and "Unimplemented keys" in strict.value.message
    with caplog.at_level(logging.INFO, logger="llmd.server"):
        check_schema(schema, "response_format.json_schema.schema")
    (line,) = [r.getMessage() for r in caplog.records if "does not enforce" in r.getMessage()]
    assert "uniqueItems" in line and "pattern '^(?!-)[a-z-]{1,12}$': look-around" in line
    # left out, so the grammar allows more than the schema (never less)
    answer = answer_constraint(AnswerFormat("json_schema", json.dumps(schema), "response_format"))
    assert matcher_for(answer, '{"tags":["a","b"],"slug":"a-b"}')
    assert matcher_for(answer, '{"tags":["a","a"],"slug":"-a"}')  # not unique, starts with "-"
    assert not matcher_for(answer, '{"tags":["a","b","c","d"],"slug":"a"}')  # the rest still holds: maxItems
    # an unknown format is an annotation: strict takes it; a $ref to nothing is no schema in either mode
    check_schema({"type": "object", "properties": {"p": {"type": "string", "format": "path"}}}, "f", strict=True)
    for strict_mode in (False, True):
        with pytest.raises(ApiError) as bad:
            check_schema({"$ref": "#/$defs/missing"}, "format", strict=strict_mode)
        assert bad.value.param == "format" and "does not exist" in bad.value.message


@pytest.mark.slow
def test_the_bundled_model_answers_and_calls_validate(smollm2_gguf):
    """Greedy SmolLM2, one batch: an answer per schema, and forced calls of tools with the zod and pydantic
    schemas; the model is asked to copy a valid document, and strays from it (a second todo, scores of its own),
    but the grammar keeps every answer valid."""
    import torch

    from llmd.engine import Engine, EngineConfig, FinishReason, SamplingParams, generate
    from llmd.model.loader import load_model

    loaded = load_model(smollm2_gguf, dtype=torch.float32, device="cpu")
    tok = loaded.tokenizer
    names = sorted(SCHEMAS)
    prompts = [tok.encode_chat([{"role": "user", "content": f"Repeat this JSON exactly: {json.dumps(CASES[n][0])}"}])
               for n in names]
    constraints = [answer_constraint(AnswerFormat("json_schema", json.dumps(SCHEMAS[n]), "response_format"))
                   for n in names]
    tools = parse_tools([{"type": "function", "function": {"name": n, "parameters": SCHEMAS[n]}}
                         for n in ("zod4_bash_draft7", "pydantic_shape")])
    for fn in tools:
        spec = ToolSpec(tools, fn.name, parallel=False)
        constraints.append(lark_grammar(ToolFormat("generic", False), spec, None, None))
        prompts.append(tok.encode_chat([{"role": "user", "content": f"Call {fn.name} with "
                                                                     f"{json.dumps(CASES[fn.name][0])}"}]))
    params = [SamplingParams(max_tokens=120, temperature=0, constraint=c) for c in constraints]
    results = generate(Engine(loaded, EngineConfig(num_kv_blocks=256)), prompts, params)
    for name, r in zip(names, results):
        assert r.finish_reason is FinishReason.STOP, (name, r.text)
        jsonschema.validate(json.loads(r.text), SCHEMAS[name])
    for fn, r in zip(tools, results[len(names):]):
        parser = OutputParser(None, ToolFormat("generic", False).parser({f.name: f.parameters for f in tools}))
        piece = parser.feed(r.text).add(parser.finish())
        (call,) = piece.calls
        assert call.name == fn.name
        jsonschema.validate(call.arguments, SCHEMAS[fn.name])
