"""Mistral 3's image encoder (Mistral3ForConditionalGeneration: Mistral Small 3.1 / 3.2): the Pixtral vision tower,
Mistral 3's patch merger and projector, following transformers' modeling_pixtral / modeling_mistral3,
PixtralImageProcessorPil and PixtralProcessor (the references tests/test_vision_mistral3.py compares against).

Rules:
- preprocess: the RGB image (transparency composited onto white), when a side exceeds the longest edge
  (preprocessor_config.json's size.longest_edge, else the tower's image_size) scaled down by the larger ratio, sides
  floored (to at least 1), keeping its aspect ratio; then each side rounded up to a multiple of patch_size * spatial_merge_size (the
  processor's patch); resized there with PIL's resample (bicubic), times 1/255 (float64, then fp32), normalised by
  the processor's mean and std. The image is never padded: its size is its own.
- expand: each "[IMG]" the chat template writes becomes the image's grid of merged tokens row by row, each row
  `cols` "[IMG]"s then "[IMG_BREAK]", the last row's break replaced by "[IMG_END]" (PixtralProcessor). An encoding
  is [rows, cols, text hidden]: each row's [IMG]s are one run of placeholders (llmd.server.vision places it row by
  row); they attend causally, as the text model's other tokens.
- encode: a bias-free conv patch embedding, an RMSNorm (ln_pre, eps 1e-5); transformer layers of RMSNorm (eps 1e-5),
  bias-free attention over every patch with 2-D RoPE (rotate-half over the whole head; of a head's frequencies the
  even ones turn with the patch's row, the odd ones with its column), RMSNorm, a gated
  MLP (SiLU on Mistral Small 3.1, else GELU); then the projector: an RMSNorm (the text model's eps), each 2 x 2 block
  of patches concatenated channel-major (torch's unfold) and merged by a linear layer, linear / GELU / linear to the
  text hidden size. Only vision_feature_layer -1 (the last layer) is served.
- weights: from a Hugging Face folder (config.json's vision_config, processor files if present; the tensors
  vision_tower.* and multi_modal_projector.*, with or without a leading model.), read with llmd's own bounds-checked
  readers, each located and shape-checked before anything is allocated. A missing or misshapen tensor or a bad
  setting is a ModelFileError naming the file and the tensor or key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from ...errors import ModelFileError
from .base import check_normalisation, image_text_config, tower_tensors, widen
from .gemma3 import MAX_LAYERS, Located, _config_value, _hf_prefix
from .images import to_rgb

IMAGE_TOKEN, BREAK_TOKEN, END_TOKEN = "[IMG]", "[IMG_BREAK]", "[IMG_END]"
PROJECTOR = "multi_modal_projector."
TOWER_EPS = 1e-5  # transformers fixes the Pixtral tower's RMSNorm eps
MAX_LONGEST_EDGE = 8192  # pixels: a bound on what a config may ask an image to become
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"silu": F.silu, "gelu": F.gelu}


@dataclass(frozen=True)
class Mistral3VisionConfig:
    patch_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    text_hidden_size: int
    longest_edge: int  # an image's larger side is scaled down to this
    spatial_merge_size: int = 2
    rope_theta: float = 10000.0
    hidden_act: str = "silu"  # the tower's gated MLP
    projector_act: str = "gelu"
    projector_bias: bool = False
    projector_eps: float = 1e-5  # the text model's rms_norm_eps, as transformers builds the projector's norm
    image_token_id: int = 10
    image_mean: tuple[float, ...] = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple[float, ...] = (0.26862954, 0.26130258, 0.27577711)
    resample: int = 3  # PIL's BICUBIC, as preprocessor_config.json numbers it
    rescale_factor: float = 1 / 255

    def __post_init__(self) -> None:
        sizes = (self.patch_size, self.hidden_size, self.intermediate_size, self.num_layers, self.num_heads,
                 self.text_hidden_size, self.longest_edge, self.spatial_merge_size)
        if any(n < 1 for n in sizes) or self.num_layers > MAX_LAYERS or self.longest_edge > MAX_LONGEST_EDGE:
            raise ModelFileError("config", f"vision sizes must be positive, at most {MAX_LAYERS} layers and "
                                           f"{MAX_LONGEST_EDGE} pixels a side: {self}")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ModelFileError("config", f"vision hidden size {self.hidden_size} over {self.num_heads} heads is "
                                           "not a head size that is a multiple of 4 (2-D RoPE)")
        if self.hidden_act not in ACTIVATIONS or self.projector_act not in ACTIVATIONS:
            raise ModelFileError("config", f"activations {self.hidden_act!r} / {self.projector_act!r}: only "
                                           f"{', '.join(ACTIVATIONS)}")
        check_normalisation(self.image_mean, self.image_std, self.resample)
        if not self.rope_theta > 0:
            raise ModelFileError("config", f"vision rope_theta {self.rope_theta} must be positive")

    @property
    def unit(self) -> int:
        """Pixels a side of one merged image token (the processor's patch)."""
        return self.patch_size * self.spatial_merge_size


def target_size(height: int, width: int, longest_edge: int, unit: int) -> tuple[int, int]:
    """The (height, width) PixtralImageProcessor resizes an image to (see the module docstring)."""
    ratio = max(height / longest_edge, width / longest_edge)
    if ratio > 1:
        # a side that would floor to nothing keeps one pixel (transformers' processor fails on such an image)
        height, width = max(1, math.floor(height / ratio)), max(1, math.floor(width / ratio))
    return ((height - 1) // unit + 1) * unit, ((width - 1) // unit + 1) * unit


class _RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) in fp32, back in x's dtype, times the weight (PixtralRMSNorm, Mistral3RMSNorm)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def _bias_free(n_in: int, n_out: int) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=False)


class _Layer(nn.Module):
    """One Pixtral layer; submodule names are transformers' (the checkpoint's)."""

    def __init__(self, c: Mistral3VisionConfig):
        super().__init__()
        h = c.hidden_size
        self.heads, self.act = c.num_heads, ACTIVATIONS[c.hidden_act]
        self.attention_norm, self.ffn_norm = _RMSNorm(h, TOWER_EPS), _RMSNorm(h, TOWER_EPS)
        self.attention = nn.ModuleDict({p: _bias_free(h, h) for p in ("q_proj", "k_proj", "v_proj", "o_proj")})
        self.feed_forward = nn.ModuleDict({"gate_proj": _bias_free(h, c.intermediate_size),
                                           "up_proj": _bias_free(h, c.intermediate_size),
                                           "down_proj": _bias_free(c.intermediate_size, h)})

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n, h = x.shape
        y, attn = self.attention_norm(x), self.attention
        q, k, v = (attn[p](y).view(n, self.heads, -1).transpose(0, 1) for p in ("q_proj", "k_proj", "v_proj"))
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q[None], k[None], v[None])[0]  # every patch sees every patch
        x = x + attn["o_proj"](o.transpose(0, 1).reshape(n, h))
        y, mlp = self.ffn_norm(x), self.feed_forward
        return x + mlp["down_proj"](self.act(mlp["gate_proj"](y)) * mlp["up_proj"](y))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [heads, N, d] turned rotate-half style by cos, sin [N, d]."""
    a, b = x.chunk(2, -1)
    return x * cos + torch.cat((-b, a), -1) * sin


def _rope_frequencies(c: Mistral3VisionConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The 2-D RoPE's frequencies in fp32: the head's even ones turn with the row, its odd ones with the column
    (PixtralVisionRotaryEmbedding)."""
    head_dim = c.hidden_size // c.num_heads
    inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    return inv_freq[0::2].clone(), inv_freq[1::2].clone()


class _Transformer(nn.Module):
    def __init__(self, c: Mistral3VisionConfig):
        super().__init__()
        self.layers = nn.ModuleList(_Layer(c) for _ in range(c.num_layers))


class _PatchMerger(nn.Module):
    def __init__(self, c: Mistral3VisionConfig):
        super().__init__()
        self.merging_layer = _bias_free(c.hidden_size * c.spatial_merge_size ** 2, c.hidden_size)


class _Projector(nn.Module):
    def __init__(self, c: Mistral3VisionConfig):
        super().__init__()
        self.norm = _RMSNorm(c.hidden_size, c.projector_eps)
        self.patch_merger = _PatchMerger(c)
        self.linear_1 = nn.Linear(c.hidden_size, c.text_hidden_size, bias=c.projector_bias)
        self.linear_2 = nn.Linear(c.text_hidden_size, c.text_hidden_size, bias=c.projector_bias)


class Mistral3Vision(nn.Module):
    """The VisionEncoder of Mistral 3 (llmd.model.vision.base). Parameter names are the tower's in transformers
    (patch_conv, ln_pre, transformer.layers.N.*) and the projector's under multi_modal_projector."""

    bidirectional = False
    row_freq: torch.Tensor
    col_freq: torch.Tensor

    def __init__(self, config: Mistral3VisionConfig):
        super().__init__()
        c = self.config = config
        self.image_token_id = c.image_token_id
        self.patch_conv = nn.Conv2d(3, c.hidden_size, c.patch_size, stride=c.patch_size, bias=False)
        self.ln_pre = _RMSNorm(c.hidden_size, TOWER_EPS)
        self.transformer = _Transformer(c)
        self.multi_modal_projector = _Projector(c)
        row_freq, col_freq = _rope_frequencies(c)
        self.register_buffer("row_freq", row_freq, persistent=False)
        self.register_buffer("col_freq", col_freq, persistent=False)

    def placeholder_text(self) -> str:
        return IMAGE_TOKEN

    def expand(self, text: str, grids: list[tuple[int, int]]) -> str:
        """Each [IMG] widened to its image's (rows, cols) grid (an encoding's shape, llmd.server.vision)."""
        by_size = iter(grids)

        def grid(_: int) -> str:
            rows, cols = next(by_size)
            return (IMAGE_TOKEN * cols + BREAK_TOKEN) * (rows - 1) + IMAGE_TOKEN * cols + END_TOKEN

        return widen(text, IMAGE_TOKEN, [r * c for r, c in grids], grid)

    def preprocess(self, image: Image.Image) -> torch.Tensor:
        c = self.config
        rgb = to_rgb(image)
        height, width = target_size(rgb.height, rgb.width, c.longest_edge, c.unit)
        resized = rgb.resize((width, height), resample=Image.Resampling(c.resample))
        x = torch.from_numpy(np.array(resized, dtype=np.uint8)).permute(2, 0, 1)
        x = (x.to(torch.float64) * c.rescale_factor).to(torch.float32)
        mean, std = (torch.tensor(v, dtype=torch.float32).view(3, 1, 1) for v in (c.image_mean, c.image_std))
        return ((x - mean) / std).contiguous()

    def grid(self, pixel_values: torch.Tensor) -> tuple[int, int]:
        """(rows, cols) of merged image tokens for pixel values [3, H, W]; ValueError for a size preprocess does
        not make."""
        c, shape = self.config, tuple(pixel_values.shape)
        bound = -(-c.longest_edge // c.unit) * c.unit
        if len(shape) != 3 or shape[0] != 3 or not all(0 < s <= bound and s % c.unit == 0 for s in shape[1:]):
            raise ValueError(f"pixel values of shape {shape}, expected (3, H, W) with H and W multiples of {c.unit} "
                             f"up to {bound}")
        return shape[1] // c.unit, shape[2] // c.unit

    def tokens_for(self, pixel_values: torch.Tensor) -> int:
        rows, cols = self.grid(pixel_values)
        return rows * cols

    def _rope_tables(self, rows: int, cols: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.row_freq.device
        r, k = torch.meshgrid(torch.arange(rows, device=device), torch.arange(cols, device=device), indexing="ij")
        angles = torch.cat([r.reshape(-1, 1).float() * self.row_freq, k.reshape(-1, 1).float() * self.col_freq], -1)
        angles = torch.cat([angles, angles], -1)  # [patches, head_dim]
        return angles.cos().to(dtype), angles.sin().to(dtype)

    @torch.no_grad()  # not inference_mode: the engine reads these tensors outside it
    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Pixel values [3, H, W] -> embeddings [rows, cols, text hidden] in the language model's dtype."""
        c, weight = self.config, self.patch_conv.weight
        rows, cols = self.grid(pixel_values)
        m, h = c.spatial_merge_size, c.hidden_size
        x = self.patch_conv(pixel_values.to(weight.device, weight.dtype)[None])[0]  # [hidden, H / patch, W / patch]
        x = self.ln_pre(x.flatten(1).transpose(0, 1))  # [patches, hidden], row-major
        cos, sin = self._rope_tables(rows * m, cols * m, x.dtype)
        for layer in self.transformer.layers:
            x = layer(x, cos, sin)
        proj = self.multi_modal_projector
        x = proj.norm(x)
        # each m x m block of patches as one row, channel-major (torch's unfold): [rows * cols, hidden * m * m]
        blocks = x.view(rows, m, cols, m, h).permute(0, 2, 4, 1, 3).reshape(rows * cols, h * m * m)
        x = proj.linear_2(ACTIVATIONS[c.projector_act](proj.linear_1(proj.patch_merger.merging_layer(blocks))))
        return x.view(rows, cols, c.text_hidden_size)


# ----------------------------------------------------------------------------------------------------------------
# Loading: every tensor located and shape-checked before anything is allocated.


def build(fields: dict[str, Any], where: Path, locate: Callable[[str], Located], dtype: torch.dtype,
          device: torch.device | str) -> Mistral3Vision:
    """The encoder of these settings (a bad one: a ModelFileError naming `where`), each tensor found by `locate`."""
    try:
        config = Mistral3VisionConfig(**fields)
    except ModelFileError as e:  # the config names no file: this one
        raise ModelFileError(where, e.problem) from None
    with torch.device("meta"):
        model = Mistral3Vision(config)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    found = {name: locate(name) for name in shapes}
    for name, (path, file_name, shape, _) in found.items():
        if tuple(shape) != shapes[name]:
            raise ModelFileError(path, f"tensor {file_name!r} has shape {tuple(shape)}, expected {shapes[name]}")
    model = model.to(dtype=dtype).to_empty(device=device).eval().requires_grad_(False)
    model.row_freq, model.col_freq = (f.to(device) for f in _rope_frequencies(config))  # fp32, computed
    params = dict(model.named_parameters())
    for name, (_, _, _, read) in found.items():
        params[name].copy_(read().reshape(shapes[name]))
    return model


def load_mistral3_vision(folder: Path, dtype: torch.dtype, device: torch.device | str) -> Mistral3Vision:
    """The encoder of a Mistral3ForConditionalGeneration folder (config.json, preprocessor_config.json and
    processor_config.json if present, the safetensors files; never pickle)."""
    from ..config import read_json

    folder = Path(folder)
    cfg_path, pre_path, proc_path = (folder / n for n in ("config.json", "preprocessor_config.json",
                                                            "processor_config.json"))
    _, cfg, vision, text = image_text_config(folder, "Mistral 3")
    if cfg.get("vision_feature_layer", -1) != -1:
        raise ModelFileError(cfg_path, f"vision_feature_layer {cfg.get('vision_feature_layer')!r} (only -1)")
    pre = read_json(pre_path) if pre_path.is_file() else {}
    proc = read_json(proc_path) if proc_path.is_file() else {}
    for key, default in (("image_token", IMAGE_TOKEN), ("image_break_token", BREAK_TOKEN),
                         ("image_end_token", END_TOKEN)):
        if proc.get(key, default) != default:
            raise ModelFileError(proc_path, f"{key} {proc[key]!r}: only {default!r}")
    rope: dict = vision["rope_parameters"] if isinstance(vision.get("rope_parameters"), dict) else vision
    size: dict = pre["size"] if isinstance(pre.get("size"), dict) else {}

    def get(values: dict, key: str, kind: type, default: Any, where: Path = cfg_path) -> Any:
        return _config_value(values, key, kind, where, default)

    patch, merge = get(vision, "patch_size", int, 14), get(cfg, "spatial_merge_size", int, 2)
    if get(proc, "patch_size", int, patch, proc_path) != patch:
        raise ModelFileError(proc_path, f"patch_size {proc['patch_size']!r} differs from the vision tower's {patch}")
    if get(proc, "spatial_merge_size", int, merge, proc_path) != merge:
        raise ModelFileError(proc_path, f"spatial_merge_size {proc['spatial_merge_size']!r} differs from "
                                        f"config.json's {merge}")
    fields = dict(
        patch_size=patch, spatial_merge_size=merge, hidden_size=get(vision, "hidden_size", int, 1024),
        intermediate_size=get(vision, "intermediate_size", int, 4096),
        num_layers=get(vision, "num_hidden_layers", int, 24), num_heads=get(vision, "num_attention_heads", int, 16),
        text_hidden_size=get(text, "hidden_size", int, 5120),
        longest_edge=get(size, "longest_edge", int, get(vision, "image_size", int, 1540), pre_path),
        rope_theta=get(rope, "rope_theta", float, 10000.0), hidden_act=vision.get("hidden_act", "gelu"),
        projector_act=cfg.get("projector_hidden_act", "gelu"),
        projector_bias=bool(cfg.get("multimodal_projector_bias", False)),
        projector_eps=get(text, "rms_norm_eps", float, 1e-5),
        image_token_id=get(cfg, "image_token_index", int, get(cfg, "image_token_id", int, 10)),
        image_mean=get(pre, "image_mean", tuple, Mistral3VisionConfig.image_mean, pre_path),
        image_std=get(pre, "image_std", tuple, Mistral3VisionConfig.image_std, pre_path),
        resample=get(pre, "resample", int, 3, pre_path),
        rescale_factor=get(pre, "rescale_factor", float, 1 / 255, pre_path))

    found = tower_tensors(folder, ("vision_tower.", PROJECTOR))  # headers only: tensors are read when used
    tower = _hf_prefix(found, "patch_conv.weight", ("vision_tower.",))
    projector = _hf_prefix(found, "linear_1.weight", (PROJECTOR,))

    def locate(ours: str) -> Located:
        file_name = projector + ours.removeprefix(PROJECTOR) if ours.startswith(PROJECTOR) else tower + ours
        if file_name not in found:
            raise ModelFileError(folder, f"tensor {file_name!r} of the vision encoder is missing")
        path, shape, read = found[file_name]
        return path, file_name, shape, read

    return build(fields, cfg_path, locate, dtype, device)
