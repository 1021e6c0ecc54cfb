"""Gemma 4's image encoder (llmd.model.vision.gemma4) from llama.cpp's mmproj GGUF: projector type gemma4v, as
llama.cpp's converter writes it (clip.vision.* keys; v.* / mm.* tensors; the patch embedding as a conv kernel
[hidden, 3, patch, patch]; the clip bounds of use_clipped_linears as [1] tensors; std_bias / std_scale where the tower
standardises). The file holds neither the processor's budget (the processor's default, 280 tokens, as llama.cpp's
limit) nor whether the text model reads an image's tokens both ways: llama.cpp decodes Gemma 4's images so, and so
does llmd. KV heads follow from attn_k's shape; the RoPE theta is llama.cpp's fixed 100.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ...errors import ModelFileError
from .gemma3 import Located, open_mmproj
from .gemma4 import CLIP_BOUNDS, Gemma4Vision, build

# our names -> llama.cpp's mmproj names (a layer's: v.blk.N.<name>.<leaf>)
_GGUF_TOP = {"patch_embedder.input_proj.weight": "v.patch_embd.weight", "std_bias": "v.std_bias",
             "patch_embedder.position_embedding_table": "v.position_embd.weight", "std_scale": "v.std_scale",
             "embedding_projection.weight": "mm.input_projection.weight"}
_GGUF_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_out", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
               "input_layernorm": "ln1", "post_attention_layernorm": "attn_post_norm",
               "pre_feedforward_layernorm": "ln2", "post_feedforward_layernorm": "ffn_post_norm",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_tensor_name(ours: str) -> str:
    """The mmproj GGUF's name of one of our tensors."""
    if ours in _GGUF_TOP:
        return _GGUF_TOP[ours]
    _, _, index, rest = ours.split(".", 3)  # encoder.layers.N.<module>.<leaf>
    module, _, leaf = rest.replace(".linear.", ".").rpartition(".")
    return f"v.blk.{index}.{_GGUF_LAYER[module]}.{leaf}"


def load_gemma4_mmproj(path: Path, dtype: torch.dtype, device: torch.device | str,
                       image_token_id: int = 258880) -> Gemma4Vision:
    """The encoder of a llama.cpp mmproj GGUF with a Gemma 4 projector (gemma4v); the image token's id is the text
    vocabulary's (<|image|>)."""
    from ..gguf import SUPPORTED_TYPES, dequantize, gguf_can_dequantize

    gf, key, infos = open_mmproj(path, "gemma4v", "Gemma 4")
    where = gf.path

    hidden, heads = key("embedding_length", int), key("attention.head_count", int)
    table, k_proj = infos.get("v.position_embd.weight"), infos.get("v.blk.0.attn_k.weight")
    head_dim = hidden // max(heads, 1)
    fields = dict(
        patch_size=key("patch_size", int), hidden_size=hidden, intermediate_size=key("feed_forward_length", int),
        num_layers=key("block_count", int), num_heads=heads,
        num_kv_heads=k_proj.shape[0] // max(head_dim, 1) if k_proj is not None else heads, head_dim=head_dim,
        text_hidden_size=key("projection_dim", int), pooling=key("projector.scale_factor", int, 3),
        position_embedding_size=table.shape[1] if table is not None and len(table.shape) == 3 else 10240,
        rms_norm_eps=key("attention.layer_norm_epsilon", float, 1e-6), standardize="v.std_bias" in infos,
        clipped="v.blk.0.attn_q.input_min" in infos, image_token_id=image_token_id, bidirectional=True,
        normalize=True, image_mean=key("image_mean", tuple, (0, 0, 0)), image_std=key("image_std", tuple, (1, 1, 1)))

    def locate(ours: str) -> Located:
        name = gguf_tensor_name(ours)
        info = infos.get(name)
        if info is None:
            raise ModelFileError(where, f"tensor {name!r} of the vision encoder is missing")
        if info.type_name not in SUPPORTED_TYPES and not gguf_can_dequantize(info.type_name):
            raise ModelFileError(where, f"tensor {name!r} has type {info.type_name}, which llmd cannot read")
        shape = tuple(info.shape)

        def read() -> torch.Tensor:
            return dequantize(gf.raw_bytes(info), info.type_name, info.shape)

        if name == "v.patch_embd.weight" and len(shape) == 4 and shape[1] == 3:  # the conv kernel [h, 3, p, p]
            return where, name, (shape[0], 3 * shape[2] * shape[3]), lambda: read().permute(0, 2, 3, 1).flatten(1)
        if name.endswith(CLIP_BOUNDS) and shape == (1,):  # the converter stores the scalar bounds as [1]
            shape = ()
        return where, name, shape, read

    return build(fields, where, locate, dtype, device)
