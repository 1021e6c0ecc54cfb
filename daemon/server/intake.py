"""One typed request per HTTP call: what every dialect's `parse` returns and `core.run` serves.

A dialect reads its body once, checks its field table once, and builds an `Intake`: the prompt (one of four kinds),
the engine's SamplingParams (validated here, once), the stream flag and the few dialect options a renderer needs.
From there one path serves every route: encode the prompt, check its length, submit, then stream or collect
(`core.run`). The engine checks what only it knows (vocabulary, KV pool) once more, in `AsyncEngine.submit`.

A model may carry default options (an Ollama manifest's params layer: stop, num_ctx, temperature...). They apply on
every route, in one place (`with_model_defaults`, called by core.run once the model is bound): each fills a sampling
field the request left unset (`Intake.given` names the ones it set), as Ollama applies them under a request's own. A
name made with /api/create may also bring a system message, which opens chats that have none.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Union

from ..engine.types import SamplingParams
from ..errors import InvalidRequest
from ..tools.spec import AnswerFormat, ToolSpec
from .validation import MAX_NEW_TOKENS, ApiError

# Options in Ollama's names (a params layer, Ollama's `options`) -> the SamplingParams field each sets
OPTION_PARAMS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                 "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
                 "frequency_penalty": "frequency_penalty", "seed": "seed", "stop": "stop", "num_predict": "max_tokens"}


@dataclass(frozen=True)
class ChatPrompt:
    """Messages rendered with the model's chat template (with their tool calls and results normalised, see
    tools.spec); the tools and `think` are planned per model in core.run (tools.plan)."""

    messages: list[dict]
    tools: ToolSpec | None = None
    think: bool | None = None  # None: the template's default
    think_hint: bool = False  # `think` is a reasoning effort: a model that does not think ignores it
    # the reasoning effort asked for, in OpenAI's names (none, minimal, low, medium, high, xhigh, max): a template that
    # reads `reasoning_effort` gets the nearest of low, medium and high (tools.plan); others ignore it
    effort: str | None = None
    template_kwargs: dict = field(default_factory=dict)
    # Ollama's /api/generate: a model without a chat template (a base model) reads the prompt as it is, as Ollama's
    # default template does; the chat routes answer 400 there instead
    raw_without_template: bool = False


@dataclass(frozen=True)
class TextPrompt:
    text: str
    add_special_tokens: bool = True
    # llama.cpp's multimodal prompt: the text holds MEDIA_MARKER where each image goes, in order
    images: tuple[bytes, ...] = ()


MEDIA_MARKER = "<__media__>"  # llama.cpp's (mtmd) marker of an image's place in a text prompt


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
    keep_alive: object = None  # Ollama's keep_alive, read by the model manager (llmd.server.models)
    given: frozenset[str] = frozenset()  # the SamplingParams fields the request set itself (see with_model_defaults)


def given_fields(f: dict, names: dict[str, str]) -> frozenset[str]:
    """The SamplingParams fields a dialect's checked body sets; `names`: its field name -> the SamplingParams one."""
    return frozenset(names[k] for k in f if k in names)


def option_value(key: str, value):
    """An Ollama-named option as its SamplingParams value (Ollama's conventions: num_predict -1, -2 and 0 run to the
    context end; top_k 0 and below, top_p 0 and repeat_penalty 0 are off)."""
    if key == "num_predict":
        return MAX_NEW_TOKENS if value in (-1, -2, 0) else value
    if key == "top_k":
        return max(value, 0)
    if key == "top_p":
        return float(value) or 1e-6
    if key == "repeat_penalty":
        return float(value) or 1.0
    if key == "stop":
        return list(value)
    return value if key == "seed" else float(value)


def with_options(params: SamplingParams, options: dict, keep: frozenset[str] = frozenset()) -> SamplingParams:
    """params with the Ollama-named options applied, except to the fields in `keep`."""
    changes = {OPTION_PARAMS[k]: option_value(k, v) for k, v in options.items()
               if k in OPTION_PARAMS and OPTION_PARAMS[k] not in keep}
    return replace(params, **changes) if changes else params


def with_model_defaults(intake: Intake, options: dict, system: str | None = None) -> Intake:
    """The request over its model's default options, on every route: each fills a field the request left unset
    (its num_ctx too); the request's own values win. `system` (a created model's SYSTEM) opens a chat that brings
    no system message of its own, as Ollama applies a Modelfile's."""
    prompt = intake.prompt
    if system and isinstance(prompt, ChatPrompt) and not any(m.get("role") == "system" for m in prompt.messages):
        intake = replace(intake, prompt=replace(prompt, messages=[{"role": "system", "content": system},
                                                                  *prompt.messages]))
    if not options:
        return intake
    params = checked_params(with_options(intake.params, options, intake.given))
    num_ctx = intake.num_ctx if intake.num_ctx is not None else options.get("num_ctx")
    return replace(intake, params=params, num_ctx=num_ctx)


def checked_params(params: SamplingParams) -> SamplingParams:
    """SamplingParams.validate as a 400 naming the field (the field tables catch almost everything before)."""
    try:
        return params.validate()
    except InvalidRequest as exc:
        raise ApiError(400, str(exc), param=exc.field) from None
