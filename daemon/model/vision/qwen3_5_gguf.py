"""Qwen3.5's and Qwen3-VL's image encoder (llmd.model.vision.qwen3_5) from llama.cpp's mmproj GGUF: projector type
qwen3vl_merger, as llama.cpp's converter (Qwen3VLVisionModel) writes both families' towers.

What the file holds, and how it is read:
- clip.vision.* keys: patch_size, embedding_length, feed_forward_length, block_count, attention.head_count,
  projection_dim (the text hidden size), spatial_merge_size, image_size (sqrt(num_position_embeddings) * patch: the
  learned position grid's side), image_mean / image_std, clip.use_gelu (the tower's GELU-tanh);
  is_deepstack_layers (Qwen3-VL: one flag per block, the DeepStack blocks). The processor's pixel bounds are
  image_min_pixels / image_max_pixels where the file has them, else the Hugging Face processor's defaults for these
  families; llmd's own bound of MAX_IMAGE_TOKENS applies either way;
- tensors: the Conv3d patch embedding split by frame (v.patch_embd.weight and .weight.1: stacked back), its bias,
  v.position_embd, per block v.blk.N.{ln1, attn_qkv, attn_out, ln2, ffn_up, ffn_down}, the merger's norm as
  v.post_ln and its linears as mm.0 / mm.2, and a DeepStack merger per flagged block N as v.deepstack.N.{norm, fc1,
  fc2} (numbered by the block, not by its place in the list).
The image token is the text vocabulary's <|image_pad|>. Every tensor is located and shape-checked before anything is
allocated; a missing or misshapen one, or a bad key, is a ModelFileError naming the file and the tensor or key.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ...errors import ModelFileError
from .gemma3 import Located, open_mmproj
from .qwen3_5 import Qwen35Vision, Qwen35VisionConfig, build_qwen3_5_vision

PROJECTOR = "qwen3vl_merger"
# the Hugging Face processor's pixel bounds for Qwen3-VL and Qwen3.5 (size shortest_edge / longest_edge)
DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS = 65536, 16777216
_DEEPSTACK = {"norm": "norm", "linear_fc1": "fc1", "linear_fc2": "fc2"}
_BLOCK = {"norm1": "ln1", "norm2": "ln2", "attn.qkv": "attn_qkv", "attn.proj": "attn_out",
          "mlp.linear_fc1": "ffn_up", "mlp.linear_fc2": "ffn_down"}
_TOP = {"pos_embed.weight": "v.position_embd.weight", "patch_embed.proj.bias": "v.patch_embd.bias",
        "merger.norm.weight": "v.post_ln.weight", "merger.norm.bias": "v.post_ln.bias",
        "merger.linear_fc1.weight": "mm.0.weight", "merger.linear_fc1.bias": "mm.0.bias",
        "merger.linear_fc2.weight": "mm.2.weight", "merger.linear_fc2.bias": "mm.2.bias"}


def gguf_tensor_name(ours: str, deepstack: tuple[int, ...]) -> str:
    """The mmproj GGUF's name of one of our parameters (the patch embedding's: its first frame's)."""
    if ours == "patch_embed.proj.weight":
        return "v.patch_embd.weight"
    if ours in _TOP:
        return _TOP[ours]
    part, index, rest = ours.split(".", 2)  # blocks.N.<module>.<leaf> or deepstack_merger_list.K.<module>.<leaf>
    module, _, leaf = rest.rpartition(".")
    if part == "blocks":
        return f"v.blk.{index}.{_BLOCK[module]}.{leaf}"
    return f"v.deepstack.{deepstack[int(index)]}.{_DEEPSTACK[module]}.{leaf}"


def load_qwen3_5_mmproj(path: Path, dtype: torch.dtype, device: torch.device | str,
                        image_token_id: int = 151655) -> Qwen35Vision:
    """The encoder of a llama.cpp mmproj GGUF with a qwen3vl_merger projector (Qwen3.5, Qwen3-VL); the image token's
    id is the text vocabulary's (<|image_pad|>)."""
    from ..gguf import SUPPORTED_TYPES, dequantize, gguf_can_dequantize

    gf, key, infos = open_mmproj(path, PROJECTOR, "Qwen3.5 / Qwen3-VL")
    meta, where = gf.metadata, gf.path
    if meta.get("clip.use_gelu") is not True:
        raise ModelFileError(where, "clip.use_gelu is not set: the tower's activation is GELU (tanh)")
    patch, layers = key("patch_size", int), key("block_count", int)
    flags = meta.get("clip.vision.is_deepstack_layers") or []
    if not isinstance(flags, list) or len(flags) not in (0, layers) or not all(isinstance(f, bool) for f in flags):
        raise ModelFileError(where, f"clip.vision.is_deepstack_layers {flags!r} is not one flag per block ({layers})")
    deepstack = tuple(i for i, flag in enumerate(flags) if flag)
    side = key("image_size", int) // max(patch, 1)
    try:
        config = Qwen35VisionConfig(
            hidden_size=key("embedding_length", int), intermediate_size=key("feed_forward_length", int),
            num_layers=layers, num_heads=key("attention.head_count", int), text_hidden_size=key("projection_dim", int),
            patch_size=patch, merge_size=key("spatial_merge_size", int, 2), num_position_embeddings=side * side,
            image_token_id=image_token_id, min_pixels=key("image_min_pixels", int, DEFAULT_MIN_PIXELS),
            max_pixels=key("image_max_pixels", int, DEFAULT_MAX_PIXELS),
            image_mean=key("image_mean", tuple, (0.5, 0.5, 0.5)), image_std=key("image_std", tuple, (0.5, 0.5, 0.5)),
            deepstack_indexes=deepstack)
    except ModelFileError as e:  # the config names no file: this one
        raise ModelFileError(where, e.problem) from None

    def info_of(name: str):
        info = infos.get(name)
        if info is None:
            raise ModelFileError(where, f"tensor {name!r} of the vision encoder is missing")
        if info.type_name not in SUPPORTED_TYPES and not gguf_can_dequantize(info.type_name):
            raise ModelFileError(where, f"tensor {name!r} has type {info.type_name}, which llmd cannot read")
        return info

    def read(name: str) -> torch.Tensor:
        info = info_of(name)
        return dequantize(gf.raw_bytes(info), info.type_name, info.shape)

    def locate(ours: str, shape: tuple[int, ...]) -> Located:
        name = gguf_tensor_name(ours, deepstack)
        info = info_of(name)
        if ours != "patch_embed.proj.weight":
            return where, name, tuple(info.shape), lambda: read(name)
        # the Conv3d kernel [hidden, 3, 2 frames, p, p], stored one frame per tensor (llama.cpp takes 2 frames only)
        frame = tuple(info.shape)
        second = info_of(name + ".1")
        if tuple(second.shape) != frame:
            raise ModelFileError(where, f"tensor {name + '.1'!r} has shape {tuple(second.shape)}, expected {frame} "
                                        "(the patch embedding's second frame)")
        return where, name, (*frame[:2], 2, *frame[2:]), lambda: torch.stack((read(name), read(name + ".1")), 2)

    return build_qwen3_5_vision(config, locate, dtype, device)
