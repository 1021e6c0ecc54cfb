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
VISION_LOADERS = {"Gemma3ForConditionalGeneration": "gemma3:load_gemma3_vision"}


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
