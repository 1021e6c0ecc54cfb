"""One typed request per HTTP call: what every dialect's `parse` returns and `core.run` serves.

A dialect reads its body once, checks its field table once, and builds an `Intake`: the prompt (one of four kinds),
the engine's SamplingParams (validated here, once), the stream flag and the few dialect options a renderer needs.
From there one path serves every route: encode the prompt, check its length, submit, then stream or collect
(`core.run`). The engine checks what only it knows (vocabulary, KV pool) once more, in `AsyncEngine.submit`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from ..engine.types import SamplingParams
from ..errors import InvalidRequest
from ..tools.spec import AnswerFormat, ToolSpec
from .validation import ApiError


@dataclass(frozen=True)
class ChatPrompt:
    """Messages rendered with the model's chat template (with their tool calls and results normalised, see
    tools.spec); the tools and `think` are planned per model in core.run (tools.plan)."""

    messages: list[dict]
    tools: ToolSpec | None = None
    think: bool | None = None  # None: the template's default
    template_kwargs: dict = field(default_factory=dict)


@dataclass(frozen=True)
class TextPrompt:
    text: str
    add_special_tokens: bool = True


@dataclass(frozen=True)
class FimPrompt:
    """Fill-in-the-middle: prefix, suffix, repository context before the prefix, and text after the middle token."""

    prefix: str
    suffix: str
    extra: str = ""
    after_middle: str = ""


@dataclass(frozen=True)
class TokenPrompt:
    token_ids: list[int]


Prompt = Union[ChatPrompt, TextPrompt, FimPrompt, TokenPrompt]


@dataclass
class Intake:
    """One parsed, validated request. `length_field` is the field a too-long prompt is blamed on; `num_ctx` an
    Ollama client's own context limit; `time_limit_s` llama.cpp's cap on the decode phase."""

    model: str | None
    prompt: Prompt
    params: SamplingParams
    stream: bool
    length_field: str = "prompt"
    num_ctx: int | None = None
    answer: AnswerFormat | None = None  # response_format / format / grammar / json_schema
    include_usage: bool = False  # OpenAI stream_options
    echo: bool = False  # OpenAI completions: the prompt text before the answer
    time_limit_s: float | None = None


def checked_params(params: SamplingParams) -> SamplingParams:
    """SamplingParams.validate as a 400 naming the field (the field tables catch almost everything before)."""
    try:
        return params.validate()
    except InvalidRequest as exc:
        raise ApiError(400, str(exc), param=exc.field) from None
