"""MXFP4 weights of a Hugging Face checkpoint (gpt-oss's experts) as GGUF MXFP4 block rows, exactly.

gpt-oss stores each expert projection as two tensors: `{name}_blocks`, uint8 [E, out, in/32, 16] (32 E2M1 codes per
block, element 2i in the low nibble of byte i and 2i + 1 in the high one) and `{name}_scales`, uint8 [E, out, in/32]
(E8M0 exponents with bias 127): w = E2M1[code] * 2^(s - 127). A GGUF MXFP4 block (llmd.kernels.gguf_blocks) holds the
same codes and exponent byte, only its nibbles paired another way (element j low, j + 16 high in byte j) and its value
table doubled with the scale halved: 2 E2M1[code] * 2^(s - 128), the same number. So the rearrangement moves nibbles and
keeps every value, and both sources share one layer type and every kernel. E8M0's 255 (NaN) and misshapen tensors
are a ModelFileError naming the tensor; ggml reads a 255 as 2^127 instead, so it is refused rather than made finite.
"""

from __future__ import annotations

import torch

from llmd.kernels import gguf_blocks as gb

from ...errors import ModelFileError

_, BLOCK_BYTES = gb.block_shape("MXFP4")  # 1 exponent byte + 16 code bytes per 32 elements
E8M0_NAN = 255


def mxfp4_blocks_from_hf(blocks: torch.Tensor, scales: torch.Tensor, name: str, source,
                         shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """`{name}_blocks` uint8 [..., out, in/32, 16] and `{name}_scales` uint8 [..., out, in/32] -> GGUF MXFP4 block
    rows uint8 [..., out, in/32 * 17] (gguf_blocks.dequantize_blocks reads transformers' dequantized values from
    them). name: the weight's name without the suffix; source: the checkpoint (for the error's message); shape: the
    weight's shape [..., out, in] when the caller expects one. ModelFileError for another dtype or shape, or a scale
    of 255."""
    for suffix, t, dims in (("_blocks", blocks, "[..., out, in/32, 16]"), ("_scales", scales, "[..., out, in/32]")):
        if t.dtype is not torch.uint8:
            raise ModelFileError(source, f"tensor {name + suffix!r} has dtype {t.dtype}, expected uint8 (MXFP4 "
                                         f"{dims})")
    if blocks.dim() < 3 or blocks.shape[-1] != 16:
        raise ModelFileError(source, f"tensor {name + '_blocks'!r} has shape {list(blocks.shape)}, expected "
                                     "[..., out, in/32, 16] (16 bytes of E2M1 codes per block of 32)")
    if tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ModelFileError(source, f"tensor {name + '_scales'!r} has shape {list(scales.shape)}, expected "
                                     f"{list(blocks.shape[:-1])}: one E8M0 byte per block of {name + '_blocks'!r}")
    held = (*blocks.shape[:-2], blocks.shape[-2] * 32)
    if shape is not None and tuple(shape) != held:
        raise ModelFileError(source, f"tensor {name + '_blocks'!r} holds a weight of shape {list(held)}, expected "
                                     f"{list(shape)}")
    bad = scales == E8M0_NAN
    if bool(bad.any()):
        at = [int(i) for i in bad.nonzero()[0]]
        raise ModelFileError(source, f"tensor {name + '_scales'!r} has the E8M0 NaN (255) at {at} and "
                                     f"{int(bad.sum()) - 1} more: a block without a valid scale")
    out = torch.empty(*held[:-1], held[-1] // 32, BLOCK_BYTES, dtype=torch.uint8, device=blocks.device)
    out[..., 0] = scales
    lo, hi = blocks[..., :8], blocks[..., 8:]  # elements 0..15 and 16..31, two per byte
    codes = out[..., 1:]
    codes[..., 0::2] = (lo & 0x0F) | ((hi & 0x0F) << 4)  # GGUF byte 2i: element 2i low, 2i + 16 high
    codes[..., 1::2] = (lo >> 4) | (hi & 0xF0)  # byte 2i + 1: elements 2i + 1 and 2i + 17
    return out.view(*held[:-1], -1)
