"""load_model: files -> a ready model (weights in the compute dtype on the device) + its tokenizer and config."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import ModelFileError
from .calibrate import quantize_calibrated
from .config import ModelConfig
from .host_table import host_weight_bytes
from .huge_pages import place_packed_on_huge_pages
from .linear import transposed_tied_head, use_transposed_weights
from .moe import Experts
from .ops import bind_ops, choose_ops
from .quant import (GGUFLinear, QuantizedLinear, QuantSpec, build_empty_quantized, parse_quant, quantize_tied_head, quantized_weight_bytes,
                    quantizing_stream, tie_gguf_head)
from .quant_cache import cached  # second starts read packed weights from the XDG cache
from .registry import model_class
from .source import WeightSource, open_source
from .vision.loading import load_mmproj, load_vision, mmproj_beside
from .weights import LoadReport, load_tensors

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: Any  # llmd.model.tokenizer.Tokenizer
    config: ModelConfig
    name: str
    dtype: torch.dtype
    device: torch.device
    load_seconds: float
    report: LoadReport | None = None  # weight bytes and process memory after loading
    vision: Any = None  # an image-text checkpoint's tower and projector (llmd.model.vision.base.VisionEncoder)
    source: WeightSource | None = None  # where the weights came from (a draft head read on demand: qwen3_5_mtp)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_model(files: Any, dtype: torch.dtype | None = None, device: str | None = None,
               quant: str | None = None, quantize_head: bool = False) -> LoadedModel:
    """Load a model from a `llmd.store.ModelFiles`, a folder in Hugging Face layout, a .gguf file, or a store name.

    One pipeline over the weight source (LoadPipeline; quantized layers: llmd.model.quant), whose int8/int4 results
    llmd.model.quant_cache keeps. Default dtype: fp32 on CPU, bf16 on CUDA. Raises ModelFileError /
    UnsupportedArchitecture / ModelNotFound with a message for the user.
    """
    kind, path, name = _describe(files)
    device_t = torch.device(device or default_device())
    dtype = dtype or default_dtype(device_t)
    start = time.perf_counter()
    source = open_source(kind, path)
    config = source.config
    spec = parse_quant(quant, source.kind, device_t)
    if spec.calibrate and not getattr(model_class(config), "awq_calibration", True):
        # AWQ folds its scales into the norm before each projection, which assumes Llama's layer (Gemma's norms
        # multiply by 1 + weight and sit elsewhere): such a model's int4 is quantized weight by weight instead
        log.warning("%s: calibrated int4 (AWQ + GPTQ) is not implemented for %s; its int4 layers are quantized "
                    "weight by weight", name, config.architecture)
        spec = dataclasses.replace(spec, calibrate=False)
    if source.kind == "gguf" and spec.method == "none" and quant in (None, "auto"):
        _warn_dequantizing(path, dtype)

    model, report = cached(LoadPipeline(source, spec, dtype, device_t, quantize_head))
    tokenizer = source.tokenizer()
    if source.kind == "hf":
        vision = load_vision(path, dtype, device_t)
    else:  # a projector named with the files (an Ollama layer), else llama.cpp's mmproj file beside the model
        projector = getattr(files, "projector", None) or mmproj_beside(path)
        vision = load_mmproj(projector, tokenizer, dtype, device_t) if projector is not None else None
        deepstack = len(getattr(getattr(vision, "config", None), "deepstack_indexes", ()))
        if vision is not None and deepstack != config.deepstack_layers:  # Qwen3-VL's (llmd.model.qwen3_vl)
            raise ModelFileError(projector, f"the projector gives {deepstack} DeepStack features per image token; "
                                            f"the text model takes {config.deepstack_layers}")
    report.weight_bytes, report.host_bytes = quantized_weight_bytes(model), host_weight_bytes(model)
    seconds = time.perf_counter() - start
    report.seconds = seconds
    log.info("loaded %s (%s, %s on %s): %s", name, config.architecture, dtype, device_t, report.summary())
    return LoadedModel(model, tokenizer, config, name, dtype, device_t, seconds, report, vision, source)


@dataclass
class LoadPipeline:
    """The steps from a weight source to a ready model, which llmd.model.quant_cache.cached wraps: `run()` takes them
    all; `empty()` is run()'s model with nothing read in, for the cache to fill, and `prepare()` then takes the last."""

    source: WeightSource
    spec: QuantSpec
    dtype: torch.dtype
    device: torch.device
    quantize_head: bool = False

    def run(self) -> tuple[nn.Module, LoadReport]:
        """Build on the meta device with the quantized layers swapped in, stream the weights in (each quantized /
        kept packed / copied on its way; q/k/v and gate/up straight into the rows of their fused layers), calibrate
        int4, tie the head, lay the weights out and prepare the layers for the device."""
        source, spec = self.source, self.spec
        model, swapped = build_empty_quantized(source.config, self.dtype, self.device, spec, self.quantize_head,
                                               source.raw_types(spec.method))
        stream = source.stream(spec.method)
        adapt = getattr(model, "adapt_checkpoint", None)  # a family whose checkpoint layout is not the model's
        if adapt is not None:
            stream = adapt(stream, source.path)
        report = load_tensors(model, quantizing_stream(stream, model, swapped, spec, source.path), source.path)
        if spec.calibrate:  # the stream left the int4 layers empty: GPTQ fills them, a layer at a time
            quantize_calibrated(model, source.files, spec)
        self._final_form(model)
        self.prepare(model)
        return model, report

    def empty(self) -> nn.Module:
        """run()'s model, its tensors allocated (once) but not filled: the layers, tied head and layout are settled
        on the meta device, where quantizing or transposing a weight costs nothing."""
        model, _ = build_empty_quantized(self.source.config, self.dtype, "meta", self.spec, self.quantize_head,
                                         self.source.raw_types(self.spec.method), runs_on=self.device)
        self._final_form(model)
        model = model.to_empty(device=self.device)
        place_packed_on_huge_pages(model)
        model.init_buffers(self.device)
        return model

    def prepare(self, model: nn.Module) -> None:
        """The last step, once the tensors are in (by run() or from a cache entry): bind the model's ops to the device
        (llmd.model.ops: the C glue on the CPU) and choose each quantized layer's kernel (QuantizedLinear.prepare) and
        how each MoE layer runs its experts (Experts.prepare)."""
        bind_ops(model, choose_ops(self.device, self.dtype))
        for module in model.modules():
            if isinstance(module, (QuantizedLinear, Experts)):
                module.prepare(self.device, self.dtype)

    def _final_form(self, model: nn.Module) -> None:
        """The head tied (once; a packed head marked as the output head) and the weights laid out for the device: the
        forms a cache entry stores, which differ by device type (on the CPU every fp linear, a tied head included, is
        held transposed)."""
        self.tie_output_head(model)
        if isinstance(getattr(model, "lm_head", None), GGUFLinear):  # tied or the file's own: it picks the token
            model.lm_head.output_head = True
        if self.device.type == "cpu":
            use_transposed_weights(model)

    def tie_output_head(self, model: nn.Module) -> None:
        """The one place a tied model (tie_word_embeddings: no lm_head of its own) gets its output head:
        - a packed GGUF token table: the head reads that very table (llmd.model.quant.tie_gguf_head);
        - --quantize-head with an int8/int4/bnb mode: a quantized copy of the table (the table stays as it is);
        - otherwise on CPU: one [hidden, vocab] fp copy serving as head and, transposed, as the embeddings;
        - otherwise (CUDA, fp) the head stays None and the logits are taken from the embedding table."""
        if getattr(model, "lm_head", "untied") is not None:
            return
        if self.spec.method == "gguf" and tie_gguf_head(model, self.dtype):
            return
        if self.quantize_head and self.spec.method not in ("none", "gguf"):
            quantize_tied_head(model, self.spec)
        elif self.device.type == "cpu":
            transposed_tied_head(model)


def _warn_dequantizing(path: Path, dtype: torch.dtype) -> None:
    """One line when --quant auto dequantizes a quantized GGUF (the CPU kernels did not build here)."""
    from .gguf import quantized_elements

    types, elements = quantized_elements(path)
    if types:
        log.warning("%s: the compiled CPU kernels are unavailable, so its %s weights are dequantized to %s (%.2f GB); "
                    "--quant gguf keeps the file's blocks (less memory, slower matmuls)", path.name, "/".join(types),
                    str(dtype).replace("torch.", ""), elements * dtype.itemsize / 1e9)


def _describe(files: Any) -> tuple[str, Path, str]:
    """(kind, path, display name) for a ModelFiles-like object, a path, or a store name."""
    if hasattr(files, "kind") and hasattr(files, "path"):
        return files.kind, Path(files.path), getattr(files, "name", None) or Path(files.path).name
    path = Path(files)
    if path.is_dir():
        return "hf", path, path.name
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelFileError(path, "not a model: expected a .gguf file or a Hugging Face model folder")
        return "gguf", path, path.stem
    from ..store import resolve  # a name such as "smollm2:135m" or a hub repo id

    return _describe(resolve(str(files)))
