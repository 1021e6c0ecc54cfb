"""What a model name resolves to."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from .created import Created

# Where a model's files live, as listings show it.
Source = Literal["path", "bundled", "hf-cache", "ollama"]


@dataclass(frozen=True)
class ModelFiles:
    name: str  # what users and APIs call the model
    kind: Literal["hf", "gguf"]
    path: Path  # the model folder (hf) or the .gguf file (gguf); inside the HF cache, a snapshot path
    repo_id: str | None = None  # the Hugging Face repo, when the files come from the hub cache
    source: Source = "path"
    # default request options the model brings (an Ollama manifest's params layer: stop, num_ctx, temperature, ...)
    options: dict = field(default_factory=dict, compare=False, hash=False)
    digest: str | None = None  # the digest the store gives the model (an Ollama manifest's sha256), else None
    # a GGUF model's vision projector (llama.cpp's mmproj file, an Ollama manifest's projector layer); None: found
    # beside the file if there is one (llmd.model.vision.loading)
    projector: Path | None = field(default=None, compare=False, hash=False)
    # a name made with /api/create or /api/copy (llmd.store.created): its own defaults over these files'
    created: "Created | None" = field(default=None, compare=False, hash=False)
