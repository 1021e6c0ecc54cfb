"""The Hugging Face hub cache, read in place through huggingface_hub's cache APIs (weights are never copied out).

huggingface_hub reads HF_HOME / HF_HUB_CACHE / HF_HUB_OFFLINE once, at import; llmd reads them at call time and
passes the cache folder explicitly, so a changed environment (tests, a long-lived daemon) is honoured.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# owner/name, as the Hub allows them
REPO_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def hub_cache_dir() -> Path:
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(os.path.expandvars(explicit)).expanduser()
    home = os.environ.get("HF_HOME")
    if home:
        return Path(os.path.expandvars(home)).expanduser() / "hub"
    xdg_cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg_cache) / "huggingface" / "hub"


def hub_offline() -> bool:
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in {"1", "ON", "YES", "TRUE"}


def is_repo_id(name: str) -> bool:
    return bool(REPO_ID_RE.match(name)) and ".." not in name


def find_snapshot(repo_id: str) -> Path | None:
    """The cached snapshot folder of the repo's main revision, or None when the repo is not in the cache."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError

    cache = hub_cache_dir()
    if not cache.is_dir():
        return None
    try:
        folder = snapshot_download(repo_id, cache_dir=cache, local_files_only=True)
    except IncompleteSnapshotError as exc:
        # `llmd pull` fetches only weights and tokenizer files, so against the full repo listing a pulled snapshot
        # always looks incomplete. The caller checks that the files a model needs are there.
        partial = getattr(exc, "snapshot_path", None)
        if partial is None:
            return None
        folder = str(partial)
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError):
        return None
    path = Path(folder)
    return path if path.is_dir() else None


def scan_cached_models():
    """The cached model repos (huggingface_hub CachedRepoInfo), or [] when there is no cache yet."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound, CorruptedCacheException

    from ..errors import LlmdError

    cache = hub_cache_dir()
    if not cache.is_dir():
        return []
    try:
        info = scan_cache_dir(cache)
    except CacheNotFound:
        return []
    except CorruptedCacheException as exc:
        raise LlmdError(f"the Hugging Face cache at {cache} is corrupt: {exc}") from None
    return sorted((r for r in info.repos if r.repo_type == "model"), key=lambda r: r.repo_id.lower())


def main_revision(repo):
    """The revision `refs/main` points to, else the most recently modified one, else None."""
    for revision in repo.revisions:
        if "main" in revision.refs:
            return revision
    return max(repo.revisions, key=lambda r: r.last_modified, default=None)
