"""Gemma 3's image encoder (Gemma3ForConditionalGeneration, 4B and up): the SigLIP vision tower and Gemma 3's
multimodal projector, following transformers' modeling_siglip / modeling_gemma3, Gemma3ImageProcessor and
Gemma3Processor (the references tests/test_vision_gemma3.py compares against).

Rules:
- preprocess: the RGB image (transparency composited onto white) resized to image_size x image_size with PIL's
  resample (bilinear), times 1/255 (in float64, then fp32), normalised by the processor's mean and std (0.5 each);
  no pan-and-scan. Every image takes mm_tokens_per_image placeholder tokens (256 on the released models).
- expand: each "<start_of_image>" the chat template writes becomes "\\n\\n<start_of_image>", the image's
  "<image_soft_token>"s and "<end_of_image>\\n\\n"; the soft tokens (image_token_id) carry the embeddings and attend
  to each other both ways.
- encode: conv patch embedding + learned positions, pre-norm encoder layers (LayerNorm, non-causal attention over
  every patch, LayerNorm, fc1 / GELU-tanh / fc2), post LayerNorm; then the projector: the patch grid average-pooled
  to mm_tokens_per_image, an RMSNorm times (1 + weight) in fp32, times the input projection [vision, text hidden].
- weights: from a Hugging Face folder (config.json's vision_config; the tensors under vision_tower. /
  multi_modal_projector., with or without a leading model. and vision_model., as the hub and transformers 4 and 5
  save them) or from llama.cpp's mmproj GGUF (clip.vision.* metadata, v.* / mm.* tensors, the soft-emb norm stored
  as 1 + weight), each read with llmd's own bounds-checked readers. Nothing else in the files is read; a missing or
  misshapen tensor or a bad setting is a ModelFileError naming the file and the tensor or key.
"""

from __future__ import annotations

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
from .images import to_rgb

BOI, IMAGE_TOKEN, EOI = "<start_of_image>", "<image_soft_token>", "<end_of_image>"
PROJECTOR = "multi_modal_projector."
_SCALE = "soft_emb_scale"  # our name for the soft-emb norm's multiplier, 1 + weight, kept in fp32
MAX_LAYERS = 256  # a bound on what a config may ask to build (SigLIP towers have 12-27)


@dataclass(frozen=True)
class Gemma3VisionConfig:
    image_size: int
    patch_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    text_hidden_size: int
    mm_tokens_per_image: int = 256
    layer_norm_eps: float = 1e-6  # the tower's LayerNorms and the soft-emb RMSNorm
    image_token_id: int = 262144
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    resample: int = 2  # PIL's BILINEAR, as preprocessor_config.json numbers it
    rescale_factor: float = 1 / 255

    def __post_init__(self) -> None:
        sizes = (self.image_size, self.patch_size, self.hidden_size, self.intermediate_size, self.num_layers,
                 self.num_heads, self.text_hidden_size, self.mm_tokens_per_image)
        if any(n < 1 for n in sizes) or self.num_layers > MAX_LAYERS:
            raise ModelFileError("config", f"vision sizes must be positive, at most {MAX_LAYERS} layers: {self}")
        side, tokens_side = self.image_size // self.patch_size, round(self.mm_tokens_per_image ** 0.5)
        if self.image_size % self.patch_size or tokens_side ** 2 != self.mm_tokens_per_image or side % tokens_side:
            raise ModelFileError("config", f"{self.image_size} pixels in patches of {self.patch_size} do not pool to "
                                           f"{self.mm_tokens_per_image} tokens (a square grid)")
        if self.hidden_size % self.num_heads:
            raise ModelFileError("config", f"vision hidden size {self.hidden_size} is not a multiple of "
                                           f"{self.num_heads} heads")
        check_normalisation(self.image_mean, self.image_std, self.resample)

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


class _EncoderLayer(nn.Module):
    """One pre-norm SigLIP layer; submodule names are transformers' (the checkpoint's)."""

    def __init__(self, c: Gemma3VisionConfig):
        super().__init__()
        h, eps = c.hidden_size, c.layer_norm_eps
        self.heads = c.num_heads
        self.layer_norm1, self.layer_norm2 = nn.LayerNorm(h, eps=eps), nn.LayerNorm(h, eps=eps)
        self.self_attn = nn.ModuleDict({p: nn.Linear(h, h) for p in ("q_proj", "k_proj", "v_proj", "out_proj")})
        self.mlp = nn.ModuleDict({"fc1": nn.Linear(h, c.intermediate_size), "fc2": nn.Linear(c.intermediate_size, h)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, h = x.shape
        y, attn = self.layer_norm1(x), self.self_attn
        q, k, v = (attn[p](y).view(b, n, self.heads, -1).transpose(1, 2) for p in ("q_proj", "k_proj", "v_proj"))
        o = F.scaled_dot_product_attention(q, k, v)  # every patch sees every patch; scale head_dim ** -0.5
        x = x + attn["out_proj"](o.transpose(1, 2).reshape(b, n, h))
        return x + self.mlp["fc2"](F.gelu(self.mlp["fc1"](self.layer_norm2(x)), approximate="tanh"))


class _Embeddings(nn.Module):
    def __init__(self, c: Gemma3VisionConfig):
        super().__init__()
        self.patch_embedding = nn.Conv2d(3, c.hidden_size, c.patch_size, stride=c.patch_size)
        self.position_embedding = nn.Embedding(c.patches_per_side ** 2, c.hidden_size)


class _Encoder(nn.Module):
    def __init__(self, c: Gemma3VisionConfig):
        super().__init__()
        self.layers = nn.ModuleList(_EncoderLayer(c) for _ in range(c.num_layers))


class Gemma3Vision(nn.Module):
    """The VisionEncoder of Gemma 3 (llmd.model.vision.base). Parameter names are the tower's in transformers
    (embeddings.*, encoder.layers.N.*, post_layernorm.*) plus the projector's mm_input_projection_weight."""

    bidirectional = True

    def __init__(self, config: Gemma3VisionConfig):
        super().__init__()
        c = self.config = config
        self.image_token_id = c.image_token_id
        self.embeddings = _Embeddings(c)
        self.encoder = _Encoder(c)
        self.post_layernorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.mm_input_projection_weight = nn.Parameter(torch.empty(c.hidden_size, c.text_hidden_size))
        self.register_buffer(_SCALE, torch.empty(c.hidden_size, dtype=torch.float32))

    def placeholder_text(self) -> str:
        return BOI

    def expand(self, text: str, tokens_per_image: list[int]) -> str:
        return widen(text, BOI, tokens_per_image, lambda n: f"\n\n{BOI}{IMAGE_TOKEN * n}{EOI}\n\n")

    def preprocess(self, image: Image.Image) -> torch.Tensor:
        c = self.config
        size = c.image_size
        resized = to_rgb(image).resize((size, size), resample=Image.Resampling(c.resample))
        x = torch.from_numpy(np.array(resized, dtype=np.uint8)).permute(2, 0, 1)
        x = (x.to(torch.float64) * c.rescale_factor).to(torch.float32)
        mean, std = (torch.tensor(v, dtype=torch.float32).view(3, 1, 1) for v in (c.image_mean, c.image_std))
        return ((x - mean) / std).contiguous()

    def tokens_for(self, pixel_values: torch.Tensor) -> int:
        return self.config.mm_tokens_per_image

    @torch.no_grad()  # not inference_mode: the engine reads these tensors outside it
    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        c, weight = self.config, self.mm_input_projection_weight
        if tuple(pixel_values.shape) != (3, c.image_size, c.image_size):
            raise ValueError(f"pixel values of shape {tuple(pixel_values.shape)}, expected "
                             f"(3, {c.image_size}, {c.image_size})")
        x = self.embeddings.patch_embedding(pixel_values.to(weight.device, weight.dtype)[None])
        x = x.flatten(2).transpose(1, 2) + self.embeddings.position_embedding.weight
        for layer in self.encoder.layers:
            x = layer(x)
        x = self.post_layernorm(x)[0]  # [patches, hidden]
        side, tokens_side = c.patches_per_side, round(c.mm_tokens_per_image ** 0.5)
        grid = x.transpose(0, 1).reshape(1, c.hidden_size, side, side)
        pooled = F.avg_pool2d(grid, side // tokens_side).flatten(2)[0].transpose(0, 1)  # [tokens, hidden]
        p = pooled.float()
        normed = p * torch.rsqrt(p.pow(2).mean(-1, keepdim=True) + c.layer_norm_eps) * getattr(self, _SCALE)
        return normed.to(x.dtype) @ weight


# ----------------------------------------------------------------------------------------------------------------
# Loading: `_build` asks a format's `locate` for each tensor the encoder needs (our name -> the file, the tensor's
# name and shape there, its reader), checks every one against the model's shapes, and only then allocates and reads:
# what a file can make llmd allocate is bounded by what it holds.

Located = tuple[Path, str, tuple[int, ...], Callable[[], torch.Tensor]]


def _build(config: Gemma3VisionConfig, locate: Callable[[str], Located], dtype: torch.dtype,
           device: torch.device | str) -> Gemma3Vision:
    with torch.device("meta"):
        model = Gemma3Vision(config)
    shapes = {name: tuple(t.shape) for name, t in [*model.named_parameters(), (_SCALE, getattr(model, _SCALE))]}
    found = {name: locate(name) for name in shapes}
    for name, (path, file_name, shape, _) in found.items():
        if tuple(shape) != shapes[name]:
            raise ModelFileError(path, f"tensor {file_name!r} has shape {tuple(shape)}, expected {shapes[name]}")
    model = model.to(dtype=dtype).to_empty(device=device).eval().requires_grad_(False)
    params = dict(model.named_parameters())
    for name, (_, _, _, read) in found.items():
        if name == _SCALE:  # fp32 whatever the model's dtype, as transformers computes the norm
            setattr(model, _SCALE, read().to(device=device, dtype=torch.float32))
        else:
            params[name].copy_(read())
    return model


def _config_value(values: dict, key: str, kind: type, where: Path, default: Any) -> Any:
    value = values.get(key, default)
    try:
        if value is None or isinstance(value, (bool, dict)):
            raise TypeError
        return tuple(float(v) for v in value) if kind is tuple else kind(value)
    except (TypeError, ValueError):
        raise ModelFileError(where, f"{key} is missing or not a {kind.__name__}: {value!r}") from None


def _checked_config(fields: dict[str, Any], where: Path) -> Gemma3VisionConfig:
    try:
        return Gemma3VisionConfig(**fields)
    except ModelFileError as e:  # the config names no file: this one
        raise ModelFileError(where, e.problem) from None


def load_gemma3_vision(folder: Path, dtype: torch.dtype, device: torch.device | str) -> Gemma3Vision:
    """The encoder of a Gemma3ForConditionalGeneration folder (config.json, preprocessor_config.json if present,
    the safetensors files; never pickle)."""
    from ..config import read_json

    folder = Path(folder)
    cfg_path, pre_path = folder / "config.json", folder / "preprocessor_config.json"
    _, cfg, vision, text = image_text_config(folder, "Gemma 3")
    if vision.get("hidden_act", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ModelFileError(cfg_path, f"vision hidden_act {vision.get('hidden_act')!r} (only gelu_pytorch_tanh)")
    pre = read_json(pre_path) if pre_path.is_file() else {}

    def get(values: dict, key: str, kind: type, default: Any, where: Path = cfg_path) -> Any:
        return _config_value(values, key, kind, where, default)

    config = _checked_config(dict(
        image_size=get(vision, "image_size", int, 224), patch_size=get(vision, "patch_size", int, 16),
        hidden_size=get(vision, "hidden_size", int, 768), intermediate_size=get(vision, "intermediate_size", int, 3072),
        num_layers=get(vision, "num_hidden_layers", int, 12), num_heads=get(vision, "num_attention_heads", int, 12),
        layer_norm_eps=get(vision, "layer_norm_eps", float, 1e-6), text_hidden_size=get(text, "hidden_size", int, 2304),
        mm_tokens_per_image=get(cfg, "mm_tokens_per_image", int, 256),
        image_token_id=get(cfg, "image_token_index", int, 262144),
        image_mean=get(pre, "image_mean", tuple, (0.5, 0.5, 0.5), pre_path),
        image_std=get(pre, "image_std", tuple, (0.5, 0.5, 0.5), pre_path),
        resample=get(pre, "resample", int, 2, pre_path),
        rescale_factor=get(pre, "rescale_factor", float, 1 / 255, pre_path)), cfg_path)

    found = tower_tensors(folder, ("vision_tower.", PROJECTOR))  # headers only: tensors are read when used
    tower = _hf_prefix(found, "embeddings.patch_embedding.weight", ("vision_tower.vision_model.", "vision_tower."))
    projector = _hf_prefix(found, "mm_input_projection_weight", (PROJECTOR,))

    def locate(ours: str) -> Located:
        file_name = projector + ("mm_soft_emb_norm.weight" if ours == _SCALE else ours) \
            if ours in (_SCALE, "mm_input_projection_weight") else tower + ours
        if file_name not in found:
            raise ModelFileError(folder, f"tensor {file_name!r} of the vision encoder is missing")
        path, shape, read = found[file_name]

        def plus_one() -> torch.Tensor:  # the checkpoint holds the norm's weight; we keep its multiplier
            return 1.0 + read().float()

        return path, file_name, shape, plus_one if ours == _SCALE else read

    return _build(config, locate, dtype, device)


def _hf_prefix(found: dict, leaf: str, prefixes: tuple[str, ...]) -> str:
    """The prefix this checkpoint puts before a part's names (each tried with and without a leading "model.")."""
    for prefix in [p for q in prefixes for p in ("model." + q, q)]:
        if prefix + leaf in found:
            return prefix
    return prefixes[0]  # absent: the missing-tensor error names the hub's layout


# our module names -> llama.cpp's mmproj names (a layer's: v.blk.N.<name>)
_GGUF_NAMES = {"embeddings.patch_embedding": "v.patch_embd", "embeddings.position_embedding": "v.position_embd",
               "post_layernorm": "v.post_ln", "layer_norm1": "ln1", "layer_norm2": "ln2", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.out_proj": "attn_out",
               "mlp.fc1": "ffn_up", "mlp.fc2": "ffn_down"}


def gguf_tensor_name(ours: str) -> str:
    """The mmproj GGUF's name of one of our tensors."""
    if ours == _SCALE:
        return "mm.soft_emb_norm.weight"  # 1 + weight, as we keep it
    if ours == "mm_input_projection_weight":
        return "mm.input_projection.weight"  # [vision hidden, text hidden] in torch order, as transformers'
    module, _, leaf = ours.rpartition(".")
    if module.startswith("encoder.layers."):
        _, _, index, rest = module.split(".", 3)
        return f"v.blk.{index}.{_GGUF_NAMES[rest]}.{leaf}"
    return f"{_GGUF_NAMES[module]}.{leaf}"


def open_mmproj(path: Path, projector: str, family: str) -> tuple[Any, Callable[..., Any], dict]:
    """A llama.cpp mmproj GGUF with a `projector` type projector: (the file, key(name, kind, default) reading
    clip.vision.NAME, its tensors by name); a ModelFileError naming the file for any other."""
    from ..gguf import _GGUFFile

    gf = _GGUFFile(path)
    meta, where = gf.metadata, gf.path
    kind = meta.get("clip.vision.projector_type", meta.get("clip.projector_type"))
    if meta.get("general.architecture") != "clip" or kind != projector:
        raise ModelFileError(where, f"not a {family} mmproj file (general.architecture "
                                    f"{meta.get('general.architecture')!r}, projector type {kind!r})")

    def key(name: str, kind: type, default: Any = None) -> Any:
        return _config_value(meta, f"clip.vision.{name}", kind, where, default)

    return gf, key, {info.name: info for info in gf.tensors}


def load_gemma3_mmproj(path: Path, dtype: torch.dtype, device: torch.device | str,
                       image_token_id: int = 262144) -> Gemma3Vision:
    """The encoder of a llama.cpp mmproj GGUF with a Gemma 3 projector. The file does not hold the image token's id:
    the text model's vocabulary does (<image_soft_token>, 262144 on the released models)."""
    from ..gguf import SUPPORTED_TYPES, dequantize, gguf_can_dequantize

    gf, key, infos = open_mmproj(path, "gemma3", "Gemma 3")
    where = gf.path

    image_size, patch_size = key("image_size", int), key("patch_size", int)
    merge = key("projector.scale_factor", int, 4)  # the pooling kernel; llama.cpp writes it only when not 4
    config = _checked_config(dict(
        image_size=image_size, patch_size=patch_size, hidden_size=key("embedding_length", int),
        intermediate_size=key("feed_forward_length", int), num_layers=key("block_count", int),
        num_heads=key("attention.head_count", int), text_hidden_size=key("projection_dim", int),
        mm_tokens_per_image=(image_size // max(patch_size, 1) // max(merge, 1)) ** 2,
        layer_norm_eps=key("attention.layer_norm_epsilon", float, 1e-6), image_token_id=image_token_id,
        image_mean=key("image_mean", tuple, (0.5, 0.5, 0.5)), image_std=key("image_std", tuple, (0.5, 0.5, 0.5))),
        where)

    def locate(ours: str) -> Located:
        name = gguf_tensor_name(ours)
        info = infos.get(name)
        if info is None:
            raise ModelFileError(where, f"tensor {name!r} of the vision encoder is missing")
        if info.type_name not in SUPPORTED_TYPES and not gguf_can_dequantize(info.type_name):
            raise ModelFileError(where, f"tensor {name!r} has type {info.type_name}, which llmd cannot read")
        return where, name, info.shape, lambda: dequantize(gf.raw_bytes(info), info.type_name, info.shape)

    return _build(config, locate, dtype, device)
