"""Shared setup for the Triton kernel tests: on a machine without CUDA the kernels run under the Triton interpreter
(TRITON_INTERPRET=1) on CPU tensors; with CUDA the same tests run the compiled kernels on the GPU."""

from __future__ import annotations

import importlib
import os

import numpy as np
import torch

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"


def load_kernel_module(name: str):
    """Import llmd.kernels.<name> so that its @triton.jit functions match the interpreter setting (the decorator reads
    TRITON_INTERPRET when it runs, so a module imported earlier without it is reloaded)."""
    if not HAS_CUDA:
        os.environ["TRITON_INTERPRET"] = "1"
    module = importlib.import_module(f"llmd.kernels.{name}")
    if not HAS_CUDA:
        kernel = next(v for k, v in vars(module).items() if k.startswith("_") and k.endswith("_kernel"))
        if type(kernel).__name__ != "InterpretedFunction":
            module = importlib.reload(module)
    return module


def random_gguf_blocks(t, n: int, k: int, seed: int = 0) -> np.ndarray:
    """GGUF blocks of type `t` (a llmd.kernels.gguf_matmul.GGUFType) for an [n, k] weight, uint8 [n, row bytes]:
    random quants and scale bits, and finite fp16 super-scales around 0.01 (E8M0 exponents: 2^-10 to 2^-7), so every
    value is finite."""
    rng = np.random.default_rng(seed)
    nb = n * k // t.block_elems
    b = rng.integers(0, 256, size=(nb, t.block_bytes), dtype=np.uint8)
    for off in t.f16_at:
        b[:, off:off + 2] = (rng.standard_normal(nb) * 0.01).astype(np.float16).view(np.uint8).reshape(nb, 2)
    for off in t.e8m0_at:
        b[:, off] = rng.integers(118, 122, nb, dtype=np.uint8)
    return b.reshape(n, -1)
