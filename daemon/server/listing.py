"""What the daemon can serve, for /v1/models, /v1/models/{id}, /api/tags and /api/ps: the loaded models first (with
their state), then every model of the stores (bundled, HF cache, Ollama's store, names made with /api/create and
/api/copy) and of the config, with where it lives and its digest (llmd.store.digest). Each name a model answers to
is its own row, as Ollama lists a copied model under each name. Store scans read file headers only and stat the
weights, in a worker thread; no listing waits for weights to be hashed."""

from __future__ import annotations

import asyncio
import hashlib
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import LlmdError
from .validation import ApiError

if TYPE_CHECKING:
    from ..store import ModelFiles, ModelInfo
    from .core import ServerState
    from .models import ModelManager, Served


def _manager(state: ServerState) -> ModelManager:
    assert state.models is not None, "the listing routes need a model manager"
    return state.models


def _real(path) -> str:
    try:
        return str(Path(path).resolve())
    except OSError:
        return str(path)


def _scan(loaded: list[ModelFiles | None], configured: dict[str, dict]) -> tuple:
    """(worker thread) The stores' models, and the digests of the loaded models, of the listed ones and of the
    config's (by name)."""
    from ..store import list_models, model_digest, resolve

    listed = list_models()
    config_digests = {}
    for name, table in configured.items():
        if "url" in table:
            config_digests[name] = _remote_digest(table["url"])
            continue
        try:
            config_digests[name] = model_digest(resolve(table["path"]))
        except LlmdError:
            config_digests[name] = ""
    return (listed, [model_digest(f) if f else "" for f in loaded],
            [model_digest(m.files) if m.files else "" for m in listed], config_digests)


def _remote_digest(url: str) -> str:
    return hashlib.sha256(f"llmd-remote\0{url}".encode()).hexdigest()


def served_digest(e: Served) -> str:
    """(blocking: stats the files) A loaded model's digest."""
    from ..store import model_digest

    if e.files is not None:
        return model_digest(e.files)
    return _remote_digest(e.remote["url"]) if e.remote else ""


async def servable(state: ServerState) -> list[dict]:
    """One row per name a model answers to: name, source, where, size, info (ModelInfo or None), loaded (a Served or
    None), digest. The loaded models come first (the default first), each with the names the stores give its file;
    then every model of the stores, each name once (a created name is its own row: its own defaults and digest);
    then the config's."""
    models = _manager(state)
    loaded = models.loaded()
    loaded.sort(key=lambda e: (e.name != models.default_name, e.name))
    configured = dict(models.settings.models)
    listed, loaded_digests, listed_digests, config_digests = await asyncio.get_running_loop().run_in_executor(
        None, _scan, [e.files for e in loaded], configured)
    by_path = {_real(m.where): m for m in reversed(listed) if m.source != "created"}
    rows: list[dict] = []
    names: set[str] = set()

    def add(row_names: list[str], **row) -> None:
        for name in row_names:
            if name not in names:
                names.add(name)
                rows.append({"name": name, **row})

    paths = set()
    for e, digest in zip(loaded, loaded_digests, strict=True):
        where = e.remote["url"] if e.remote else str(e.files.path) if e.files else ""
        same = by_path.get(_real(e.files.path)) if e.files is not None else None
        size = e.info.size_bytes if e.info is not None else 0  # the files' (/api/ps has the memory's)
        add([e.name, *(same.names if same else [])], source=e.source, where=where, size=size, info=e.info,
            loaded=e, digest=digest)
        paths.add(_real(where))
    for m, digest in zip(listed, listed_digests, strict=True):
        if m.source == "created" or _real(m.where) not in paths:
            add(m.names or [m.name], source=m.source, where=m.where, size=m.size_bytes, info=m.info, loaded=None,
                digest=digest)
    for name, table in configured.items():
        add([name], source="remote" if "url" in table else "config", where=table.get("url") or table.get("path"),
            size=0, info=None, loaded=None, digest=config_digests.get(name, ""))
    return rows


def _card(state: ServerState, row: dict) -> dict:
    return {"id": row["name"], "object": "model", "created": int(state.started_wall), "owned_by": "llmd",
            "llmd": {"source": row["source"], "where": row["where"], "loaded": row["loaded"] is not None,
                     "size": row["size"], "digest": row["digest"]}}


async def openai_models(state: ServerState) -> list[dict]:
    return [_card(state, row) for row in await servable(state)]


async def openai_model(state: ServerState, name: str) -> dict:
    """/v1/models/{id}: a loaded model by any of its names, else a servable one by name; never loads it."""
    served = _manager(state).lookup(name)
    rows = await servable(state)
    for row in rows:
        if row["name"] == name or (served is not None and row["loaded"] is served):
            return _card(state, row)
    from ..store import BadModelName, check_name

    try:
        check_name(name)
    except BadModelName as exc:
        raise ApiError(400, str(exc), param="model") from None
    raise ApiError(404, f"model {name!r} not found; GET /v1/models lists what this daemon serves", param="model",
                   kind="model_not_found")


def details(info: ModelInfo | None) -> dict:
    """Ollama's `details` object from a model's header facts."""
    if info is None:
        return {"parent_model": "", "format": "", "family": "", "families": [], "parameter_size": "",
                "quantization_level": ""}
    arch = (info.architecture or "").removesuffix("ForCausalLM").lower()
    params = info.parameters or 0
    size = "" if not params else f"{params / 1e6:.0f}M" if params < 1e9 else f"{params / 1e9:.1f}B"
    return {"parent_model": "", "format": {"gguf": "gguf", "hf": "safetensors"}.get(info.files.kind, ""),
            "family": arch, "families": [arch] if arch else [], "parameter_size": size,
            "quantization_level": info.quantization or (info.dtype or "").split(" ")[0]}


def _modified(row: dict) -> str:
    created = getattr(row["info"], "files", None) and row["info"].files.created
    try:
        wall = created.modified_at if created else Path(row["where"]).stat().st_mtime
    except (OSError, TypeError):
        wall = datetime.now(timezone.utc).timestamp()
    return datetime.fromtimestamp(wall, timezone.utc).isoformat().replace("+00:00", "Z")


async def ollama_tags(state: ServerState) -> list[dict]:
    return [{"name": row["name"], "model": row["name"], "modified_at": _modified(row), "size": row["size"],
             "digest": row["digest"], "details": details(row["info"]),
             "llmd": {"source": row["source"], "where": row["where"]}}
            for row in await servable(state)]


async def ollama_ps(state: ServerState) -> list[dict]:
    from .models import iso_time

    loaded = _manager(state).loaded()
    digests = await asyncio.get_running_loop().run_in_executor(None, lambda: [served_digest(e) for e in loaded])
    out = []
    for e, digest in zip(loaded, digests, strict=True):
        stats = e.engine.stats()
        out.append({"name": e.name, "model": e.name, "size": e.size_bytes, "digest": digest, "details": details(e.info),
                    "expires_at": iso_time(e.expires_at()), "size_vram": e.size_bytes if e.on_gpu else 0,
                    "context_length": _context_length(e), "requests_running": stats.requests_running,
                    "requests_waiting": stats.requests_waiting, "threads": stats.threads})
    return out


def _context_length(e: Served) -> int:
    inner = getattr(e.engine, "engine", None)
    cfg = getattr(inner, "config", None)
    return int(getattr(cfg, "max_model_len", 0) or 0)
