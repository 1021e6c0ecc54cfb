"""JSON schemas as clients write them (zod, pydantic, TypeBox, hand-written), made ready for the grammar library
(llguidance), and the rule for the keywords it does not implement.

- Exact rewrites (the same documents stay valid): a `propertyNames` every string satisfies (zod's `z.record` writes
  `{"type": "string"}`) is dropped; `unevaluatedProperties` becomes `additionalProperties` where the two mean the
  same (no in-place applicator but plain `allOf` members, whose property names the object then lists, as TypeBox's
  `Intersect` needs); a `$ref` inside a tool's arguments resolves against the arguments (`tools.grammar` gives them
  an `$id` of their own inside the call's body).
- Lenient, the default: what the library cannot enforce is left out and logged at INFO, naming the request field:
  keywords it does not implement (uniqueItems, contains, not, if/then/else, dependentSchemas, a propertyNames that
  constrains, unevaluatedProperties beside other applicators, ...), formats it does not know (an annotation anyway),
  and a `pattern` it cannot parse (look-around). The grammar then allows more than the schema, never less.
- Strict (`strict: true` on the tool or the json_schema format): an unimplemented keyword or an unparseable pattern
  changes what is valid, so it is a 400 naming the field; unknown formats and oneOf (enforced as anyOf) are not.
- An invalid schema (a `$ref` to nothing, a contradiction the library sees) is a 400 naming the field either way.
"""

from __future__ import annotations

import json
import logging
from functools import lru_cache
from typing import Any

import llguidance

from ..server.validation import bad_field

log = logging.getLogger("llmd.server")

# keywords whose value is one subschema, a list of them, or a map of names to them (data keywords such as enum,
# const, default and examples are never walked)
ONE = ("additionalProperties", "items", "contains", "not", "if", "then", "else", "propertyNames",
       "unevaluatedProperties", "unevaluatedItems", "additionalItems", "contentSchema")
LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
IN_PLACE = ("allOf", "anyOf", "oneOf", "not", "if", "$ref", "$dynamicRef", "dependentSchemas", "dependencies")
ANNOTATIONS = ("title", "description", "$comment", "examples", "default", "deprecated", "readOnly", "writeOnly")
TOLERATED = ("Unknown format", "oneOf not fully supported")  # llguidance's warnings that leave validity as it is


def _any_string(schema: Any) -> bool:
    """Whether every property name (a string) satisfies the schema."""
    if schema is True:
        return True
    if not isinstance(schema, dict):
        return False
    rest = {k: v for k, v in schema.items() if k not in ANNOTATIONS}
    return rest in ({}, {"type": "string"})


def _evaluated_by_members(node: dict) -> tuple[dict, dict] | None:
    """The property names and patterns that `allOf` members evaluate, when they are plain objects (no applicator of
    their own); None when some member is not."""
    names: dict = {}
    patterns: dict = {}
    for member in node.get("allOf", []):
        if not isinstance(member, dict) or any(k in member for k in IN_PLACE):
            return None
        names.update({k: {} for k in member.get("properties") or {}})
        patterns.update({k: {} for k in member.get("patternProperties") or {}})
    return names, patterns


def _unevaluated_as_additional(node: dict) -> dict:
    if "unevaluatedProperties" not in node or "additionalProperties" in node:
        return node
    if any(k in node for k in IN_PLACE if k != "allOf"):
        return node
    evaluated = _evaluated_by_members(node)
    if evaluated is None:
        return node
    names, patterns = evaluated
    out = {k: v for k, v in node.items() if k != "unevaluatedProperties"}
    out["additionalProperties"] = node["unevaluatedProperties"]
    if names:  # `{}` lets the members decide, as before; the parent now knows they are evaluated
        out["properties"] = {**names, **(node.get("properties") or {})}
    if patterns:
        out["patternProperties"] = {**patterns, **(node.get("patternProperties") or {})}
    return out


@lru_cache(maxsize=1024)
def regex_problem(pattern: str) -> str | None:
    """Why the grammar library cannot run a schema's `pattern` (look-around, back-references), or None."""
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps({"type": "string", "pattern": pattern}))
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    return _first_line(problem) if problem else None


def _rewrite(node: Any, dropped: list[str]) -> Any:
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in MAPS and isinstance(value, dict):
            value = {k: _rewrite(v, dropped) for k, v in value.items()}
        elif key in LISTS and isinstance(value, list):
            value = [_rewrite(v, dropped) for v in value]
        elif key in ONE:
            value = _rewrite(value, dropped)
        out[key] = value
    if "propertyNames" in out and _any_string(out["propertyNames"]):
        del out["propertyNames"]
    pattern = out.get("pattern")
    if isinstance(pattern, str) and regex_problem(pattern):
        dropped.append(f"pattern {pattern!r}: {regex_problem(pattern)}")
        del out["pattern"]
    return _unevaluated_as_additional(out)


def prepared(schema: dict) -> dict:
    """The schema the grammar compiles: the exact rewrites made, patterns the library cannot parse left out."""
    return _rewrite(schema, [])


@lru_cache(maxsize=256)
def _report(text: str) -> tuple[str | None, tuple[str, ...]]:
    """(an error, what the grammar leaves out) for a schema as JSON text."""
    dropped: list[str] = []
    schema = _rewrite(json.loads(text), dropped)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults={"lenient": True})
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        return _first_line(messages[0] if messages else "invalid schema"), ()
    return None, tuple(dropped + [_first_line(m) for m in messages])


def check_keywords(schema: dict, where: str, strict: bool) -> None:
    """Refuse (strict) or log (lenient) what the grammar cannot enforce of a schema; an invalid one is a 400."""
    error, dropped = _report(json.dumps(schema))
    if error:
        raise bad_field(where, f"is not a JSON schema the grammar can compile: {error}")
    if strict:
        changing = [d for d in dropped if not d.startswith(TOLERATED)]
        if changing:
            raise bad_field(where, "asks for strict validation, but the grammar cannot enforce: " + "; ".join(changing))
    if dropped:
        log.info("%s: the grammar does not enforce: %s", where, "; ".join(dropped))


def _first_line(message: str) -> str:
    """llguidance's message in one line: its `error:` line when it has one (regex errors draw a caret picture)."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if not lines:
        return "unknown error"
    errors = [line.removeprefix("error:").strip() for line in lines if line.startswith("error:")]
    return (errors or lines)[0][:300]
