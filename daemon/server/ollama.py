"""Ollama dialect: /api/chat, /api/generate (NDJSON streaming, native stats fields), /api/tags, /api/show, /api/ps,
/api/version and `GET /`; the model verbs (/api/pull, /api/create, /api/copy, /api/delete) are in ollama_manage.py.
Durations are nanoseconds, as Ollama reports them."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace
from datetime import datetime, timezone

from aiohttp import web

from .. import __version__ as llmd_version
from ..engine.types import RequestOutput, SamplingParams
from .core import Generation, GenerationResult, Renderer, ServerState, output_reason, run, state_of, traits_of
from ..store.modelfile import format_modelfile, format_parameters
from ..tools.parsers import Piece
from ..tools.spec import AnswerFormat, ToolSpec, check_schema, normalise_history, parse_tools
from .intake import (OPTION_PARAMS, ChatPrompt, FimPrompt, Intake, TextPrompt, checked_params, given_fields,
                     with_options)
from ..model.vision.images import InvalidImage, image_bytes
from .validation import (MAX_NEW_TOKENS, MIN_P, PENALTY, REPEAT_PENALTY, SEED, STOP, TEXT, TOP_K, TOP_P, ApiError,
                         Field, bad_field, check_fields, parse_messages, read_json)

# The Ollama API level this dialect follows; clients compare it to feature thresholds (`codex --oss` refuses a server
# below 0.13.4). Ollama's release line was 0.34 in September 2026, the newest seen when this was set, and llmd follows
# that line's shapes on the routes it serves (chat, generate, embed, tags, show, ps, pull, create, copy, delete); a
# feature it lacks (images, Go templates, adapters) is a 400 that names it, not a version a client must guess from.
OLLAMA_API_VERSION = "0.34.0"

REQUEST_FIELDS = {
    "model": Field("str", max_len=512),
    "stream": Field("bool"),
    "options": Field("dict"),
    "raw": Field("bool"),
    "system": TEXT,
    "prompt": TEXT,
    "suffix": TEXT,
}
# keep_alive (the model manager's, llmd.server.models) is read by use_model, which answers 400 when it is bad.
OPTION_FIELDS = {
    "temperature": Field("number", 0, 100),
    "top_k": TOP_K,
    "top_p": TOP_P,
    "min_p": MIN_P,
    "num_predict": Field("int", -2, MAX_NEW_TOKENS),
    "stop": STOP,
    "seed": SEED,
    "repeat_penalty": REPEAT_PENALTY,
    "presence_penalty": PENALTY,
    "frequency_penalty": PENALTY,
    "num_ctx": Field("int", 1, 1 << 24),
    "repeat_last_n": Field("int", -1, 1 << 24),  # accepted; penalties apply to the whole output
    "num_keep": Field("int", -1, 1 << 24),
}
DEFAULT_NUM_PREDICT = 2048


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def answer_format(value) -> AnswerFormat | None:
    """Ollama's format: "json" or a JSON schema ("" and null: free text)."""
    if value is None or value == "":
        return None
    if value == "json":
        return AnswerFormat("json_object", "", "format")
    if isinstance(value, str):
        raise bad_field("format", "must be \"json\" or a JSON schema")
    return AnswerFormat("json_schema", json.dumps(check_schema(value, "format"), ensure_ascii=False), "format")


def _think(value) -> tuple[bool | None, str | None]:
    """think: true / false, or a level ("low", "medium", "high"), which means true and is the reasoning effort of a
    template that reads one (gpt-oss's: Ollama documents that true and false change nothing there, and so it is
    here: the template's default effort, medium)."""
    if value is None or isinstance(value, bool):
        return value, None
    if value in ("low", "medium", "high"):
        return True, value
    raise bad_field("think", "must be true, false, or one of low, medium, high")


def _check_request(state: ServerState, body: dict) -> tuple[dict, dict]:
    if body.get("template"):
        raise ApiError(400, "template overrides are not supported; the model's own chat template is used",
                       param="template")
    f = check_fields(body, REQUEST_FIELDS)
    state.check_model(body.get("model"), required=True)
    opts = check_fields(f.get("options") or {}, OPTION_FIELDS, prefix="options.")
    return f, opts


# Ollama's defaults, under a model's params layer and the request's options (intake.with_options)
DEFAULTS = SamplingParams(max_tokens=DEFAULT_NUM_PREDICT, temperature=0.8, top_k=40, top_p=0.9,
                          repetition_penalty=1.1)


def _params(opts: dict) -> SamplingParams:
    return with_options(replace(DEFAULTS, stop=[]), opts)


def _final_stats(gen: Generation, started: float) -> dict:
    t = gen.timings
    ns = lambda s: int((s or 0.0) * 1e9)  # noqa: E731
    return {
        "done_reason": gen.finish_reason or "stop",
        "total_duration": ns(time.monotonic() - started),
        "load_duration": ns(gen.state.load_wait_s),  # the time this request waited for its model to load
        "prompt_eval_count": (t.num_prompt_tokens if t else 0) or len(gen.prompt_ids),
        "prompt_eval_duration": ns(t.ttft if t else 0),
        "eval_count": t.num_generated_tokens if t else 0,
        "eval_duration": ns(t.decode_time if t else 0),
    }


def _length_field(opts: dict, default: str) -> str:
    return "options.num_ctx" if "num_ctx" in opts else default


def _intake(body: dict, f: dict, opts: dict, prompt, length_field: str) -> Intake:
    """`opts`: the request's options (a model's params layer fills the rest in core.run)."""
    return Intake(body["model"], prompt, checked_params(_params(opts)), f.get("stream", True),
                  length_field=_length_field(opts, length_field), num_ctx=opts.get("num_ctx"),
                  answer=answer_format(body.get("format")), keep_alive=body.get("keep_alive"),
                  given=given_fields(opts, OPTION_PARAMS))


def parse_chat(body: dict, state: ServerState) -> Intake:
    f, opts = _check_request(state, body)
    if body.get("images") is not None:
        raise ApiError(400, "images: on /api/chat they go with their message (messages[].images)", param="images")
    messages = parse_messages(body.get("messages"))
    for i, msg in enumerate(body["messages"]):  # Ollama carries images per message, before its text
        if msg.get("images") is not None:
            messages[i]["content"] = _with_images(msg["images"], messages[i]["content"], f"messages[{i}].images")
    messages = normalise_history(body["messages"], messages)
    tools = parse_tools(body["tools"]) if body.get("tools") else ()
    think, effort = _think(body.get("think"))
    prompt = ChatPrompt(messages, ToolSpec(tools) if tools else None, think=think, effort=effort)
    return _intake(body, f, opts, prompt, "messages")


def parse_generate(body: dict, state: ServerState) -> Intake:
    """A request with a prompt or a suffix (without either it is Ollama's load/unload request, see generate)."""
    f, opts = _check_request(state, body)
    prompt, suffix, system = f.get("prompt", ""), f.get("suffix", ""), f.get("system")
    if body.get("images") is not None and (suffix or f.get("raw")):
        raise ApiError(400, "images go through the model's template: not with raw or suffix", param="images")
    if body.get("images") is not None:
        prompt = _with_images(body["images"], prompt, "images")
    if suffix:
        kind = FimPrompt(prompt, suffix)
    elif f.get("raw"):
        kind = TextPrompt(prompt)
    else:
        think, effort = _think(body.get("think"))
        kind = ChatPrompt(([{"role": "system", "content": system}] if system else [])
                          + [{"role": "user", "content": prompt}], think=think, effort=effort,
                          raw_without_template=True)
    return _intake(body, f, opts, kind, "prompt")


def _with_images(images: object, text: str | list, where: str) -> list[dict]:
    """Ollama's base64 `images` of a message (or of /api/generate) as image parts before its text."""
    if not isinstance(images, list):
        raise bad_field(where, "must be an array of base64 images")
    parts = []
    for k, data in enumerate(images):
        try:
            parts.append({"type": "image", "image": image_bytes(data), "field": f"{where}[{k}]"})
        except InvalidImage as exc:
            raise bad_field(f"{where}[{k}]", str(exc)) from None
    return parts + (text if isinstance(text, list) else [{"type": "text", "text": text}])


class _Answer(Renderer):
    """Ollama answers: every chunk, and the whole answer, is one shape with `done` and, at the end, the stats.
    The text goes through the generation's OutputParser: content, thinking and tool calls (each call whole; one
    that max_tokens cuts is dropped, done_reason "length"). NDJSON has no comments: a stream opens, and a quiet one
    stays alive, with an empty chunk (`done` false), which Ollama's clients add to the answer as nothing."""

    fmt = "ndjson"

    def __init__(self, model: str):
        self.model = model
        self.started = time.monotonic()

    def shape(self, piece: Piece, done: bool, extra: dict) -> dict:
        raise NotImplementedError

    def whole(self, gen: Generation, res: GenerationResult) -> dict:
        return self.shape(res.piece, True, _final_stats(gen, self.started))

    def opening(self, gen: Generation) -> list:
        return [self.shape(Piece(), False, {})]

    def keepalive(self, gen: Generation) -> list:
        return [self.shape(Piece(), False, {})]

    def events(self, gen: Generation, out: RequestOutput, piece: Piece) -> list:
        done = output_reason(out) is not None
        events = [self.shape(piece, False, {})] if piece else []
        if done:
            events.append(self.shape(Piece(), True, _final_stats(gen, self.started)))
        return events

    def error(self, exc: ApiError) -> dict:
        return {"error": exc.message}


class ChatAnswer(_Answer):
    def shape(self, piece: Piece, done: bool, extra: dict) -> dict:
        message: dict = {"role": "assistant", "content": piece.content}
        if piece.reasoning:
            message["thinking"] = piece.reasoning
        if piece.calls:
            message["tool_calls"] = [{"function": {"name": c.name, "arguments": c.arguments}} for c in piece.calls]
        return {"model": self.model, "created_at": _now(), "message": message, "done": done, **extra}


class GenerateAnswer(_Answer):
    def shape(self, piece: Piece, done: bool, extra: dict) -> dict:
        body = {"model": self.model, "created_at": _now(), "response": piece.content, "done": done}
        if piece.reasoning:
            body["thinking"] = piece.reasoning
        return {**body, **extra}


async def chat(request: web.Request) -> web.StreamResponse:
    state = state_of(request)
    body = await read_json(request, state.max_body_bytes)
    if body.get("messages") == []:  # Ollama's "load the model" (or, with keep_alive 0, "unload it") request
        _check_request(state, body)
        return await _load_or_unload(request, state, body, lambda reason: {
            "model": body["model"], "created_at": _now(), "message": {"role": "assistant", "content": ""},
            "done": True, "done_reason": reason})
    intake = parse_chat(body, state)
    return await run(request, state, intake, ChatAnswer(body["model"]))


async def generate(request: web.Request) -> web.StreamResponse:
    state = state_of(request)
    body = await read_json(request, state.max_body_bytes)
    if not body.get("prompt") and not body.get("suffix"):  # Ollama's "load the model" (or, with keep_alive 0,
        _check_request(state, body)                       # "unload it") request
        return await _load_or_unload(request, state, body, lambda reason: {
            "model": body["model"], "created_at": _now(), "response": "", "done": True, "done_reason": reason})
    intake = parse_generate(body, state)
    return await run(request, state, intake, GenerateAnswer(body["model"]))


def _family(state: ServerState) -> str:
    """Ollama's architecture name: "llama", "qwen2" (HF class names without ForCausalLM, lower case)."""
    arch = str(state.engine.loaded.config.architecture)
    return arch.removesuffix("ForCausalLM").lower()


def _details(state: ServerState) -> dict:
    """Facts about the model file, as Ollama reports them (quantized layers hold no nn.Parameters, so the file's
    header, not the module, gives the parameter count)."""
    info = state.model_info
    params = getattr(info, "parameters", None) or 0
    kind = getattr(getattr(info, "files", None), "kind", None)
    quant = getattr(info, "quantization", None) or getattr(info, "dtype", None)
    return {"parent_model": "", "format": {"gguf": "gguf", "hf": "safetensors"}.get(kind, ""),
            "family": _family(state), "families": [_family(state)],
            "parameter_size": "" if not params else f"{params / 1e6:.0f}M" if params < 1e9 else f"{params / 1e9:.1f}B",
            "quantization_level": quant or str(state.engine.loaded.dtype).replace("torch.", "")}


def _model_entry(state: ServerState) -> dict:
    return {"name": state.model_name, "model": state.model_name,
            "modified_at": datetime.fromtimestamp(state.started_wall, timezone.utc).isoformat(),
            "size": getattr(state.model_info, "size_bytes", 0), "digest": "", "details": _details(state)}


def _capabilities(state: ServerState) -> list[str]:
    """What the model itself can do, as Ollama names it: an embedding model embeds only; another completes, with
    tools when its template handles them, thinking when it knows a thought, insert with fill-in-the-middle tokens
    (the generic tool fallback serves any model, but is no capability of it), vision with a tower that sees images."""
    if getattr(state.model_info, "embedding", False):
        return ["embedding"]
    traits = traits_of(state.engine, state.template)
    caps = ["completion"]
    if traits.has_tools:
        caps.append("tools")
    if state.engine.tokenizer.fim_token_ids():
        caps.append("insert")
    if traits.thinks:
        caps.append("thinking")
    if getattr(state.engine.loaded, "vision", None) is not None:
        caps.append("vision")
    return caps


async def _load_or_unload(request: web.Request, state: ServerState, body: dict, shape) -> web.Response:
    """An empty prompt: keep_alive 0 unloads the model now (never loading it first), anything else loads it."""
    from ..config import parse_keep_alive

    keep_alive = body.get("keep_alive")
    try:
        unload = keep_alive is not None and parse_keep_alive(keep_alive) == 0
    except ValueError as exc:
        raise ApiError(400, f"keep_alive {exc}", param="keep_alive") from None
    if unload and state.models is not None:
        await state.models.unload(body["model"])
        return web.json_response(shape("unload"))
    await state.use_model(request, body["model"], keep_alive)
    return web.json_response(shape("load"))


async def tags(request: web.Request) -> web.Response:
    state = state_of(request)
    if state.models is not None:
        from .listing import ollama_tags

        return web.json_response({"models": await ollama_tags(state)})
    return web.json_response({"models": [_model_entry(state)] if state.status == "ready" else []})


async def ps(request: web.Request) -> web.Response:
    state = state_of(request)
    if state.models is not None:
        from .listing import ollama_ps

        return web.json_response({"models": await ollama_ps(state)})
    if state.status != "ready":
        return web.json_response({"models": []})
    entry = _model_entry(state)
    stats = state.engine.stats()
    entry.update({"expires_at": "9999-12-31T23:59:59Z", "size_vram": 0, "context_length": state.max_model_len(),
                  "requests_running": stats.requests_running, "requests_waiting": stats.requests_waiting,
                  "threads": stats.threads})
    return web.json_response({"models": [entry]})


async def show(request: web.Request) -> web.Response:
    state = state_of(request)
    body = await read_json(request, state.max_body_bytes)
    check_fields(body, {"model": Field("str", max_len=512), "name": Field("str", max_len=512),
                        "verbose": Field("bool")})
    name = body.get("model") or body.get("name")
    state.check_model(name, required=True)
    state = await state.use_model(request, name, body.get("keep_alive"))
    cfg = state.engine.loaded.config
    arch = _family(state)
    ctx = state.max_model_len()
    created = state.models.created_for(name) if state.models is not None else None
    template = state.template or state.engine.tokenizer.chat_template or ""
    details = _details(state)
    modified = _model_entry(state)["modified_at"]
    if created is not None:
        details["parent_model"] = created.base
        modified = datetime.fromtimestamp(created.modified_at, timezone.utc).isoformat()
    return web.json_response({
        "modelfile": format_modelfile(created.base if created else state.model_name, state.options,
                                      state.template, state.system, created.license if created else None),
        "parameters": format_parameters(state.options), "template": template, "system": state.system or "",
        "license": (created.license if created else None) or "", "details": details,
        "model_info": {"general.architecture": arch, f"{arch}.context_length": ctx,
                       f"{arch}.embedding_length": cfg.hidden_size, f"{arch}.block_count": cfg.num_hidden_layers,
                       f"{arch}.attention.head_count": cfg.num_attention_heads,
                       f"{arch}.attention.head_count_kv": cfg.num_key_value_heads},
        "capabilities": _capabilities(state),
        "digest": await _digest(state, created),
        "modified_at": modified,
    })


async def _digest(state: ServerState, created) -> str:
    """The digest /api/tags lists for this name (a created name's covers its own settings)."""
    files = getattr(state.model_info, "files", None)
    if files is None:
        return ""
    from ..store import model_digest

    files = replace(files, created=created)
    return await asyncio.get_running_loop().run_in_executor(None, model_digest, files)


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": OLLAMA_API_VERSION, "llmd_version": llmd_version})


async def root(request: web.Request) -> web.Response:
    return web.Response(text="Ollama is running (llmd)")


def setup_routes(app: web.Application) -> None:
    from . import ollama_manage

    ollama_manage.setup_routes(app)
    app.router.add_post("/api/chat", chat)
    app.router.add_post("/api/generate", generate)
    app.router.add_get("/api/tags", tags)
    app.router.add_get("/api/ps", ps)
    app.router.add_post("/api/show", show)
    app.router.add_get("/api/version", version)
    app.router.add_get("/", root)
