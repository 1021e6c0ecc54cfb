"""Which image-text checkpoints have a tower llmd serves, and loading it beside the text model."""

from __future__ import annotations

import importlib
import logging
from pathlib import Path
from typing import Any

import torch

from ..config import read_json

log = logging.getLogger(__name__)

# HF architecture of an image-text checkpoint -> "module:function" loading its VisionEncoder from the folder
VISION_LOADERS = {"Gemma3ForConditionalGeneration": "gemma3:load_gemma3_vision",
                  "Gemma4ForConditionalGeneration": "gemma4:load_gemma4_vision",
                  "Mistral3ForConditionalGeneration": "mistral3:load_mistral3_vision",
                  "Qwen3_5ForConditionalGeneration": "qwen3_5:load_qwen3_5_vision",
                  "Qwen3_5MoeForConditionalGeneration": "qwen3_5:load_qwen3_5_vision",
                  "Qwen3VLForConditionalGeneration": "qwen3_5:load_qwen3_5_vision",
                  "Qwen3VLMoeForConditionalGeneration": "qwen3_5:load_qwen3_5_vision"}
# an mmproj GGUF's clip.projector_type -> ("module:function" loading it, the text vocabulary's image token)
MMPROJ_LOADERS = {"gemma3": ("gemma3:load_gemma3_mmproj", "<image_soft_token>"),
                  "gemma4v": ("gemma4_gguf:load_gemma4_mmproj", "<|image|>"),
                  "pixtral": ("mistral3_gguf:load_mistral3_mmproj", "[IMG]"),
                  "qwen3vl_merger": ("qwen3_5_gguf:load_qwen3_5_mmproj", "<|image_pad|>")}


def load_vision(folder: Path, dtype: torch.dtype, device: torch.device) -> Any:
    """The folder's vision encoder (llmd.model.vision.base.VisionEncoder), or None for a text-only checkpoint or one
    whose tower llmd does not serve yet (logged: its text model still serves)."""
    cfg = read_json(Path(folder) / "config.json")
    if not isinstance(cfg.get("vision_config"), dict):
        return None
    arch = (cfg.get("architectures") or [None])[0]
    target = VISION_LOADERS.get(arch)
    if target is None:
        log.warning("%s: the %s vision tower is not served yet; the model answers text only", folder, arch)
        return None
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(f"{__package__}.{module}"), name)(Path(folder), dtype, device)


def mmproj_beside(gguf: Path) -> Path | None:
    """llama.cpp's projector file next to a text GGUF (`mmproj*.gguf`, `*mmproj*.gguf`): the one there, or of several
    the one whose name shares the longest start with the model's; None when there is none."""
    found = sorted(p for p in gguf.parent.glob("*mmproj*.gguf") if p != gguf and p.is_file())
    if len(found) > 1:
        found.sort(key=lambda p: -len(_common_start(p.name, gguf.name)))
    return found[0] if found else None


def _common_start(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def load_mmproj(path: Path, tokenizer: Any, dtype: torch.dtype, device: torch.device) -> Any:
    """The vision encoder of an mmproj GGUF for the text model whose tokenizer is `tokenizer` (it holds the image
    token), or None, logged, for a projector llmd does not serve yet."""
    from ..gguf import read_gguf_metadata

    meta = read_gguf_metadata(path)
    kind = meta.get("clip.projector_type", meta.get("clip.vision.projector_type"))
    entry = MMPROJ_LOADERS.get(kind) if isinstance(kind, str) else None
    if entry is None:
        log.warning("%s: the %r vision projector is not served yet; the model answers text only", path, kind)
        return None
    target, token = entry
    token_id = tokenizer.backend.token_to_id(token) if tokenizer is not None else None
    if token_id is None:
        log.warning("%s: the text model has no %s token for its images; the model answers text only", path, token)
        return None
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(f"{__package__}.{module}"), name)(path, dtype, device, token_id)
