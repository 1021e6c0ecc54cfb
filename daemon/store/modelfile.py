"""Ollama's Modelfile, as /api/create takes it (the `modelfile` text of older clients; newer ones send the same as
the fields `from`, `parameters`, `template`, `system`, `license`).

One instruction per line, case-insensitive, `#` starts a comment; a value is the rest of the line, may be in "quotes",
or in \"\"\"triple quotes\"\"\" over several lines. What llmd applies: `FROM` (a model name: never a file path),
`PARAMETER name value` (the options of `PARAMETERS` below; `stop` may repeat), `TEMPLATE` (a Jinja chat template,
see llmd.store.created), `SYSTEM`, `LICENSE`. `ADAPTER` (LoRA weights) and `MESSAGE` (a canned history) are refused
by name, as is any other instruction: nothing is silently dropped. `REQUIRES` (the Ollama version a Modelfile wants)
is read and ignored.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from ..errors import LlmdError
from .ollama import PARAM_TYPES

MAX_MODELFILE_CHARS = 1 << 20
MAX_STOPS = 16

REFUSED = {
    "ADAPTER": "llmd does not apply LoRA adapters; create the model without ADAPTER (or merge the adapter into the "
               "weights first)",
    "MESSAGE": "llmd does not keep a canned message history with a model; send the messages with each request",
}
PARAMETERS = tuple(PARAM_TYPES)  # the options a model's defaults may set (those llmd applies)


class ModelfileError(LlmdError):
    """A bad Modelfile or create field; `field` names the request field it came from."""

    def __init__(self, message: str, field: str = "modelfile"):
        super().__init__(message)
        self.field = field


@dataclass
class Modelfile:
    base: str | None = None
    parameters: dict = field(default_factory=dict)
    template: str | None = None
    system: str | None = None
    license: str | None = None


_INSTRUCTION = re.compile(r"([A-Za-z]+)(?:[ \t]+(.*))?$")


def parse_modelfile(text: str) -> Modelfile:
    """The Modelfile's settings; ModelfileError naming the line that is wrong."""
    if len(text) > MAX_MODELFILE_CHARS:
        raise ModelfileError(f"modelfile is longer than {MAX_MODELFILE_CHARS} characters")
    out = Modelfile()
    stops: list[str] = []
    pos, line_no = 0, 0
    while pos < len(text):
        end = text.find("\n", pos)
        end = len(text) if end < 0 else end
        line, line_no = text[pos:end].strip(), line_no + 1
        pos = end + 1
        if not line or line.startswith("#"):
            continue
        match = _INSTRUCTION.match(line)
        if match is None:
            raise ModelfileError(f"modelfile line {line_no}: expected an instruction (FROM, PARAMETER, TEMPLATE, "
                                 f"SYSTEM, ...), got {line[:40]!r}")
        word, value = match.group(1).upper(), (match.group(2) or "").strip()
        if value.startswith('"""') and not (len(value) >= 6 and value.endswith('"""')):
            close = text.find('"""', pos)
            if close < 0:
                raise ModelfileError(f'modelfile line {line_no}: {word} opens """ but never closes it')
            rest_end = text.find("\n", close)
            rest_end = len(text) if rest_end < 0 else rest_end
            if text[close + 3:rest_end].strip():
                raise ModelfileError(f'modelfile: text after the closing """ of {word}')
            line_no += text.count("\n", pos - 1, rest_end)
            value, pos = value[3:] + "\n" + text[pos:close], rest_end + 1
        else:
            value = _unquote(value)
        _apply(out, stops, word, value, line_no)
    if len(stops) > MAX_STOPS:
        raise ModelfileError(f"modelfile: at most {MAX_STOPS} PARAMETER stop lines")
    if stops:
        out.parameters["stop"] = stops
    return out


def _unquote(value: str) -> str:
    for quote in ('"""', '"'):
        if len(value) >= 2 * len(quote) and value.startswith(quote) and value.endswith(quote):
            return value[len(quote):-len(quote)]
    return value


def _apply(out: Modelfile, stops: list, word: str, value: str, line_no: int) -> None:
    where = f"modelfile line {line_no}"
    if word in REFUSED:
        raise ModelfileError(f"{where}: {word}: {REFUSED[word]}")
    if word == "FROM":
        out.base = value.strip()
    elif word == "PARAMETER":
        name, _, raw = value.partition(" ")
        name, raw = name.strip().lower(), _unquote(raw.strip())
        if not raw:
            raise ModelfileError(f"{where}: PARAMETER {name} needs a value")
        if name == "stop":
            stops.append(raw)
        else:
            out.parameters[name] = parameter_value(name, raw, where)
    elif word == "TEMPLATE":
        out.template = value
    elif word == "SYSTEM":
        out.system = value
    elif word == "LICENSE":
        out.license = value
    elif word != "REQUIRES":
        raise ModelfileError(f"{where}: unknown instruction {word} (llmd takes FROM, PARAMETER, TEMPLATE, SYSTEM, "
                             "LICENSE)")


def parameter_value(name: str, raw: str, where: str) -> int | float:
    """A PARAMETER line's text as the option's JSON type."""
    kinds = PARAM_TYPES.get(name)
    if kinds is None:
        raise ModelfileError(f"{where}: PARAMETER {name}: llmd does not apply this option; it applies "
                             f"{', '.join(PARAMETERS)}")
    try:
        return int(raw) if kinds == (int,) else float(raw)
    except ValueError:
        kind = "an integer" if kinds == (int,) else "a number"
        raise ModelfileError(f"{where}: PARAMETER {name} must be {kind}, got {raw[:40]!r}") from None


def check_parameters(params: dict, field: str = "parameters") -> dict:
    """The structured `parameters` of a create request: known options of the right JSON type (ranges are the
    server's to check, with the request fields')."""
    out = {}
    for name, value in params.items():
        kinds = PARAM_TYPES.get(name)
        if kinds is None:
            raise ModelfileError(f"{field}.{name}: llmd does not apply this option; it applies "
                                 f"{', '.join(PARAMETERS)}", f"{field}.{name}")
        if name == "stop" and isinstance(value, str):
            value = [value]
        ok = isinstance(value, kinds) and not isinstance(value, bool)
        if name == "stop":
            ok = isinstance(value, list) and len(value) <= MAX_STOPS and all(isinstance(s, str) for s in value)
        elif kinds == (int,) and isinstance(value, float) and value.is_integer():
            value, ok = int(value), True
        if not ok:
            raise ModelfileError(f"{field}.{name} has the wrong type ({type(value).__name__})", f"{field}.{name}")
        out[name] = value if name == "stop" or kinds == (int,) else float(value)  # 0 and 0.0: one setting
    return out


def format_parameters(params: dict) -> str:
    """Options as /api/show's `parameters` text: one `name value` line each (a stop string per line, quoted)."""
    lines = []
    for name, value in params.items():
        for one in value if isinstance(value, list) else [value]:
            lines.append(f"{name:<30} {json.dumps(one) if isinstance(one, str) else one}")
    return "\n".join(lines)


def format_modelfile(base: str, params: dict, template: str | None, system: str | None,
                     license: str | None = None) -> str:
    """A Modelfile that makes the model again (/api/show's `modelfile`)."""
    out = [f"# Modelfile generated by llmd\nFROM {base}"]
    for word, text in (("TEMPLATE", template), ("SYSTEM", system), ("LICENSE", license)):
        if text:
            out.append(f'{word} """{text}"""')
    out += [f"PARAMETER {line}" for line in format_parameters(params).splitlines()]
    return "\n".join(out) + "\n"
