"""Qwen3.5 / Qwen3.6's image encoder (Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration: the same
tower), following transformers' modeling_qwen3_5 (Qwen3_5VisionModel), Qwen2VLImageProcessorPil and Qwen3VLProcessor
(the references tests/test_vision_qwen3_5.py compares against); and Qwen3-VL's (Qwen3VLForConditionalGeneration,
Qwen3VLMoeForConditionalGeneration: modeling_qwen3_vl's Qwen3VLVisionModel, tests/test_vision_qwen3_vl.py), from which
Qwen3.5's descends: the same tower plus DeepStack.

Rules:
- preprocess: the RGB image resized (PIL, bicubic unless the processor says otherwise) to smart_resize's size: each
  side rounded to a multiple of patch * merge (32), then scaled, aspect ratio kept, into [min_pixels, max_pixels]
  (the processor's `size` shortest_edge / longest_edge); times 1/255 (float64, then fp32), normalised by the
  processor's mean and std. An image over 200:1 is refused, as the processor does. llmd bounds an image at
  MAX_IMAGE_TOKENS tokens (max_pixels is lowered to that where the processor allows more).
- an image of H x W pixels is (H / patch) x (W / patch) patches and (H / patch / merge) x (W / patch / merge) tokens,
  row-major: its `token_grid`, which the language model's multimodal RoPE gives 2-D positions
  (llmd.engine.sequence.rope_positions).
- expand: each "<|vision_start|><|image_pad|><|vision_end|>" the chat template writes keeps its start and end and
  gets one "<|image_pad|>" (image_token_id) per token; the tokens attend causally, like text.
- encode: the patches in merge-block order (each 2 x 2 block of patches together, blocks row-major), each patch its
  frame twice (temporal_patch_size 2: a still image) flattened (channel, frame, row, column) through the linear
  patch embedding (the checkpoint's Conv3d weight); plus the learned square position grid bilinearly resampled
  (align_corners) to the image's patch grid; blocks of LayerNorm / attention with 2-D RoPE (a head's first quarter
  of frequencies turned by the patch row, the next by the column, rotate-half over the whole head) over every patch
  of the image / LayerNorm / MLP (GELU-tanh); then the merger: LayerNorm per patch, each block's 4 patches
  concatenated, fc1, GELU, fc2 to the text hidden size.
- DeepStack (Qwen3-VL): after each block named by deepstack_visual_indexes, that block's output goes through its own
  merger (the same, but LayerNorm over each block's 4 patches together) to the text hidden size. `encode` returns
  the image's input embeddings followed, along the hidden axis, by those features in block order: [tokens, hidden *
  (1 + len(deepstack_visual_indexes))]; the language model adds the k-th to the output of its k-th decoder layer at
  the image's tokens (llmd.model.qwen3_vl), so a prefill chunk reads the rows of its own tokens, as for the inputs.
- weights: from a Hugging Face folder (config.json's vision_config and image_token_id, preprocessor_config.json or
  processor_config.json's image_processor, the tensors under model.visual. or visual.), read with llmd's own
  bounds-checked readers, every tensor located and shape-checked before anything is allocated; a missing or
  misshapen tensor or a bad setting is a ModelFileError naming the file and the tensor or key (a DeepStack index
  outside the tower, more DeepStack layers than the text model has).
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
from .images import InvalidImage, to_rgb

VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
PLACEHOLDER = VISION_START + IMAGE_PAD + VISION_END
MAX_IMAGE_TOKENS = 4096  # llmd's bound on one image (16384 patches through the tower)
MAX_ASPECT = 200  # the processor's
_CLIP_MEAN, _CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class Qwen35VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    text_hidden_size: int
    patch_size: int = 16
    merge_size: int = 2
    temporal_patch_size: int = 2
    num_position_embeddings: int = 2304
    rope_theta: float = 10000.0
    image_token_id: int = 248056
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, ...] = _CLIP_MEAN
    image_std: tuple[float, ...] = _CLIP_STD
    resample: int = 3  # PIL's BICUBIC, as preprocessor configs number it
    rescale_factor: float = 1 / 255
    deepstack_indexes: tuple[int, ...] = ()  # Qwen3-VL: the blocks whose outputs feed the DeepStack mergers

    def __post_init__(self) -> None:
        sizes = (self.hidden_size, self.intermediate_size, self.num_layers, self.num_heads, self.text_hidden_size,
                 self.patch_size, self.merge_size, self.temporal_patch_size, self.num_position_embeddings,
                 self.min_pixels, self.max_pixels)
        if any(n < 1 for n in sizes) or self.num_layers > MAX_LAYERS:
            raise ModelFileError("config", f"vision sizes must be positive, at most {MAX_LAYERS} layers: {self}")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ModelFileError("config", f"vision hidden size {self.hidden_size} in {self.num_heads} heads: a head's "
                                           "width must be a multiple of 4 (2-D RoPE turns a quarter per axis)")
        if math.isqrt(self.num_position_embeddings) ** 2 != self.num_position_embeddings:
            raise ModelFileError("config", f"num_position_embeddings {self.num_position_embeddings} is not a square")
        if self.min_pixels > self.max_pixels:
            raise ModelFileError("config", f"min_pixels {self.min_pixels} is over max_pixels {self.max_pixels}")
        bound = MAX_IMAGE_TOKENS * self.factor ** 2 // 4  # an image scaled up to min_pixels rounds within the budget
        if self.min_pixels > bound:
            raise ModelFileError("config", f"min_pixels {self.min_pixels} is over llmd's bound of {bound} (an image "
                                           f"takes at most {MAX_IMAGE_TOKENS} tokens)")
        check_normalisation(self.image_mean, self.image_std, self.resample)
        if any(not 0 <= i < self.num_layers for i in self.deepstack_indexes) \
                or len(set(self.deepstack_indexes)) != len(self.deepstack_indexes):
            raise ModelFileError("config", f"deepstack_visual_indexes {list(self.deepstack_indexes)} are not distinct "
                                           f"blocks of the {self.num_layers}-block vision tower")

    @property
    def factor(self) -> int:
        """A resized side is a multiple of this many pixels: one merged token."""
        return self.patch_size * self.merge_size

    @property
    def pixel_budget(self) -> int:
        return min(self.max_pixels, MAX_IMAGE_TOKENS * self.factor ** 2)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The (height, width) the Qwen2-VL image processor resizes an image to (see the module docstring)."""
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise InvalidImage(f"is {width}x{height}: its sides may differ at most {MAX_ASPECT} times")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h, w = max(factor, math.floor(height / beta / factor) * factor), \
            max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, -1)
    return torch.cat((-b, a), -1)


class _Block(nn.Module):
    """One Qwen3_5VisionBlock; submodule names are transformers' (the checkpoint's)."""

    def __init__(self, c: Qwen35VisionConfig):
        super().__init__()
        h = c.hidden_size
        self.heads = c.num_heads
        self.norm1, self.norm2 = nn.LayerNorm(h, eps=1e-6), nn.LayerNorm(h, eps=1e-6)
        self.attn = nn.ModuleDict({"qkv": nn.Linear(h, 3 * h), "proj": nn.Linear(h, h)})
        self.mlp = nn.ModuleDict({"linear_fc1": nn.Linear(h, c.intermediate_size),
                                  "linear_fc2": nn.Linear(c.intermediate_size, h)})

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.attn["qkv"](self.norm1(x)).view(n, 3, self.heads, -1).unbind(1)
        q, k = ((t.float() * cos + _rotate_half(t.float()) * sin).to(t.dtype) for t in (q, k))  # in fp32
        # every patch sees every patch; 4-D, so that the CPU takes its flash kernel rather than a [heads, n, n] matrix
        o = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)))[0]
        x = x + self.attn["proj"](o.transpose(0, 1).reshape(n, -1))
        y = self.mlp["linear_fc1"](self.norm2(x))
        return x + self.mlp["linear_fc2"](F.gelu(y, approximate="tanh"))


class _Merger(nn.Module):
    """Patches [N, hidden] in merge-block order -> tokens [N / merge^2, text hidden]: LayerNorm per patch (after the
    concatenation, over a block's patches together: `postshuffle`, the DeepStack mergers'), fc1, GELU, fc2."""

    def __init__(self, c: Qwen35VisionConfig, postshuffle: bool = False):
        super().__init__()
        wide = c.hidden_size * c.merge_size ** 2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(wide if postshuffle else c.hidden_size, eps=1e-6)
        self.linear_fc1, self.linear_fc2 = nn.Linear(wide, wide), nn.Linear(wide, c.text_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = self.linear_fc1.in_features
        y = self.norm(x.reshape(-1, wide)) if self.postshuffle else self.norm(x).reshape(-1, wide)
        return self.linear_fc2(F.gelu(self.linear_fc1(y)))


class Qwen35Vision(nn.Module):
    """The VisionEncoder of Qwen3.5 and Qwen3-VL (llmd.model.vision.base). Parameter names are transformers' under
    model.visual. (patch_embed.proj.*, pos_embed.weight, blocks.N.*, merger.*, Qwen3-VL's deepstack_merger_list.K.*)."""

    bidirectional = False

    def __init__(self, config: Qwen35VisionConfig):
        super().__init__()
        c = self.config = config
        self.image_token_id = c.image_token_id
        self.patch_embed = nn.ModuleDict({"proj": nn.Conv3d(3, c.hidden_size, (c.temporal_patch_size, c.patch_size,
                                                                               c.patch_size))})
        self.pos_embed = nn.Embedding(c.num_position_embeddings, c.hidden_size)
        self.blocks = nn.ModuleList(_Block(c) for _ in range(c.num_layers))
        self.merger = _Merger(c)
        if c.deepstack_indexes:
            self.deepstack_merger_list = nn.ModuleList(_Merger(c, postshuffle=True) for _ in c.deepstack_indexes)

    def placeholder_text(self) -> str:
        return PLACEHOLDER

    def expand(self, text: str, tokens_per_image: list[int]) -> str:
        return widen(text, PLACEHOLDER, tokens_per_image, lambda n: f"{VISION_START}{IMAGE_PAD * n}{VISION_END}")

    def preprocess(self, image: Image.Image) -> torch.Tensor:
        c = self.config
        rgb = to_rgb(image)
        height, width = smart_resize(rgb.height, rgb.width, c.factor, c.min_pixels, c.pixel_budget)
        if (width, height) != rgb.size:
            rgb = rgb.resize((width, height), resample=Image.Resampling(c.resample))
        x = torch.from_numpy(np.array(rgb, dtype=np.uint8)).permute(2, 0, 1)
        x = (x.to(torch.float64) * c.rescale_factor).to(torch.float32)
        mean, std = (torch.tensor(v, dtype=torch.float32).view(3, 1, 1) for v in (c.image_mean, c.image_std))
        return ((x - mean) / std).contiguous()

    def token_grid(self, pixel_values: torch.Tensor) -> tuple[int, int]:
        """(rows, columns) of the image's tokens (the language model's multimodal RoPE lays them out so)."""
        c, shape = self.config, tuple(pixel_values.shape)
        if len(shape) != 3 or shape[0] != 3 or shape[1] % c.factor or shape[2] % c.factor or not 0 < (
                shape[1] // c.factor) * (shape[2] // c.factor) <= MAX_IMAGE_TOKENS:
            raise ValueError(f"pixel values of shape {shape}: expected (3, H, W), H and W multiples of {c.factor}, "
                             f"at most {MAX_IMAGE_TOKENS} tokens")
        return shape[1] // c.factor, shape[2] // c.factor

    def tokens_for(self, pixel_values: torch.Tensor) -> int:
        rows, cols = self.token_grid(pixel_values)
        return rows * cols

    def _block_order(self, t: torch.Tensor) -> torch.Tensor:
        """[patch rows, patch columns, ...] -> [patches, ...] in merge-block order (the module docstring)."""
        m, (gh, gw) = self.config.merge_size, t.shape[:2]
        return t.reshape(gh // m, m, gw // m, m, *t.shape[2:]).transpose(1, 2).reshape(gh * gw, *t.shape[2:])

    def _positions(self, gh: int, gw: int, device: torch.device) -> torch.Tensor:
        """The learned position grid resampled bilinearly (align_corners) to gh x gw patches, [gh, gw, hidden]."""
        side = math.isqrt(self.config.num_position_embeddings)
        table = self.pos_embed.weight.view(side, side, -1)

        def taps(n: int) -> torch.Tensor:  # [n, side]: each target row's weights over the table's rows
            src = torch.arange(n, dtype=torch.float32, device=device) * (side - 1) / max(n - 1, 1)
            low = src.floor()
            frac = src - low
            weights = torch.zeros(n, side, device=device)
            weights.scatter_add_(1, low.long()[:, None], (1 - frac)[:, None])
            weights.scatter_add_(1, (low.long() + 1).clamp(max=side - 1)[:, None], frac[:, None])
            return weights.to(table.dtype)

        return torch.einsum("ai,ijc,bj->abc", taps(gh), table, taps(gw))

    def patches(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Pixel values [3, H, W] -> the patches [N, 3 * frames * patch * patch] as the image processor lays them out
        (merge-block order, each patch's frame repeated)."""
        c = self.config
        rows, cols = self.token_grid(pixel_values)
        p, gh, gw = c.patch_size, rows * c.merge_size, cols * c.merge_size
        patches = pixel_values.reshape(3, gh, p, gw, p).permute(1, 3, 0, 2, 4)  # [gh, gw, 3, p, p]
        patches = self._block_order(patches).unsqueeze(2).expand(-1, -1, c.temporal_patch_size, -1, -1)
        return patches.reshape(gh * gw, -1)

    @torch.no_grad()  # not inference_mode: the engine reads these tensors outside it
    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        c = self.config
        rows, cols = self.token_grid(pixel_values)
        weight, bias = self.patch_embed["proj"].weight, self.patch_embed["proj"].bias
        device, dtype = weight.device, weight.dtype
        gh, gw = rows * c.merge_size, cols * c.merge_size
        x = F.linear(self.patches(pixel_values.to(device, dtype)), weight.reshape(c.hidden_size, -1), bias)
        x = x + self._block_order(self._positions(gh, gw, device))
        head = c.hidden_size // c.num_heads
        inv = 1.0 / c.rope_theta ** (torch.arange(0, head // 2, 2, dtype=torch.float32, device=device) / (head // 2))
        ys, xs = torch.meshgrid(torch.arange(gh, device=device), torch.arange(gw, device=device), indexing="ij")
        pos = self._block_order(torch.stack((ys, xs), -1)).float()  # [patches, 2]: (row, column)
        angles = torch.cat((pos[:, :1] * inv, pos[:, 1:] * inv), -1)
        angles = torch.cat((angles, angles), -1)[:, None]  # [patches, 1, head]
        cos, sin = angles.cos(), angles.sin()
        deepstack = []  # in block order, each through the merger of its place in deepstack_indexes (as transformers)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin)
            if i in c.deepstack_indexes:
                deepstack.append(self.deepstack_merger_list[c.deepstack_indexes.index(i)](x))
        return torch.cat([self.merger(x), *deepstack], -1)


# ----------------------------------------------------------------------------------------------------------------
# Loading


QWEN3_VL_ARCHITECTURES = ("Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration")


def load_qwen3_5_vision(folder: Path, dtype: torch.dtype, device: torch.device | str) -> Qwen35Vision:
    """The encoder of a Qwen3_5(Moe)ForConditionalGeneration or Qwen3VL(Moe)ForConditionalGeneration folder
    (config.json, the processor's settings, the safetensors files; never pickle)."""
    from ..config import read_json

    folder = Path(folder)
    cfg_path = folder / "config.json"
    _, cfg, vision, text = image_text_config(folder, "Qwen3.5 / Qwen3-VL")
    qwen3_vl = (cfg.get("architectures") or [None])[0] in QWEN3_VL_ARCHITECTURES
    if vision.get("hidden_act", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ModelFileError(cfg_path, f"vision hidden_act {vision.get('hidden_act')!r} (only gelu_pytorch_tanh)")
    if vision.get("in_channels", 3) != 3:
        raise ModelFileError(cfg_path, f"vision in_channels {vision.get('in_channels')!r} (only 3)")
    deepstack = vision.get("deepstack_visual_indexes", [8, 16, 24] if qwen3_vl else None)
    if deepstack and not qwen3_vl:
        raise ModelFileError(cfg_path, "deepstack_visual_indexes: a Qwen3-VL tower, not Qwen3.5's")
    deepstack = deepstack or []
    if not isinstance(deepstack, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in deepstack):
        raise ModelFileError(cfg_path, f"deepstack_visual_indexes {deepstack!r} is not a list of block numbers")
    if len(deepstack) > _config_value(text, "num_hidden_layers", int, cfg_path, 32):
        raise ModelFileError(cfg_path, f"deepstack_visual_indexes {deepstack}: more DeepStack features than the text "
                                       f"model's {text.get('num_hidden_layers')} layers")
    pre_path = folder / "preprocessor_config.json"
    pre = read_json(pre_path) if pre_path.is_file() else None
    if pre is None and (folder / "processor_config.json").is_file():
        pre_path = folder / "processor_config.json"
        pre = read_json(pre_path).get("image_processor")
    pre = pre if isinstance(pre, dict) else {}
    rope = vision.get("rope_parameters") if isinstance(vision.get("rope_parameters"), dict) else {}
    size = pre.get("size") if isinstance(pre.get("size"), dict) else {}

    def get(values: dict, key: str, kind: type, default: Any, where: Path = cfg_path) -> Any:
        return _config_value(values, key, kind, where, default)

    patch, merge = get(vision, "patch_size", int, 16), get(vision, "spatial_merge_size", int, 2)
    temporal = get(vision, "temporal_patch_size", int, 2)
    for key, value in (("patch_size", patch), ("merge_size", merge), ("temporal_patch_size", temporal)):
        if get(pre, key, int, value, pre_path) != value:
            raise ModelFileError(pre_path, f"{key} {pre[key]!r} differs from the vision tower's {value}")
    hidden = get(text, "hidden_size", int, 4096)
    if get(vision, "out_hidden_size", int, hidden) != hidden:
        raise ModelFileError(cfg_path, f"vision out_hidden_size {vision['out_hidden_size']} is not the text model's "
                                       f"hidden size {hidden}")
    min_pixels = get(pre, "min_pixels", int, get(size, "shortest_edge", int, 56 * 56, pre_path), pre_path)
    max_pixels = get(pre, "max_pixels", int, get(size, "longest_edge", int, 28 * 28 * 1280, pre_path), pre_path)
    if not 0 < min_pixels <= max_pixels:
        raise ModelFileError(pre_path, f"min_pixels {min_pixels} is over max_pixels {max_pixels} (or not positive)")
    fields = dict(
        hidden_size=get(vision, "hidden_size", int, 1152), intermediate_size=get(vision, "intermediate_size", int, 4304),
        num_layers=get(vision, "depth", int, 27), num_heads=get(vision, "num_heads", int, 16),
        text_hidden_size=hidden, patch_size=patch, merge_size=merge, temporal_patch_size=temporal,
        num_position_embeddings=get(vision, "num_position_embeddings", int, 2304),
        rope_theta=get(rope, "rope_theta", float, 10000.0),
        image_token_id=get(cfg, "image_token_id", int, 151655 if qwen3_vl else 248056),
        min_pixels=min_pixels, max_pixels=max_pixels,
        image_mean=get(pre, "image_mean", tuple, _CLIP_MEAN, pre_path),
        image_std=get(pre, "image_std", tuple, _CLIP_STD, pre_path),
        resample=get(pre, "resample", int, 3, pre_path),
        rescale_factor=get(pre, "rescale_factor", float, 1 / 255, pre_path), deepstack_indexes=tuple(deepstack))
    try:
        config = Qwen35VisionConfig(**fields)
    except ModelFileError as e:  # the config names no file: this one
        raise ModelFileError(cfg_path, e.problem) from None

    found = tower_tensors(folder, ("visual.",))  # headers only: tensors are read when used
    prefix = _hf_prefix(found, "patch_embed.proj.weight", ("visual.",))

    def locate(ours: str, shape: tuple[int, ...]) -> Located:
        file_name = prefix + ours
        if file_name not in found:
            raise ModelFileError(folder, f"tensor {file_name!r} of the vision encoder is missing")
        path, shape, read = found[file_name]
        return path, file_name, shape, read

    return build_qwen3_5_vision(config, locate, dtype, device)


def build_qwen3_5_vision(config: Qwen35VisionConfig, locate: Callable[[str, tuple[int, ...]], Located],
                         dtype: torch.dtype, device: torch.device | str) -> Qwen35Vision:
    """The encoder with each parameter read from where locate(name, its shape) says (a Hugging Face folder's
    tensors, an mmproj file's: llmd.model.vision.qwen3_5_gguf); every tensor located and shape-checked before any
    is read."""
    with torch.device("meta"):
        model = Qwen35Vision(config)
    shapes = {name: tuple(t.shape) for name, t in model.named_parameters()}
    located = {name: locate(name, shape) for name, shape in shapes.items()}
    for name, (path, file_name, shape, _) in located.items():
        if tuple(shape) != shapes[name]:
            raise ModelFileError(path, f"tensor {file_name!r} has shape {tuple(shape)}, expected {shapes[name]}")
    model = model.to(dtype=dtype).to_empty(device=device).eval().requires_grad_(False)
    params = dict(model.named_parameters())
    for name, (_, _, _, read) in located.items():
        params[name].copy_(read())
    return model
