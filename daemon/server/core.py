"""What every dialect shares: the server state (engine or loading), model-name checks, prompt encoding, `run` (the
one path from a parsed `Intake` to an answer), the `Renderer` each dialect writes its shapes in, and `Generation`,
which submits one request, parses its text (content, reasoning, tool calls) and guarantees it is aborted in the
engine on every early exit, or stopped when the parser sees the answer end before the output does."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, NamedTuple

from aiohttp import web

from ..engine.types import (Constraint, ConstraintError, FinishReason, ImageSpan, Priority, PromptProgress,
                            RequestOutput, RequestTimings, SamplingParams)
from ..errors import EngineDead, InvalidRequest, LlmdError, QueueFull
from ..tools.families import ModelTraits, model_traits
from ..tools.grammar import answer_constraint
from ..tools.parsers import OutputParser, Piece
from ..tools.plan import ChatPlan, plan_chat
from .intake import MEDIA_MARKER, ChatPrompt, FimPrompt, Intake, TextPrompt, with_model_defaults
from .metrics import Metrics
from .streaming import KEEP_ALIVE, KEEPALIVE_S, EventStream, pump
from .validation import ApiError, content_text
from .vision import encode_images, expand, image_spans, take_images

if TYPE_CHECKING:
    from ..engine.async_engine import AsyncEngine
    from .models import ModelManager

log = logging.getLogger("llmd.server")

RETRY_AFTER_QUEUE_S = 1
RETRY_AFTER_LOADING_S = 2
ENCODE_IN_THREAD_CHARS = 8192  # longer texts are tokenized off the event loop


@dataclass
class ServerState:
    write_timeout: float = 30.0
    keepalive_s: float = KEEPALIVE_S  # a stream quiet this long (queued, in prefill) sends its keep-alive
    shutdown_grace: float = 10.0
    max_body_bytes: int = 4 * 1024 * 1024
    aliases: set[str] = field(default_factory=set)  # extra names clients may use for the served model
    engine: object | None = None  # an AsyncEngine once loaded
    model_info: object | None = None  # the served files' llmd.store.ModelInfo (size, parameters, quantization)
    model_name: str = ""
    status: str = "loading"  # loading | ready | failed | draining
    load_error: str | None = None
    load_seconds: float = 0.0
    started: float = field(default_factory=time.monotonic)
    started_wall: float = field(default_factory=time.time)
    metrics: Metrics = field(default_factory=Metrics)
    active: set = field(default_factory=set)  # running Generations, for the shutdown drain
    pid: int = field(default_factory=os.getpid)  # `llmd stop` signals it
    models: ModelManager | None = None  # the daemon's models; None: `engine` is the one served model
    options: dict = field(default_factory=dict)  # the bound model's default request options (Ollama params layer)
    system: str | None = None  # the bound name's system message for chats without one (a created model's SYSTEM)
    template: str | None = None  # the bound name's chat template, replacing the model's (a created model's TEMPLATE)
    load_wait_s: float = 0.0  # how long this request waited for its model to load (Ollama's load_duration)

    async def use_model(self, request: web.Request, name: str | None, keep_alive: object = None) -> ServerState:
        """This request's view of the state, bound to the named model's engine (loaded on demand, through the
        store: never a path). The model counts as in use until the request's handler returns."""
        if self.models is None:
            self.check_model(name)
            return self
        asked = time.monotonic()
        served = await self.models.acquire(name, keep_alive)
        request.setdefault(LEASES, []).append(served)
        created = self.models.created_for(name)  # a name made with /api/create or /api/copy: its own defaults
        options = {**served.options, **created.parameters} if created else dict(served.options)
        return replace(self, engine=served.engine, model_name=served.name, model_info=served.info,
                       aliases=set(served.aliases), status="ready", options=options,
                       system=created.system if created else None, template=created.template if created else None,
                       metrics=self.metrics.for_model(served.name), load_wait_s=time.monotonic() - asked)

    def with_defaults(self, intake: Intake) -> Intake:
        """The request over the bound model's defaults (options, a system message)."""
        return with_model_defaults(intake, self.options, self.system)

    # --- readiness and names ---

    def require_engine(self):
        if self.status == "ready" and self.engine is not None:
            return self.engine
        if self.status == "draining":
            raise ApiError(503, "the server is shutting down", kind="service_unavailable",
                           headers={"Retry-After": str(RETRY_AFTER_LOADING_S)})
        if self.status == "failed":
            raise ApiError(503, f"the model failed to load: {self.load_error}", kind="service_unavailable")
        raise ApiError(503, "the model is still loading", kind="service_unavailable",
                       headers={"Retry-After": str(RETRY_AFTER_LOADING_S)})

    def names(self) -> set[str]:
        return {self.model_name, *self.aliases} - {"", None}

    def check_model(self, name, required: bool = False) -> None:
        """Accept the served model's name (and its aliases, with or without an Ollama `:latest` tag)."""
        if name is None or name == "":
            if required:
                raise ApiError(400, "model is required", param="model")
            return
        if not isinstance(name, str):
            raise ApiError(400, "model must be a string", param="model")
        if self.models is not None:
            return  # use_model finds it (or answers 400/404)
        base = name[:-len(":latest")] if name.endswith(":latest") else name
        if name in self.names() or base in self.names():
            return
        raise ApiError(404, f"model {name!r} is not loaded; this daemon serves {self.model_name!r}", param="model",
                       kind="model_not_found")

    def max_model_len(self) -> int:
        return context_length(self.require_engine())

    def stats(self) -> dict:
        """The /v1/llmd/stats object (its schema: tui/top_app.py): engine stats per model + uptime + server counters."""
        if self.models is not None:
            out = self.models.stats()
        else:
            out = asdict(self.engine.stats()) if self.engine is not None else {}
            out["model"] = self.model_name
        out.update({"status": self.status, "uptime_s": round(time.monotonic() - self.started, 3),
                    "pid": self.pid, "load_seconds": round(self.load_seconds, 3),
                    "server": self.metrics.server_stats()})
        return out

    async def engine_for(self, request: web.Request, name: str | None, keep_alive: object = None) -> AsyncEngine:
        """The engine that serves the model a request names, for routes that need no more of the bound state."""
        return (await self.use_model(request, name, keep_alive)).require_engine()


def context_length(engine: AsyncEngine) -> int:
    cfg = getattr(getattr(engine, "engine", None), "config", None)
    if getattr(cfg, "max_model_len", None):
        return int(cfg.max_model_len)
    return int(engine.loaded.config.max_position_embeddings)


# --- prompts ---

async def encode_text(tok, text: str, add_special_tokens: bool = True) -> list[int]:
    if len(text) > ENCODE_IN_THREAD_CHARS:
        return await asyncio.get_running_loop().run_in_executor(None, tok.encode, text, add_special_tokens)
    return tok.encode(text, add_special_tokens=add_special_tokens)


async def render_chat(tok, plan: ChatPlan) -> str:
    def render() -> str:
        try:
            return tok.apply_chat_template(plan.messages, tools=plan.tools, **plan.template_kwargs)
        except Exception:  # noqa: BLE001 - a template that refuses the tool note's system turn gets it in the user's
            if plan.fallback_messages is None:
                raise
            return tok.apply_chat_template(plan.fallback_messages, tools=plan.tools, **plan.template_kwargs)

    try:
        if sum(len(content_text(m.get("content") or "")) for m in plan.messages) > ENCODE_IN_THREAD_CHARS:
            return await asyncio.get_running_loop().run_in_executor(None, render)
        return render()
    except LlmdError as exc:
        raise ApiError(400, str(exc), param="messages") from None
    except Exception as exc:  # a template's own raise_exception() or a Jinja error: the client's messages
        raise ApiError(400, f"the chat template rejected the messages: {exc}", param="messages") from None


async def encode_fim(tok, prompt: FimPrompt, model_name: str) -> list[int]:
    """Prefix-suffix-middle order with the model's own FIM tokens; 400 when the model has none."""
    fim = tok.fim_token_ids()
    if not fim:
        raise ApiError(400, f"model {model_name!r} has no fill-in-the-middle tokens; use a code model",
                       param="suffix")
    pre, suf, mid = fim
    ids = [pre] + await encode_text(tok, prompt.extra + prompt.prefix, False) + [suf]
    ids += await encode_text(tok, prompt.suffix, False) + [mid]
    if prompt.after_middle:
        ids += await encode_text(tok, prompt.after_middle, False)
    return ids


def traits_of(engine: AsyncEngine, template: str | None = None) -> ModelTraits:
    """The model's tool format and thinking, read from its templates (a "tool_use" one renders requests with
    tools, so its markers count too), or from `template` where a created model replaces them."""
    tok = engine.tokenizer
    templates = [template] if template else [tok.named_templates.get("tool_use"), tok.chat_template]
    return model_traits(str(engine.loaded.config.architecture), "\n".join(t for t in templates if t) or None)


class Encoded(NamedTuple):
    ids: list[int]
    constraint: Constraint | None
    parser: OutputParser
    images: list[ImageSpan] = []


async def encode_prompt(engine: AsyncEngine, intake: Intake, model_name: str,
                        template: str | None = None) -> Encoded:
    """The prompt's token ids, the answer's constraint, the parser its text goes through and its images' spans.
    `template`: a chat template that replaces the model's (a created model's TEMPLATE)."""
    tok, prompt = engine.tokenizer, intake.prompt
    if getattr(engine, "url", None) is not None:  # a remote engine (llmd.server.remote): upstream renders
        return Encoded(remote_prompt(tok, intake, model_name), None, OutputParser())
    if template:
        tok = tok.with_chat_template(template)
    if isinstance(prompt, ChatPrompt) and prompt.raw_without_template and not tok.has_chat_template:
        prompt = TextPrompt("\n\n".join(content_text(m["content"]) for m in prompt.messages))
    if isinstance(prompt, ChatPrompt):
        messages, images = take_images(prompt.messages)
        vision = getattr(engine.loaded, "vision", None)
        if images and vision is None:
            raise ApiError(400, f"{images[0][0]}: model {model_name!r} does not see images (it has no vision tower)",
                           param=images[0][0])
        encoded = await encode_images(vision, images) if images else []
        prompt = replace(prompt, messages=messages)
        traits = traits_of(engine, template)
        think = prompt.think
        if think and not traits.thinks:
            if not prompt.think_hint:
                raise ApiError(400, f"think: model {model_name!r} does not support thinking", param="think")
            log.debug("a reasoning effort for model %r, which does not think: ignored", model_name)
            think = None
        plan = plan_chat(prompt.messages, prompt.tools, intake.answer, think, prompt.template_kwargs, traits,
                         prompt.effort)
        text = await render_chat(tok, plan)
        constraint, parser = plan.output(text)
        if not encoded:
            return Encoded(await encode_text(tok, text, False), constraint, parser)
        ids = await encode_text(tok, expand(vision, text, encoded), False)
        return Encoded(ids, constraint, parser, image_spans(vision, ids, encoded))
    constraint = answer_constraint(intake.answer) if intake.answer is not None else None
    if isinstance(prompt, FimPrompt):
        return Encoded(await encode_fim(tok, prompt, model_name), constraint, OutputParser())
    if isinstance(prompt, TextPrompt) and prompt.images:  # llama.cpp's multimodal prompt
        vision = getattr(engine.loaded, "vision", None)
        if vision is None:
            raise ApiError(400, f"prompt: model {model_name!r} does not see images (it has no vision tower)",
                           param="prompt")
        encoded = await encode_images(vision, [(f"multimodal_data[{i}]", data) for i, data in enumerate(prompt.images)])
        text = expand(vision, prompt.text.replace(MEDIA_MARKER, vision.placeholder_text()), encoded)
        ids = await encode_text(tok, text, prompt.add_special_tokens)
        return Encoded(ids, constraint, OutputParser(), image_spans(vision, ids, encoded))
    if isinstance(prompt, TextPrompt):
        return Encoded(await encode_text(tok, prompt.text, prompt.add_special_tokens), constraint, OutputParser())
    if any(not 0 <= t < tok.vocab_size for t in prompt.token_ids):
        raise ApiError(400, f"prompt token ids must be in [0, {tok.vocab_size})", param="prompt")
    return Encoded(list(prompt.token_ids), constraint, OutputParser())


def remote_prompt(tok, intake: Intake, model_name: str) -> list[int]:
    """What a remote model is sent: the chat messages or the text as they are (upstream applies its own template
    and tokenizer). Tools, answer formats, FIM and token prompts are not forwarded: a 400 naming the field."""
    prompt = intake.prompt
    if intake.answer is not None:
        raise ApiError(400, f"{intake.answer.field} is not supported for remote model {model_name!r}",
                       param=intake.answer.field)
    if isinstance(prompt, ChatPrompt):
        if prompt.tools is not None:
            raise ApiError(400, f"tools are not supported for remote model {model_name!r}", param="tools")
        return tok.encode_chat(prompt.messages)
    if isinstance(prompt, TextPrompt):
        return tok.encode(prompt.text, prompt.add_special_tokens)
    field = "suffix" if isinstance(prompt, FimPrompt) else "prompt"
    raise ApiError(400, f"{field}: remote model {model_name!r} takes chat messages or a text prompt", param=field)


async def compiled_constraint(engine: AsyncEngine, constraint: Constraint, field: str) -> None:
    """The engine compiles the grammar off the event loop (then cached for the submit); an invalid, unsatisfiable
    or too large one is a 400 naming the request field it came from."""
    try:
        await engine.compile_constraint(constraint)
    except ConstraintError as exc:
        raise ApiError(400, f"{field}: {exc}", param=field) from None


def check_length(engine: AsyncEngine, prompt_ids: list[int], params: SamplingParams, field: str = "prompt",
                 num_ctx: int | None = None) -> None:
    """A prompt that leaves no room in the context is a 400 naming `field` (the request field it came from)."""
    limit = context_length(engine) if num_ctx is None else min(num_ctx, context_length(engine))
    if not prompt_ids:
        raise ApiError(400, "the prompt is empty", param="prompt")
    if len(prompt_ids) >= limit:
        raise ApiError(400, f"the prompt has {len(prompt_ids)} tokens; the context holds {limit}", param=field)
    # Generation stops at the context end anyway; cap max_tokens so the engine never refuses for it.
    params.max_tokens = max(1, min(params.max_tokens, limit - len(prompt_ids)))


class Renderer(ABC):
    """A dialect's answer for one request, whole or streamed: the shapes only (streaming.pump does the timing).
    fmt: "sse", "sse_named" (SSE whose events name their type) or "ndjson". An event is a dict, or a string
    (SSE `[DONE]`, KEEP_ALIVE)."""

    fmt = "sse"

    @abstractmethod
    def whole(self, gen: "Generation", res: "GenerationResult") -> dict:
        """The whole answer, not streamed."""

    def opening(self, gen: "Generation") -> list:
        """What a stream sends as soon as the request is accepted, before its prefill."""
        return []

    @abstractmethod
    def events(self, gen: "Generation", out: RequestOutput, piece: Piece) -> list:
        """One engine output and its parsed text."""

    def keepalive(self, gen: "Generation") -> list:
        """What a quiet stream (queued, in prefill) sends now and then, so clients and proxies see it alive: an SSE
        comment, which every SSE client skips."""
        return [KEEP_ALIVE]

    def progress(self, gen: "Generation", p: PromptProgress) -> list:
        """The prompt's prefill progress, where the dialect has a place for it."""
        return []

    def tail(self, gen: "Generation") -> list:
        """After the last output's events."""
        return []

    @abstractmethod
    def error(self, exc: ApiError) -> dict:
        """An error inside a stream, in the dialect's shape."""


async def run(request: web.Request, state: ServerState, intake: Intake, renderer: Renderer) -> web.StreamResponse:
    """Serve one parsed request: find the engine, encode, check the length, submit, then stream or collect."""
    state = await state.use_model(request, intake.model, intake.keep_alive)  # the one place a request binds its model
    intake = state.with_defaults(intake)  # the model's default options and system message, under the request's own
    engine = state.require_engine()
    prompt_ids, constraint, parser, images = await encode_prompt(engine, intake, state.model_name, state.template)
    check_length(engine, prompt_ids, intake.params, intake.length_field, intake.num_ctx)
    params = intake.params
    field = intake.answer.field if intake.answer is not None else "tools"
    if constraint is not None:
        await compiled_constraint(engine, constraint, field)
        params = replace(params, constraint=constraint)
    gen = Generation(state, request, engine, prompt_ids, params, images=images)
    gen.time_limit_s, gen.output = intake.time_limit_s, parser
    gen.constraint_field = field
    async with gen:
        if not intake.stream:
            return web.json_response(renderer.whole(gen, await gen.collect()))
        return await pump(gen, EventStream(request, renderer.fmt, state.write_timeout), renderer, state.keepalive_s)


STATE = web.AppKey("llmd_state", ServerState)
LEASES = "llmd_models_in_use"  # request key: the Served entries this request holds (released by the app)


def state_of(request: web.Request) -> ServerState:
    return request.app[STATE]


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str | None
    timings: RequestTimings | None
    logprobs: list
    piece: Piece = field(default_factory=Piece)  # the text parsed: content, reasoning, tool calls


class Generation:
    """One engine request. Use as `async with Generation(...) as gen: async for out, piece in gen: ...`; leaving the
    block before the last output (disconnect, stall, error, shutdown) aborts the request in the engine."""

    def __init__(self, state: ServerState, request: web.Request, engine: AsyncEngine, prompt_ids: list[int],
                 params: SamplingParams, priority: Priority = Priority.INTERACTIVE,
                 images: list[ImageSpan] | None = None):
        self.state = state
        self.images = images or []
        self.engine = engine
        self.request = request
        self.prompt_ids = prompt_ids
        self.params = params
        self.priority = priority
        self.stream = None
        self.finished = False
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None  # the stop string or token that ended it (vLLM's field)
        self.timings: RequestTimings | None = None
        self.abort_reason = "disconnect"
        self.time_limit_s: float | None = None  # llama.cpp t_max_predict_ms: cap on the decode phase
        self.output = OutputParser()  # turns the text into content, reasoning and tool calls
        self.constraint_field = "tools"  # the request field a ConstraintError from the engine is blamed on
        self._first_token_at: float | None = None

    async def __aenter__(self) -> "Generation":
        try:
            self.stream = self.engine.submit(self.prompt_ids, self.params, priority=self.priority,
                                             **({"images": self.images} if self.images else {}))
            started = getattr(self.stream, "started", None)
            if started is not None:  # a remote engine (llmd.server.remote): upstream's status, before ours is sent
                await started()
        except QueueFull as exc:
            self.state.metrics.rejected_queue_full += 1
            raise ApiError(429, f"{exc}; retry shortly", kind="rate_limit_exceeded",
                           headers={"Retry-After": str(RETRY_AFTER_QUEUE_S)}) from None
        except ConstraintError as exc:
            raise ApiError(400, f"{self.constraint_field}: {exc}", param=self.constraint_field) from None
        except InvalidRequest as exc:
            raise ApiError(400, str(exc), param=exc.field) from None
        except EngineDead as exc:
            raise ApiError(503, f"the engine stopped: {exc}", kind="service_unavailable") from None
        self.state.active.add(self)
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        self.state.active.discard(self)
        if not self.finished and self.stream is not None:
            if exc_type is not None and issubclass(exc_type, asyncio.CancelledError):
                self.abort_reason = "disconnect"
            self.abort(self.abort_reason)
        self.state.metrics.observe_request(self.timings, self.finish_reason if self.finished else "abort")
        self.request["llmd_timings"] = self.timings
        self.request["llmd_finish"] = self.finish_reason if self.finished else f"abort:{self.abort_reason}"

    def abort(self, why: str) -> None:
        if self.finished or self.stream is None:
            return
        self.abort_reason = why
        self.finished = True
        self.finish_reason = "abort"
        self.stream.abort()
        self.state.metrics.count_abort(why)

    async def __aiter__(self):
        """Each engine output with its text parsed (`output`). When the parser sees the answer end first (a tool call
        repeated an earlier one), the request is stopped in the engine and that output is the last, as a stop."""
        async for out in self.stream:
            if out.timings is not None:
                self.timings = out.timings
            if out.error:
                self.finished = True
                self.finish_reason = "error"
                raise ApiError(500, f"generation failed: {out.error}", kind="server_error")
            if out.finished:
                self.finished = True
                self.finish_reason = _reason(out.finish_reason)
                self.stop_reason = out.stop_reason
            elif self.time_limit_s is not None and out.new_token_ids:
                now = time.monotonic()
                self._first_token_at = self._first_token_at or now
                if now - self._first_token_at > self.time_limit_s:
                    self.abort("time_limit")
                    self.finish_reason = "length"
                    out = replace(out, finished=True, finish_reason=FinishReason.LENGTH)
            piece = self.output.feed(out.text_delta)
            if self.output.ended and not out.finished:
                out = await self._end_early(out)
            if out.finished:
                piece.add(self.output.finish(cut=_reason(out.finish_reason) == "length"))
            yield out, piece
            if out.finished:
                return

    async def _end_early(self, out: RequestOutput) -> RequestOutput:
        """Stop the request in the engine now; `out` becomes the last output, a stop. The engine's own last output
        (within a step) brings the timings; the text after the end is dropped."""
        self.stream.abort()
        async for last in self.stream:
            self.timings = last.timings or self.timings
        self.finished, self.finish_reason, self.stop_reason = True, "stop", None
        return replace(out, finished=True, finish_reason=FinishReason.STOP, stop_reason=None, timings=self.timings)

    def progress(self) -> PromptProgress | None:
        """How far the engine has computed this request's prompt; None when unknown (a remote model, or not yet
        taken in by the engine thread)."""
        read = getattr(self.engine, "prompt_progress", None)
        return read(self.stream.request_id) if read is not None and self.stream is not None else None

    async def collect(self) -> GenerationResult:
        parts, ids, logprobs, parsed = [], [], [], Piece()
        async for out, piece in self:
            parts.append(out.text_delta)
            ids.extend(out.new_token_ids)
            if out.logprobs:
                logprobs.extend(out.logprobs)
            parsed.add(piece)
        return GenerationResult("".join(parts), ids, self.finish_reason, self.timings, logprobs, parsed)


def _reason(reason) -> str | None:
    if reason is None:
        return None
    return reason.value if isinstance(reason, FinishReason) else str(reason)


def output_reason(out: RequestOutput) -> str | None:
    return _reason(out.finish_reason) if out.finished else None
