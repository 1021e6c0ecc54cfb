"""The interface every family's vision encoder has (see the package docstring)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Protocol

import torch
from PIL import Image

from ...errors import ModelFileError

TowerTensors = dict[str, tuple[Path, tuple[int, ...], Callable[[], torch.Tensor]]]


class VisionEncoder(Protocol):
    """A family's image encoder. One whose language model gives image tokens 2-D positions (Qwen3.5's multimodal
    RoPE) also has `token_grid(pixel_values) -> (rows, columns)` of its tokens (llmd.engine.types.ImageSpan.grid)."""

    image_token_id: int  # the placeholder token an image's embeddings replace
    bidirectional: bool  # whether an image's tokens attend to each other both ways (Gemma 3 / 4)

    def placeholder_text(self) -> str:
        """What the chat template writes for an image part (Gemma 3: "<start_of_image>"), which `expand` widens."""

    def expand(self, text: str, tokens_per_image: list[int]) -> str:
        """The rendered prompt with each image's placeholder widened to its full token sequence."""

    def preprocess(self, image: Image.Image) -> torch.Tensor:
        """An RGB image -> pixel values [3, H, W] in fp32, as the family's image processor makes them."""

    def tokens_for(self, pixel_values: torch.Tensor) -> int:
        """Placeholder tokens the image takes (fixed for Gemma 3, by size for Qwen3.5)."""

    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Pixel values [3, H, W] -> embeddings [tokens, text hidden] in the language model's dtype (Qwen3-VL: its
        DeepStack features after them, [tokens, text hidden * (1 + ModelConfig.deepstack_layers)])."""


def widen(text: str, marker: str, tokens_per_image: list[int], sequence: Callable[[int], str]) -> str:
    """`text` with each `marker` (one per image, in order) replaced by sequence(the image's token count); ValueError
    when the markers and the images do not pair up (VisionEncoder.expand)."""
    pieces = text.split(marker)
    if len(pieces) - 1 != len(tokens_per_image):
        raise ValueError(f"the prompt has {len(pieces) - 1} {marker} for {len(tokens_per_image)} images")
    return pieces[0] + "".join(sequence(n) + piece for n, piece in zip(tokens_per_image, pieces[1:], strict=True))


def tower_tensors(folder: Path, prefixes: tuple[str, ...]) -> TowerTensors:
    """The folder's safetensors tensors whose names (less a leading "model.") start with one of `prefixes`: name ->
    (file, shape, reader), from the headers only (a tensor is read when its reader is called)."""
    from ..weights import read_safetensors_header, safetensors_files, safetensors_readers

    found: TowerTensors = {}
    for path in safetensors_files(folder):
        try:
            with open(path, "rb") as f:
                _, header = read_safetensors_header(path, f)
        except OSError as exc:
            raise ModelFileError(path, f"cannot read ({exc.strerror or exc})") from None
        for name, read in safetensors_readers([path]).items():
            if name.removeprefix("model.").startswith(prefixes):
                found[name] = (path, tuple(header[name]["shape"]), read)
    return found


def check_normalisation(image_mean: tuple, image_std: tuple, resample: int) -> None:
    """A processor's normalisation and resampling filter, as the families' configs check them."""
    if len(image_mean) != 3 or len(image_std) != 3 or not all(s > 0 for s in image_std):
        raise ModelFileError("config", f"image mean {image_mean} / std {image_std} need 3 channels")
    if resample not in {int(r) for r in Image.Resampling}:
        raise ModelFileError("config", f"resample {resample} is not one of PIL's filters")


def image_text_config(folder: Path, family: str) -> tuple[Path, dict, dict, dict]:
    """An image-text checkpoint's config.json: (its path, the config, its vision_config, its text_config); a
    ModelFileError naming the file when there is no vision_config."""
    from ..config import read_json

    cfg_path = Path(folder) / "config.json"
    cfg = read_json(cfg_path)
    vision, text = cfg.get("vision_config"), cfg.get("text_config") or {}
    if not isinstance(vision, dict) or not isinstance(text, dict):
        raise ModelFileError(cfg_path, f"no vision_config: not an image-text {family} checkpoint")
    return cfg_path, cfg, vision, text
