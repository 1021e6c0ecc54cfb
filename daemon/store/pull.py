"""`llmd pull` and Ollama's /api/pull: download a repo's weights and tokenizer into the Hugging Face hub cache (with
progress bars, or with the bytes done and due reported to a callback)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ..errors import LlmdError, ModelNotFound
from .bundled import BUNDLED_NAME
from .files import ModelFiles
from .hub import hub_cache_dir, hub_offline
from .resolve import parse_hub_name, resolve, select_gguf

# Weights as safetensors, the config and tokenizer files; nothing else (no pickled .bin, no repo code).
HF_PATTERNS = [
    "*.safetensors",
    "*.json",
    "tokenizer*",
    "vocab.*",
    "merges.txt",
    "chat_template.jinja",
]
# Only the top level: sub-folders hold other formats (onnx/, original/, ...).
IGNORE_PATTERNS = ["*/*"]


Progress = Callable[[int, int], None]  # (bytes done, bytes due), called from the download's threads


def pull(name: str, progress: Progress | None = None) -> ModelFiles:
    """Download `name` (alias, `owner/name`, or `owner/name:FILE.gguf` for GGUF repos) and return its files."""
    name = name.strip()
    if name == BUNDLED_NAME:
        return resolve(None)
    if Path(name).expanduser().exists():
        raise LlmdError(f"{name} is a local path; there is nothing to pull")
    repo_id, selector = parse_hub_name(name)
    if repo_id is None:
        raise ModelNotFound(resolve_hint(name))
    if hub_offline():
        raise LlmdError(f"cannot pull {name}: HF_HUB_OFFLINE is set; unset it to download from the Hugging Face Hub")

    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        repo_files = HfApi().list_repo_files(repo_id)
        allow = _patterns(name, repo_id, selector, repo_files)
        snapshot_download(repo_id, cache_dir=hub_cache_dir(), allow_patterns=allow, ignore_patterns=IGNORE_PATTERNS,
                          tqdm_class=_reporting_bar(progress) if progress else None)
    except GatedRepoError:
        raise LlmdError(
            f"{repo_id} is gated: accept its license on huggingface.co, then log in (hf auth login) and pull again"
        ) from None
    except (RepositoryNotFoundError, RevisionNotFoundError):
        raise ModelNotFound(f"{repo_id} was not found on the Hugging Face Hub (or it is private)") from None
    except LlmdError:
        raise
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # network and disk failures: one line, not a traceback
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise LlmdError(f"could not download {repo_id}: {reason[:300]}") from None
    return resolve(name)


def _reporting_bar(progress: Progress):
    """A tqdm class that draws nothing and reports its byte counts (huggingface_hub sums every file's bytes into one
    bar of unit "B"; its bar counting files is left out)."""
    from tqdm import tqdm

    class _Sink:
        def write(self, _text: str) -> None:
            pass

        def flush(self) -> None:
            pass

    class ReportingBar(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs.update(file=_Sink(), disable=False)
            super().__init__(*args, **kwargs)

        def update(self, n=1):
            shown = super().update(n)
            if self.unit == "B":
                progress(int(self.n), int(self.total or 0))
            return shown

    return ReportingBar


def _patterns(name: str, repo_id: str, selector: str | None, repo_files: list[str]) -> list[str]:
    ggufs = [f for f in repo_files if f.endswith(".gguf") and "/" not in f]
    has_safetensors = any(f.endswith(".safetensors") for f in repo_files)
    if selector is None and has_safetensors:
        return HF_PATTERNS
    if not ggufs:
        raise LlmdError(f"{repo_id} has no safetensors or GGUF weights that llmd can load")
    if selector is None:
        if len(ggufs) > 1:
            raise LlmdError(
                f"{repo_id} holds several GGUF files; name one, e.g. llmd pull {repo_id}:{Path(ggufs[0]).name}"
                f" (files: {', '.join(ggufs[:8])}{' ...' if len(ggufs) > 8 else ''})"
            )
        return [ggufs[0]]
    chosen = select_gguf([Path(f) for f in ggufs], selector)
    if chosen is None:
        raise LlmdError(f"{repo_id} has no single GGUF file matching {selector!r} (files: {', '.join(ggufs[:8])})")
    return [chosen.name]


def resolve_hint(name: str) -> str:
    try:
        resolve(name)
    except ModelNotFound as exc:
        return str(exc)
    return f"{name} is not something to pull"  # pragma: no cover
