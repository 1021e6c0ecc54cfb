"""Mistral 3's image encoder (llmd.model.vision.mistral3) from llama.cpp's mmproj GGUF: projector type pixtral with a
patch merger (clip.vision.spatial_merge_size), as llama.cpp's converter writes Mistral3ForConditionalGeneration
(clip.vision.* keys, clip.use_silu / clip.use_gelu; v.* / mm.* tensors; q and k rows interleaved per head as for
llama.cpp's RoPE, undone here). The file holds no RoPE theta (llama.cpp fixes Pixtral's at 10000) and one norm eps,
which serves the projector's RMSNorm too, as in llama.cpp; v.token_embd.img_break (the text model's [IMG_BREAK]
embedding, copied) is left unread: the text model embeds that token itself. Images are preprocessed as the Hugging
Face processor does, the longest edge being clip.vision.image_size. Pixtral 12B's projector (no merger) is refused.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ...errors import ModelFileError
from .gemma3 import Located, open_mmproj
from .mistral3 import PROJECTOR, Mistral3Vision, build

# our names -> llama.cpp's mmproj names (a layer's: v.blk.N.<name>.<leaf>)
_GGUF_TOP = {"patch_conv.weight": "v.patch_embd.weight", "ln_pre.weight": "v.pre_ln.weight",
             PROJECTOR + "norm.weight": "mm.input_norm.weight",
             PROJECTOR + "patch_merger.merging_layer.weight": "mm.patch_merger.weight",
             PROJECTOR + "linear_1.weight": "mm.1.weight", PROJECTOR + "linear_1.bias": "mm.1.bias",
             PROJECTOR + "linear_2.weight": "mm.2.weight", PROJECTOR + "linear_2.bias": "mm.2.bias"}
_GGUF_LAYER = {"attention.q_proj": "attn_q", "attention.k_proj": "attn_k", "attention.v_proj": "attn_v",
               "attention.o_proj": "attn_out", "attention_norm": "ln1", "ffn_norm": "ln2",
               "feed_forward.gate_proj": "ffn_gate", "feed_forward.up_proj": "ffn_up",
               "feed_forward.down_proj": "ffn_down"}


def gguf_tensor_name(ours: str) -> str:
    """The mmproj GGUF's name of one of our tensors."""
    if ours in _GGUF_TOP:
        return _GGUF_TOP[ours]
    _, _, index, rest = ours.split(".", 3)  # transformer.layers.N.<module>.<leaf>
    module, _, leaf = rest.rpartition(".")
    return f"v.blk.{index}.{_GGUF_LAYER[module]}.{leaf}"


def load_mistral3_mmproj(path: Path, dtype: torch.dtype, device: torch.device | str,
                         image_token_id: int = 10) -> Mistral3Vision:
    """The encoder of a llama.cpp mmproj GGUF with a Mistral 3 (pixtral + patch merger) projector; the image token's
    id is the text vocabulary's ([IMG])."""
    from ..gguf import SUPPORTED_TYPES, dequantize, gguf_can_dequantize, unpermute_rows

    gf, key, infos = open_mmproj(path, "pixtral", "Mistral 3")
    meta, where = gf.metadata, gf.path

    merge = key("spatial_merge_size", int, 1)
    if merge < 2 or "mm.patch_merger.weight" not in infos:
        raise ModelFileError(where, "a Pixtral projector without a patch merger (Pixtral 12B) is not served; "
                                    "Mistral 3's has clip.vision.spatial_merge_size and mm.patch_merger.weight")
    heads = key("attention.head_count", int)
    fields = dict(
        patch_size=key("patch_size", int), spatial_merge_size=merge, hidden_size=key("embedding_length", int),
        intermediate_size=key("feed_forward_length", int), num_layers=key("block_count", int), num_heads=heads,
        text_hidden_size=key("projection_dim", int), longest_edge=key("image_size", int),
        hidden_act="gelu" if meta.get("clip.use_gelu") is True else "silu",
        projector_bias="mm.1.bias" in infos, projector_eps=key("attention.layer_norm_epsilon", float, 1e-5),
        image_token_id=image_token_id,
        image_mean=key("image_mean", tuple, (0.48145466, 0.4578275, 0.40821073)),
        image_std=key("image_std", tuple, (0.26862954, 0.26130258, 0.27577711)))
    if meta.get("clip.use_gelu") is not True and meta.get("clip.use_silu") is not True:
        raise ModelFileError(where, "neither clip.use_silu nor clip.use_gelu: the tower's activation is unknown")

    def locate(ours: str) -> Located:
        name = gguf_tensor_name(ours)
        info = infos.get(name)
        if info is None:
            raise ModelFileError(where, f"tensor {name!r} of the vision encoder is missing")
        if info.type_name not in SUPPORTED_TYPES and not gguf_can_dequantize(info.type_name):
            raise ModelFileError(where, f"tensor {name!r} has type {info.type_name}, which llmd cannot read")

        def read() -> torch.Tensor:
            t = dequantize(gf.raw_bytes(info), info.type_name, info.shape)
            return unpermute_rows(t, heads) if name.endswith(("attn_q.weight", "attn_k.weight")) else t

        return where, name, info.shape, read

    return build(fields, where, locate, dtype, device)
