"""What the daemon can serve, for /v1/models, /v1/models/{id}, /api/tags and /api/ps: the loaded models first (with
their state), then every model of the stores (bundled, HF cache, Ollama's store) and of the config, each once, with
where it lives. Store scans read file headers only, in a worker thread."""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from .validation import ApiError

if TYPE_CHECKING:
    from ..store import ListedModel, ModelInfo
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


def _stores() -> list[ListedModel]:
    from ..store import list_models

    return list_models()


async def servable(state: ServerState) -> list[dict]:
    """One row per model: name, source, where, size, info (ModelInfo or None), loaded (a Served or None)."""
    models = _manager(state)
    listed = await asyncio.get_running_loop().run_in_executor(None, _stores)
    loaded = models.loaded()
    default = models.default_name
    loaded.sort(key=lambda e: (e.name != default, e.name))
    rows, seen = [], set()
    for e in loaded:
        where = e.remote["url"] if e.remote else str(e.files.path) if e.files else ""
        rows.append({"name": e.name, "source": e.source, "where": where, "size": e.size_bytes, "info": e.info,
                     "loaded": e})
        seen.add(e.name)
        if e.files is not None:
            seen.add(_real(e.files.path))
    for m in listed:
        if m.name in seen or _real(m.where) in seen:
            continue
        seen |= {m.name, _real(m.where)}
        rows.append({"name": m.name, "source": m.source, "where": m.where, "size": m.size_bytes, "info": m.info,
                     "loaded": None})
    for name, table in models.settings.models.items():
        if name not in seen:
            rows.append({"name": name, "source": "remote" if "url" in table else "config",
                         "where": table.get("url") or table.get("path"), "size": 0, "info": None, "loaded": None})
    return rows


def _card(state: ServerState, row: dict) -> dict:
    return {"id": row["name"], "object": "model", "created": int(state.started_wall), "owned_by": "llmd",
            "llmd": {"source": row["source"], "where": row["where"], "loaded": row["loaded"] is not None,
                     "size": row["size"]}}


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
    try:
        wall = Path(row["where"]).stat().st_mtime
    except (OSError, TypeError):
        wall = datetime.now(timezone.utc).timestamp()
    return datetime.fromtimestamp(wall, timezone.utc).isoformat().replace("+00:00", "Z")


async def ollama_tags(state: ServerState) -> list[dict]:
    return [{"name": row["name"], "model": row["name"], "modified_at": _modified(row), "size": row["size"],
             "digest": "", "details": details(row["info"]), "llmd": {"source": row["source"], "where": row["where"]}}
            for row in await servable(state)]


def ollama_ps(state: ServerState) -> list[dict]:
    from .models import iso_time

    out = []
    for e in _manager(state).loaded():
        stats = e.engine.stats()
        out.append({"name": e.name, "model": e.name, "size": e.size_bytes, "digest": "", "details": details(e.info),
                    "expires_at": iso_time(e.expires_at()), "size_vram": e.size_bytes if e.on_gpu else 0,
                    "context_length": _context_length(e), "requests_running": stats.requests_running,
                    "requests_waiting": stats.requests_waiting})
    return out


def _context_length(e: Served) -> int:
    inner = getattr(e.engine, "engine", None)
    cfg = getattr(inner, "config", None)
    return int(getattr(cfg, "max_model_len", 0) or 0)
