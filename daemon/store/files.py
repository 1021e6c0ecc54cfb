"""What a model name resolves to."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal


@dataclass(frozen=True)
class ModelFiles:
    name: str  # what users and APIs call the model
    kind: Literal["hf", "gguf"]
    path: Path  # the model folder (hf) or the .gguf file (gguf); inside the HF cache, a snapshot path
    repo_id: str | None = None  # the Hugging Face repo, when the files come from the hub cache
