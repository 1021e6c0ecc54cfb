"""Embeddings on every dialect: OpenAI `/v1/embeddings`, Ollama `/api/embed` and the legacy `/api/embeddings`,
llama.cpp `/embedding` and `/embeddings`.

Each dialect parses its body once into an `EmbedIntake` (the inputs as text or token ids, whether an over-long input
is cut or refused, normalization, dimensions); `embed_inputs` tokenizes them, checks the bounds and runs every input
through `AsyncEngine.embed` at once (prefill-only sequences in the engine's own schedule). Bounds: MAX_INPUTS inputs
per request, the engine's limit per input (truncated or a 400, as the dialect does), MAX_TOTAL_TOKENS per request.
"""

from __future__ import annotations

import asyncio
import base64
import struct
import time
from dataclasses import dataclass
from typing import Union

from aiohttp import web

from ..errors import EngineDead, InvalidRequest, QueueFull
from .core import RETRY_AFTER_QUEUE_S, ServerState, encode_text, state_of
from .validation import MAX_PROMPT_TOKEN_IDS, MAX_TEXT_CHARS, ApiError, Field, bad_field, check_fields, read_json

MAX_INPUTS = 512  # inputs per request (the engine's waiting queue holds 1024 by default)
MAX_TOTAL_TOKENS = 131072  # tokens per request, all inputs together

Input = Union[str, list[int]]


@dataclass
class EmbedIntake:
    """One parsed embeddings request. field: the request field inputs came from (errors name it)."""

    model: str | None
    inputs: list[Input]
    field: str
    truncate: bool = False  # cut an input past the limit (Ollama) instead of refusing it
    normalize: bool = True
    dimensions: int | None = None
    max_tokens: int | None = None  # the client's own limit per input (Ollama options.num_ctx)


@dataclass
class EmbedResult:
    vectors: list[list[float]]
    token_counts: list[int]
    seconds: float


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_inputs(value, name: str, tokens_allowed: bool = True) -> list[Input]:
    """A string, a list of strings, a list of token ids or a list of lists of token ids -> a list of inputs."""
    if isinstance(value, str):
        items = [value]
    elif isinstance(value, list) and tokens_allowed and value and all(_is_int(t) for t in value):
        items = [value]
    elif isinstance(value, list):
        items = value
    else:
        raise bad_field(name, "must be a string or an array of strings" + (" or token ids" if tokens_allowed else ""))
    if not items:
        raise bad_field(name, "must hold at least one input")
    if len(items) > MAX_INPUTS:
        raise bad_field(name, f"may hold at most {MAX_INPUTS} inputs")
    for i, item in enumerate(items):
        where = f"{name}[{i}]" if len(items) > 1 or not isinstance(value, str) else name
        if isinstance(item, str):
            if len(item) > MAX_TEXT_CHARS:
                raise bad_field(where, f"must be at most {MAX_TEXT_CHARS} characters")
        elif not (tokens_allowed and isinstance(item, list) and all(_is_int(t) for t in item)):
            raise bad_field(where, "must be a string" + (" or an array of token ids" if tokens_allowed else ""))
        elif len(item) > MAX_PROMPT_TOKEN_IDS:
            raise bad_field(where, f"may hold at most {MAX_PROMPT_TOKEN_IDS} token ids")
    return items


async def embed_inputs(request: web.Request, state: ServerState, intake: EmbedIntake,
                       keep_alive: object = None) -> EmbedResult:
    """Bind the model, tokenize, check the bounds, embed every input concurrently; any failure is an ApiError (never
    a 500)."""
    started = time.monotonic()
    state.check_model(intake.model)
    state = await state.use_model(request, intake.model, keep_alive)
    engine = state.require_engine()
    if not hasattr(engine, "embed"):
        raise ApiError(400, f"model {state.model_name!r} (a remote model) does not serve embeddings here",
                       param="model")
    config = engine.loaded.config
    if intake.dimensions is not None and intake.dimensions != config.hidden_size:
        allowed = config.matryoshka_dimensions
        if allowed is None:
            raise bad_field("dimensions", f"is not supported by model {state.model_name!r} "
                                          f"(its embeddings have {config.hidden_size} dimensions)")
        if intake.dimensions not in allowed:
            raise bad_field("dimensions", f"must be one of {', '.join(map(str, allowed[:32]))}")
    tok = engine.tokenizer
    limit = engine.max_embed_tokens
    if intake.max_tokens is not None:
        limit = min(limit, intake.max_tokens)
    prompts: list[list[int]] = []
    for i, item in enumerate(intake.inputs):
        where = f"{intake.field}[{i}]" if len(intake.inputs) > 1 else intake.field
        ids = await encode_text(tok, item) if isinstance(item, str) else list(item)
        if not ids:
            raise bad_field(where, "is empty")
        if any(not 0 <= t < tok.vocab_size for t in ids):
            raise bad_field(where, f"token ids must be in [0, {tok.vocab_size})")
        if len(ids) > limit:
            if not intake.truncate:
                raise bad_field(where, f"has {len(ids)} tokens; this model embeds at most {limit} per input")
            ids = ids[:limit]
        prompts.append(ids)
    total = sum(map(len, prompts))
    if total > MAX_TOTAL_TOKENS:
        raise bad_field(intake.field, f"holds {total} tokens; a request may hold at most {MAX_TOTAL_TOKENS}")
    dims = None if intake.dimensions == config.hidden_size else intake.dimensions
    tasks = [asyncio.ensure_future(engine.embed(ids, normalize=intake.normalize, dimensions=dims)) for ids in prompts]
    try:
        vectors = await asyncio.gather(*tasks)
    except QueueFull as exc:
        state.metrics.rejected_queue_full += 1
        raise ApiError(429, f"{exc}; retry shortly", kind="rate_limit_exceeded",
                       headers={"Retry-After": str(RETRY_AFTER_QUEUE_S)}) from None
    except InvalidRequest as exc:
        raise ApiError(400, str(exc), param=intake.field if exc.field in ("input", "prompt") else exc.field) from None
    except EngineDead as exc:
        raise ApiError(503, f"the engine stopped: {exc}", kind="service_unavailable") from None
    except RuntimeError as exc:
        raise ApiError(500, f"embedding failed: {exc}", kind="server_error") from None
    finally:
        for task in tasks:  # one input failed or the client left: the others leave the engine too
            task.cancel()
    return EmbedResult(list(vectors), [len(p) for p in prompts], time.monotonic() - started)


# ---- OpenAI ---------------------------------------------------------------------------------------------------

OPENAI_FIELDS = {
    "model": Field("str", max_len=512),
    "encoding_format": Field("str", choices=("float", "base64")),
    "dimensions": Field("int", 1, 1 << 20),
    "user": Field("str", max_len=512),
}


def _base64(vector: list[float]) -> str:
    """OpenAI's base64 encoding: the float32 little-endian bytes."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


async def openai_embeddings(request: web.Request) -> web.Response:
    state = state_of(request)
    body = await read_json(request)
    f = check_fields(body, OPENAI_FIELDS)
    if body.get("input") is None:
        raise ApiError(400, "input is required", param="input")
    intake = EmbedIntake(f.get("model"), parse_inputs(body["input"], "input"), "input",
                         dimensions=f.get("dimensions"))
    result = await embed_inputs(request, state, intake)
    encode = _base64 if f.get("encoding_format") == "base64" else (lambda v: v)
    tokens = sum(result.token_counts)
    return web.json_response({
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": encode(v)} for i, v in enumerate(result.vectors)],
        "model": f.get("model") or state.model_name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    })


# ---- Ollama ---------------------------------------------------------------------------------------------------

OLLAMA_FIELDS = {
    "model": Field("str", max_len=512),
    "truncate": Field("bool"),
    "options": Field("dict"),
    "dimensions": Field("int", 1, 1 << 20),
}
# keep_alive is read by the model manager (llmd.server.models), as on the other Ollama routes


def _ollama_max_tokens(body: dict) -> int | None:
    opts = check_fields(body.get("options") or {}, {"num_ctx": Field("int", 1, 1 << 24)}, prefix="options.")
    return opts.get("num_ctx")


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


async def ollama_embed(request: web.Request) -> web.Response:
    state = state_of(request)
    body = await read_json(request)
    f = check_fields(body, OLLAMA_FIELDS)
    if body.get("input") is None:
        raise ApiError(400, "input is required", param="input")
    intake = EmbedIntake(f.get("model"), parse_inputs(body["input"], "input", tokens_allowed=False), "input",
                         truncate=f.get("truncate", True), dimensions=f.get("dimensions"),
                         max_tokens=_ollama_max_tokens(body))
    result = await embed_inputs(request, state, intake, body.get("keep_alive"))
    return web.json_response({
        "model": f.get("model") or state.model_name,
        "embeddings": result.vectors,
        "total_duration": _ns(result.seconds),
        "load_duration": 0,  # the model is resident; loading happened at daemon start
        "prompt_eval_count": sum(result.token_counts),
    })


async def ollama_embeddings_legacy(request: web.Request) -> web.Response:
    """The deprecated `/api/embeddings`: one `prompt`, one `embedding`, not normalized (as Ollama answers it)."""
    state = state_of(request)
    body = await read_json(request)
    f = check_fields(body, {"model": Field("str", max_len=512), "prompt": Field("str", max_len=MAX_TEXT_CHARS),
                            "options": Field("dict")})
    if not f.get("prompt"):
        state.check_model(f.get("model"))
        return web.json_response({"embedding": []})  # Ollama's answer to an empty prompt
    intake = EmbedIntake(f.get("model"), [f["prompt"]], "prompt", truncate=True, normalize=False,
                         max_tokens=_ollama_max_tokens(body))
    result = await embed_inputs(request, state, intake)
    return web.json_response({"embedding": result.vectors[0]})


# ---- llama.cpp ------------------------------------------------------------------------------------------------

LLAMACPP_FIELDS = {"embd_normalize": Field("int", -1, 2, choices=(-1, 2))}  # -1: none, 2: Euclidean (the default)


async def llamacpp_embedding(request: web.Request) -> web.Response:
    """llama-server's non-OpenAI answer: [{"index": i, "embedding": [[...]]}] (one pooled row per input)."""
    state = state_of(request)
    body = await read_json(request)
    f = check_fields(body, LLAMACPP_FIELDS)
    name = "input" if body.get("input") is not None else "content"
    if body.get(name) is None:
        raise ApiError(400, "content is required", param="content")
    intake = EmbedIntake(None, parse_inputs(body[name], name), name, normalize=f.get("embd_normalize", 2) == 2)
    result = await embed_inputs(request, state, intake)
    return web.json_response([{"index": i, "embedding": [v]} for i, v in enumerate(result.vectors)])


def setup_routes(app: web.Application) -> None:
    app.router.add_post("/v1/embeddings", openai_embeddings)
    app.router.add_post("/api/embed", ollama_embed)
    app.router.add_post("/api/embeddings", ollama_embeddings_legacy)
    app.router.add_post("/embedding", llamacpp_embedding)
    app.router.add_post("/embeddings", llamacpp_embedding)
