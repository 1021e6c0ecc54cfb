"""Gemma 4's image encoder (Gemma4ForConditionalGeneration): the vision tower and the multimodal embedder, following
transformers' modeling_gemma4 (Gemma4VisionModel, Gemma4MultimodalEmbedder), Gemma4ImageProcessorPil and
Gemma4Processor (the references tests/test_vision_gemma4.py compares against).

Rules:
- preprocess: the RGB image resized, aspect ratio kept, to the largest size whose sides are multiples of
  pooling * patch and which holds at most max_soft_tokens * pooling^2 patches (a side that would round to nothing
  takes one multiple), with PIL's resample (bicubic); times 1/255 (float64, then fp32); normalised only where the
  processor says so (the released ones do not). An image takes (H / patch) * (W / patch) / pooling^2 tokens, at
  most max_soft_tokens (the processor's: 280 on the released models; one of 70, 140, 280, 560, 1120).
- expand: each "<|image|>" the chat template writes becomes "<|image>", the image's "<|image|>"s and "<image|>".
  With the text config's use_bidirectional_attention "vision" (26B-A4B, 31B) an image's tokens attend to each other
  both ways in the text model's sliding layers, within their window (llmd.model.gemma4); without it (E2B, E4B)
  causally.
- encode: the patches (row-major, each patch x patch x RGB) mapped to [-1, 1], a linear patch embedding plus learned
  embeddings of the patch's column and row; encoder layers with RMSNorms (times weight) before and after attention
  and MLP, q and k RMS-normed with weights and v without, 2-D RoPE (a head's first half turned by the column, its
  second by the row), scale 1, every patch seeing every patch, a GELU-tanh gated MLP, each linear layer's input and
  output clamped to learned bounds where use_clipped_linears; the patch grid average-pooled pooling x pooling, times
  sqrt(hidden) in fp32, standardised ((h - std_bias) * std_scale, fp32) where the config says so; then the
  embedder: an RMSNorm without weight and the projection to the text hidden size.
- weights: from a Hugging Face folder (config.json's vision_config; processor_config.json's image_processor, or
  preprocessor_config.json; the tensors model.vision_tower.* and model.embed_vision.*, the leading model. optional)
  or llama.cpp's mmproj GGUF (llmd.model.vision.gemma4_gguf), read with llmd's own bounds-checked readers, every tensor located and shape-checked before
  anything is allocated. A missing or misshapen tensor or a bad setting is a ModelFileError naming the file and the
  tensor or key.
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
from ..gemma4 import Gemma4RMSNorm, gelu_tanh
from .base import check_normalisation, image_text_config, tower_tensors, widen
from .gemma3 import MAX_LAYERS, Located, _config_value, _hf_prefix
from .images import to_rgb

BOI, IMAGE_TOKEN, EOI = "<|image>", "<|image|>", "<image|>"
SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)  # the processor's choices of max_soft_tokens
CLIP_BOUNDS = ("input_min", "input_max", "output_min", "output_max")  # a clipped linear layer's
_FP32 = ("std_bias", "std_scale")  # kept in fp32 whatever the model's dtype, as transformers computes with them


@dataclass(frozen=True)
class Gemma4VisionConfig:
    patch_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    text_hidden_size: int
    pooling: int = 3
    position_embedding_size: int = 10240
    rope_theta: float = 100.0
    rms_norm_eps: float = 1e-6
    standardize: bool = False
    clipped: bool = False  # use_clipped_linears
    max_soft_tokens: int = 280
    image_token_id: int = 258880
    bidirectional: bool = False
    resample: int = 3  # PIL's BICUBIC, as preprocessor configs number it
    rescale_factor: float = 1 / 255
    normalize: bool = False
    image_mean: tuple[float, ...] = (0.0, 0.0, 0.0)
    image_std: tuple[float, ...] = (1.0, 1.0, 1.0)

    def __post_init__(self) -> None:
        sizes = (self.patch_size, self.hidden_size, self.intermediate_size, self.num_layers, self.num_heads,
                 self.num_kv_heads, self.head_dim, self.text_hidden_size, self.pooling, self.position_embedding_size)
        if any(n < 1 for n in sizes) or self.num_layers > MAX_LAYERS:
            raise ModelFileError("config", f"vision sizes must be positive, at most {MAX_LAYERS} layers: {self}")
        if self.num_heads % self.num_kv_heads or self.head_dim % 4:
            raise ModelFileError("config", f"{self.num_heads} heads in {self.num_kv_heads} KV heads of width "
                                           f"{self.head_dim} (a multiple of 4: 2-D RoPE turns a quarter per axis)")
        if self.max_soft_tokens not in SOFT_TOKEN_BUDGETS:
            raise ModelFileError("config", f"max_soft_tokens {self.max_soft_tokens} is not one of {SOFT_TOKEN_BUDGETS}")
        if self.max_soft_tokens * self.pooling > self.position_embedding_size:
            raise ModelFileError("config", f"a row of {self.max_soft_tokens} tokens needs "
                                           f"{self.max_soft_tokens * self.pooling} patch positions, the table holds "
                                           f"{self.position_embedding_size}")
        check_normalisation(self.image_mean, self.image_std, self.resample)


def target_size(height: int, width: int, patch: int, max_patches: int, pooling: int) -> tuple[int, int]:
    """The (height, width) Gemma4ImageProcessor resizes an image to (see the module docstring)."""
    factor = math.sqrt(max_patches * patch ** 2 / (height * width))
    side = pooling * patch
    new_h, new_w = math.floor(factor * height / side) * side, math.floor(factor * width / side) * side
    longest = max_patches // pooling ** 2 * side
    if new_h == 0:  # (both cannot be: the budget holds at least 70 tokens' worth of sides)
        return side, min(width // height * side, longest)
    if new_w == 0:
        return min(height // width * side, longest), side
    return new_h, new_w


class _Linear(nn.Module):
    """Gemma4ClippableLinear: bias-free, its input and output clamped to the learned bounds where clipped."""

    def __init__(self, c: Gemma4VisionConfig, n_in: int, n_out: int):
        super().__init__()
        self.linear = nn.Linear(n_in, n_out, bias=False)
        self.clipped = c.clipped
        for name in CLIP_BOUNDS if c.clipped else ():
            self.register_buffer(name, torch.empty(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.clipped:
            return self.linear(x)
        y = self.linear(x.clamp(self.input_min, self.input_max))
        return y.clamp(self.output_min, self.output_max)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, d] turned by 2-D RoPE: each half of a head rotate-half style by its axis' angles (cos, sin [N, d])."""
    out = []
    for part, c, s in zip(x.chunk(2, -1), cos.chunk(2, -1), sin.chunk(2, -1), strict=True):
        a, b = part.chunk(2, -1)
        out.append(part * c[:, None] + torch.cat((-b, a), -1) * s[:, None])
    return torch.cat(out, -1)


class _EncoderLayer(nn.Module):
    """One Gemma4VisionEncoderLayer; submodule names are transformers' (the checkpoint's)."""

    def __init__(self, c: Gemma4VisionConfig):
        super().__init__()
        h, d, eps = c.hidden_size, c.head_dim, c.rms_norm_eps
        self.heads, self.kv_heads = c.num_heads, c.num_kv_heads
        self.self_attn = nn.ModuleDict({
            "q_proj": _Linear(c, h, c.num_heads * d), "k_proj": _Linear(c, h, c.num_kv_heads * d),
            "v_proj": _Linear(c, h, c.num_kv_heads * d), "o_proj": _Linear(c, c.num_heads * d, h),
            "q_norm": Gemma4RMSNorm(d, eps), "k_norm": Gemma4RMSNorm(d, eps)})
        self.v_norm = Gemma4RMSNorm(d, eps, with_scale=False)
        self.mlp = nn.ModuleDict({"gate_proj": _Linear(c, h, c.intermediate_size),
                                  "up_proj": _Linear(c, h, c.intermediate_size),
                                  "down_proj": _Linear(c, c.intermediate_size, h)})
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, Gemma4RMSNorm(h, eps))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n, attn, mlp = x.shape[0], self.self_attn, self.mlp
        y = self.input_layernorm(x)
        q = _rope(attn["q_norm"](attn["q_proj"](y).view(n, self.heads, -1)), cos, sin)
        k = _rope(attn["k_norm"](attn["k_proj"](y).view(n, self.kv_heads, -1)), cos, sin)
        v = self.v_norm(attn["v_proj"](y).view(n, self.kv_heads, -1))
        k, v = (t.repeat_interleave(self.heads // self.kv_heads, dim=1).transpose(0, 1) for t in (k, v))
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, scale=1.0)  # every patch sees every patch
        x = x + self.post_attention_layernorm(attn["o_proj"](o.transpose(0, 1).reshape(n, -1)))
        y = self.pre_feedforward_layernorm(x)
        return x + self.post_feedforward_layernorm(mlp["down_proj"](gelu_tanh(mlp["gate_proj"](y)) * mlp["up_proj"](y)))


class _PatchEmbedder(nn.Module):
    def __init__(self, c: Gemma4VisionConfig):
        super().__init__()
        self.input_proj = nn.Linear(3 * c.patch_size ** 2, c.hidden_size, bias=False)
        self.position_embedding_table = nn.Parameter(torch.empty(2, c.position_embedding_size, c.hidden_size))


class Gemma4Vision(nn.Module):
    """The VisionEncoder of Gemma 4 (llmd.model.vision.base). Tensor names are the tower's in transformers
    (patch_embedder.*, encoder.layers.N.*, std_bias / std_scale) plus the embedder's embedding_projection.weight."""

    def __init__(self, config: Gemma4VisionConfig):
        super().__init__()
        c = self.config = config
        self.image_token_id, self.bidirectional = c.image_token_id, c.bidirectional
        self.patch_embedder = _PatchEmbedder(c)
        self.encoder = nn.ModuleDict({"layers": nn.ModuleList(_EncoderLayer(c) for _ in range(c.num_layers))})
        for name in _FP32 if c.standardize else ():
            self.register_buffer(name, torch.empty(c.hidden_size, dtype=torch.float32))
        self.pre_projection_norm = Gemma4RMSNorm(c.hidden_size, c.rms_norm_eps, with_scale=False)
        self.embedding_projection = nn.Linear(c.hidden_size, c.text_hidden_size, bias=False)

    def placeholder_text(self) -> str:
        return IMAGE_TOKEN

    def expand(self, text: str, tokens_per_image: list[int]) -> str:
        return widen(text, IMAGE_TOKEN, tokens_per_image, lambda n: f"{BOI}{IMAGE_TOKEN * n}{EOI}")

    def preprocess(self, image: Image.Image) -> torch.Tensor:
        c = self.config
        rgb = to_rgb(image)
        height, width = target_size(rgb.height, rgb.width, c.patch_size, c.max_soft_tokens * c.pooling ** 2,
                                    c.pooling)
        if (width, height) != rgb.size:
            rgb = rgb.resize((width, height), resample=Image.Resampling(c.resample))
        x = torch.from_numpy(np.array(rgb, dtype=np.uint8)).permute(2, 0, 1)
        x = (x.to(torch.float64) * c.rescale_factor).to(torch.float32)
        if c.normalize:
            mean, std = (torch.tensor(v, dtype=torch.float32).view(3, 1, 1) for v in (c.image_mean, c.image_std))
            x = (x - mean) / std
        return x.contiguous()

    def tokens_for(self, pixel_values: torch.Tensor) -> int:
        p, k = self.config.patch_size, self.config.pooling
        return (pixel_values.shape[1] // p) * (pixel_values.shape[2] // p) // k ** 2

    def patches(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pixel values [3, H, W] -> the patches [N, patch * patch * 3] row by row (as the image processor lays them
        out) and each one's (column, row) [N, 2]."""
        c, shape = self.config, tuple(pixel_values.shape)
        side = c.patch_size * c.pooling
        if len(shape) != 3 or shape[0] != 3 or shape[1] % side or shape[2] % side or not 0 < self.tokens_for(
                pixel_values) <= c.max_soft_tokens:
            raise ValueError(f"pixel values of shape {shape}: expected (3, H, W), H and W multiples of {side}, at most "
                             f"{c.max_soft_tokens} tokens")
        p, rows, cols = c.patch_size, shape[1] // c.patch_size, shape[2] // c.patch_size
        patches = pixel_values.reshape(3, rows, p, cols, p).permute(1, 3, 2, 4, 0).reshape(rows * cols, -1)
        ys, xs = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
        return patches, torch.stack((xs, ys), -1).reshape(-1, 2)

    @torch.no_grad()  # not inference_mode: the engine reads these tensors outside it
    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        c, weight = self.config, self.embedding_projection.weight
        patches, pos = (t.to(weight.device) for t in self.patches(pixel_values))
        embed = self.patch_embedder
        x = embed.input_proj((2 * (patches - 0.5)).to(weight.dtype))
        x = x + (embed.position_embedding_table[0][pos[:, 0]] + embed.position_embedding_table[1][pos[:, 1]])
        half = c.head_dim // 2
        inv = 1.0 / c.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float32, device=weight.device) / half)
        fx, fy = pos[:, :1].float() * inv, pos[:, 1:].float() * inv
        angles = torch.cat((fx, fx, fy, fy), -1)
        cos, sin = angles.cos().to(weight.dtype), angles.sin().to(weight.dtype)
        for layer in self.encoder["layers"]:
            x = layer(x, cos, sin)
        rows, cols = pixel_values.shape[1] // c.patch_size, pixel_values.shape[2] // c.patch_size
        grid = x.float().transpose(0, 1).reshape(1, c.hidden_size, rows, cols)
        pooled = F.avg_pool2d(grid, c.pooling).flatten(2)[0].transpose(0, 1).to(x.dtype)  # [tokens, hidden]
        h = pooled.float() * c.hidden_size ** 0.5
        if c.standardize:
            h = (h - self.std_bias) * self.std_scale
        return self.embedding_projection(self.pre_projection_norm(h.to(weight.dtype)))


# ----------------------------------------------------------------------------------------------------------------
# Loading (the mmproj GGUF's: llmd.model.vision.gemma4_gguf)


def build(fields: dict[str, Any], where: Path, locate: Callable[[str], Located], dtype: torch.dtype,
           device: torch.device | str) -> Gemma4Vision:
    """The encoder of these settings (a bad one: a ModelFileError naming `where`), each tensor found by `locate`
    (our name -> the file, the tensor's name and shape there, its reader) and checked before any is allocated."""
    try:
        config = Gemma4VisionConfig(**fields)
    except ModelFileError as e:  # the config names no file: this one
        raise ModelFileError(where, e.problem) from None
    with torch.device("meta"):
        model = Gemma4Vision(config)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict(keep_vars=True).items()}
    found = {name: locate(name) for name in shapes}
    for name, (path, file_name, shape, _) in found.items():
        if tuple(shape) != shapes[name]:
            raise ModelFileError(path, f"tensor {file_name!r} has shape {tuple(shape)}, expected {shapes[name]}")
    model = model.to(dtype=dtype).to_empty(device=device).eval().requires_grad_(False)
    state = model.state_dict(keep_vars=True)
    for name, (_, _, _, read) in found.items():
        if name in _FP32:
            setattr(model, name, read().to(device=device, dtype=torch.float32))
        else:
            state[name].copy_(read().reshape(shapes[name]))
    return model


def load_gemma4_vision(folder: Path, dtype: torch.dtype, device: torch.device | str) -> Gemma4Vision:
    """The encoder of a Gemma4ForConditionalGeneration folder (config.json, the processor's settings, the
    safetensors files; never pickle)."""
    from ..config import read_json

    folder = Path(folder)
    cfg_path = folder / "config.json"
    _, cfg, vision, text = image_text_config(folder, "Gemma 4")
    if vision.get("hidden_activation", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ModelFileError(cfg_path, f"vision hidden_activation {vision.get('hidden_activation')!r} (only "
                                       "gelu_pytorch_tanh)")
    pre_path = folder / "processor_config.json"  # the released models' image_processor section, else the older file
    pre = read_json(pre_path).get("image_processor") if pre_path.is_file() else None
    if not isinstance(pre, dict):
        pre_path = folder / "preprocessor_config.json"
        pre = read_json(pre_path) if pre_path.is_file() else {}
    rope = vision.get("rope_parameters") if isinstance(vision.get("rope_parameters"), dict) else {}

    def get(values: dict, key: str, kind: type, default: Any, where: Path = cfg_path) -> Any:
        return _config_value(values, key, kind, where, default)

    patch, pooling = get(vision, "patch_size", int, 16), get(vision, "pooling_kernel_size", int, 3)
    for key, value in (("patch_size", patch), ("pooling_kernel_size", pooling)):
        if get(pre, key, int, value, pre_path) != value:
            raise ModelFileError(pre_path, f"{key} {pre[key]!r} differs from the vision tower's {value}")
    budget, heads = get(pre, "max_soft_tokens", int, 280, pre_path), get(vision, "num_attention_heads", int, 12)
    if budget not in SOFT_TOKEN_BUDGETS:
        raise ModelFileError(pre_path, f"max_soft_tokens {budget} is not one of {SOFT_TOKEN_BUDGETS}")
    fields = dict(
        patch_size=patch, hidden_size=get(vision, "hidden_size", int, 768),
        intermediate_size=get(vision, "intermediate_size", int, 3072),
        num_layers=get(vision, "num_hidden_layers", int, 16), num_heads=heads,
        num_kv_heads=get(vision, "num_key_value_heads", int, heads), head_dim=get(vision, "head_dim", int, 64),
        text_hidden_size=get(text, "hidden_size", int, 2304), pooling=pooling,
        position_embedding_size=get(vision, "position_embedding_size", int, 10240),
        rope_theta=get(rope, "rope_theta", float, 100.0), rms_norm_eps=get(vision, "rms_norm_eps", float, 1e-6),
        standardize=bool(vision.get("standardize", False)), clipped=bool(vision.get("use_clipped_linears", False)),
        max_soft_tokens=budget,
        image_token_id=get(cfg, "image_token_id", int, 258880),
        bidirectional=text.get("use_bidirectional_attention") == "vision",
        resample=get(pre, "resample", int, 3, pre_path), rescale_factor=get(pre, "rescale_factor", float, 1 / 255,
                                                                            pre_path),
        normalize=bool(pre.get("do_normalize", False)), image_mean=get(pre, "image_mean", tuple, (0, 0, 0), pre_path),
        image_std=get(pre, "image_std", tuple, (1, 1, 1), pre_path))

    found = tower_tensors(folder, ("vision_tower.", "embed_vision."))  # headers only: tensors are read when used
    tower = _hf_prefix(found, "patch_embedder.input_proj.weight", ("vision_tower.",))
    embedder = _hf_prefix(found, "embedding_projection.weight", ("embed_vision.",))

    def locate(ours: str) -> Located:
        file_name = (embedder if ours.startswith("embedding_projection") else tower) + ours
        if file_name not in found:
            raise ModelFileError(folder, f"tensor {file_name!r} of the vision encoder is missing")
        path, shape, read = found[file_name]
        return path, file_name, shape, read

    return build(fields, cfg_path, locate, dtype, device)
