"""Where a model's weights come from: a Hugging Face folder (safetensors) or a GGUF file, behind one interface.

load_model (llmd.model.loader) runs one pipeline over a WeightSource: build the model with its quantized layers on the
meta device, stream the tensors in (each transformed on its way: quantized, kept packed, or copied), calibrate if
asked, tie the output head, prepare the layers for the device. Only this module knows the two formats apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from .config import ModelConfig


@dataclass
class WeightSource:
    kind: str  # "hf" | "gguf"
    path: Path
    config: ModelConfig
    files: list[Path]  # the files the weights are read from (the quantized-weight cache keys on them)

    def tokenizer(self) -> Any:
        from .tokenizer import Tokenizer

        if self.kind == "gguf":
            from .gguf import read_gguf_metadata

            return Tokenizer.from_gguf(read_gguf_metadata(self.path), path=self.path)
        return Tokenizer.from_hf_folder(self.path)

    def raw_types(self, method: str) -> dict[str, str] | None:
        """For --quant gguf: every tensor's GGML type as it will arrive (the layers follow it); from an HF folder,
        the weights its family keeps packed (gpt-oss's MXFP4 experts: the model class's `packed_types`); else None."""
        if self.kind == "hf":
            from .registry import model_class
            from .weights import safetensors_readers

            packed_types = getattr(model_class(self.config), "packed_types", None)
            return packed_types(safetensors_readers(self.files)) or None if packed_types is not None else None
        if method != "gguf":
            return None
        from .gguf import raw_tensor_types

        return raw_tensor_types(self.path)

    def stream(self, method: str) -> Iterable:
        """(name, tensor) pairs under Hugging Face names; a GGUF file under a quantizing mode yields its tensors
        still packed (RawTensor) instead, for layers that keep or rearrange the blocks."""
        if self.kind == "gguf":
            from .gguf import dequantized_tensors, iter_raw_tensors

            return dequantized_tensors(self.path) if method == "none" else iter_raw_tensors(self.path)
        from .weights import iter_safetensors

        return iter_safetensors(self.files)


def open_source(kind: str, path: Path) -> WeightSource:
    """The checked source (headers read, config built; no weights read)."""
    if kind == "gguf":
        from .gguf import gguf_config

        return WeightSource("gguf", path, gguf_config(path), [path])
    from .weights import safetensors_files

    return WeightSource("hf", path, ModelConfig.from_hf_folder(path), safetensors_files(path))
