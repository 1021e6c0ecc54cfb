"""Chat templates: a model's Jinja template rendered in a sandbox, the way transformers' apply_chat_template does.

Templates come from model files, so they are untrusted: they run in jinja2's ImmutableSandboxedEnvironment, with
the same settings and helpers transformers gives them (trim_blocks, lstrip_blocks, loop controls, a tojson that
does not escape HTML, raise_exception, strftime_now, and a namespace that refuses underscore names) so that the
rendered text, and hence the tokens, are identical.

A model without a template gets FALLBACK_TEMPLATE: each message as "<role>: <content>" on its own line, then
"assistant:" when a generation prompt is asked for.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import InvalidRequest

FALLBACK_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (used by some templates to mark assistant text): renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace, refusing underscore attributes (no reaching into Python internals)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"templates cannot set underscore attribute {name!r}")


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def _dict(*args, **kwargs):
    return dict(*args, **kwargs)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_dict, namespace=_Namespace
    )
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise InvalidRequest(f"the model's chat template does not compile: {e.message} (line {e.lineno})") from None


def render_chat(
    template: str | None,
    messages: list[dict],
    add_generation_prompt: bool = True,
    special_tokens: dict[str, str | None] | None = None,
    **extra,
) -> str:
    """Render `messages` with `template` (or FALLBACK_TEMPLATE). Template errors become InvalidRequest."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise InvalidRequest("messages must be a list of objects with role and content", "messages")
    compiled = compile_template(template if template is not None else FALLBACK_TEMPLATE)
    variables = {"tools": None, "documents": None}  # `extra` may give them (e.g. tools=[...])
    variables.update({k: v for k, v in (special_tokens or {}).items() if v is not None})
    variables.update(extra)
    try:
        return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.TemplateError as e:
        raise InvalidRequest(f"chat template error: {e.message or e}", "messages") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError) as e:
        raise InvalidRequest(f"chat template error: {e}", "messages") from None
