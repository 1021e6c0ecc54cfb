"""The `--quant` modes: QuantSpec and parsing a mode string (none | int8 | int4[-gN] | bnb-int8 | bnb-nf4 | gguf)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from llmd.kernels import cpu_gemm

from ...engine.types import QuantMethod, choices  # the torch-free list the settings validate against

DEFAULT_INT4_GROUP = 64


@dataclass(frozen=True)
class QuantSpec:
    method: str  # "none" | "int8" | "int4" | "bnb-int8" | "bnb-nf4" | "gguf" (keep what the GGUF file holds)
    group_size: int = 0
    # int4 from --quant: quantized with AWQ + GPTQ on calibration text while the model loads (llmd.model.calibrate),
    # not weight by weight; quantize_linear / quantize_model have no activations and always quantize weight by weight
    calibrate: bool = False

    @property
    def label(self) -> str:
        return f"int4-g{self.group_size}" if self.method == "int4" else self.method


def parse_quant(mode: str | None, source_kind: str = "hf", device: str | torch.device = "cpu") -> QuantSpec:
    """A --quant value -> QuantSpec.

    None / "auto": a GGUF file keeps its own quantization (packed int4/int8 layers) on CUDA, and on CPU wherever llmd's
    compiled CPU kernel (llmd.kernels.cpu_gemm) builds: that is faster and ~5x smaller than fp32 there. Without it a
    GGUF is dequantized on CPU, since torch's own CPU int4/int8 kernels are many times slower than fp32 without
    AVX-512. HF folders: none.
    "gguf": keep the GGUF file's own quantization everywhere.
    """
    if mode is None or mode == "auto":
        on_cuda = torch.device(device).type == "cuda"
        keep = source_kind == "gguf" and (on_cuda or cpu_gemm.available())
        return QuantSpec("gguf" if keep else "none")
    mode = mode.strip().lower()
    if mode == "gguf":
        if source_kind != "gguf":
            raise ValueError("--quant gguf keeps a GGUF file's own quantization; this model is not a GGUF file")
        return QuantSpec("gguf")
    m = re.fullmatch(r"int4(?:-g(\d+))?", mode)
    if m:
        group = int(m.group(1) or DEFAULT_INT4_GROUP)
        if group not in (32, 64, 128):
            raise ValueError(f"int4 group size must be 32, 64 or 128, not {group}")
        return QuantSpec("int4", group, calibrate=True)
    if mode in ("none", "int8", "bnb-int8", "bnb-nf4"):
        return QuantSpec(mode)
    raise ValueError(f"unknown quantization {mode!r}; choose one of: {', '.join(choices(QuantMethod))}")
