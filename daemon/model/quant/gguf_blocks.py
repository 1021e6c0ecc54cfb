"""GGUF blocks into llmd's layers without dequantizing: Q4_0 and Q4_1 on a GPU rearranged into int4 g32, Q8_0
linear layers into int8 g32, every other packed type (and every token table, tied or not) kept as the file's bytes
(gguf_layers)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from llmd.kernels import quant_matmul as qmm

from ...errors import ModelFileError
from .layers import Int8Linear

def _f16_column(blocks: torch.Tensor, start: int) -> torch.Tensor:
    return blocks[..., start:start + 2].contiguous().view(torch.float16).squeeze(-1).to(torch.float32)


def int8_from_q8_0(data: np.ndarray, out_features: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 rows ([N, K/32 * 34] bytes) -> (int8 [N, K], scales [N, K/32])."""
    blocks = torch.from_numpy(np.array(data, dtype=np.uint8, copy=True)).view(out_features, in_features // 32, 34)
    scales = _f16_column(blocks, 0)
    q = blocks[..., 2:].contiguous().view(torch.int8).reshape(out_features, in_features)
    return q, scales


def int4_from_q4(data: np.ndarray, type_name: str, out_features: int, in_features: int):
    """Q4_0 / Q4_1 rows -> (uint8 [N, K/2], scales, zeros [N, K/32]).

    A GGML block stores element j in the low nibble and j + 16 in the high nibble of byte j; our layout pairs
    neighbours (2i low, 2i + 1 high), so the nibbles are regrouped, exactly. Q4_0: x = d (q - 8) -> scale d, zero 0.
    Q4_1: x = d q + m -> scale d, zero m + 8 d.
    """
    size = 18 if type_name == "Q4_0" else 20
    blocks = torch.from_numpy(np.array(data, dtype=np.uint8, copy=True)).view(out_features, in_features // 32, size)
    d = _f16_column(blocks, 0)
    if type_name == "Q4_0":
        zeros = torch.zeros_like(d)
        qs = blocks[..., 2:]
    else:
        zeros = _f16_column(blocks, 2) + 8.0 * d
        qs = blocks[..., 4:]
    values = torch.cat((qs & 0xF, qs >> 4), dim=-1)  # [N, K/32, 32] in element order
    packed = qmm.pack_int4(values.reshape(out_features, in_features))
    return packed, d, zeros


def _fill_packed(layer: nn.Module, raw, source, rows: slice | None = None) -> bool:
    """Fill a swapped layer (or its `rows`: a part of a fused projection) from a GGUF tensor's blocks without
    dequantizing; False when the types do not pair (the tensor is then dequantized and the layer quantized from it)."""
    from .gguf_experts import GGUFExpertLinear
    from .gguf_layers import GGUFConcat, GGUFEmbedding, GGUFLinear

    if isinstance(layer, GGUFExpertLinear):
        layer.fill(raw, source, rows)
        return True
    if isinstance(layer, GGUFConcat):  # each part is its own GGUFLinear
        if rows is None:
            return False
        starts = [0]
        for part in layer.parts:
            starts.append(starts[-1] + part.out_features)
        layer.unprepare()
        layer, rows = layer.parts[starts.index(rows.start)], None
    if isinstance(layer, (GGUFLinear, GGUFEmbedding)):
        if raw.type_name != layer.type_name:
            return False
        layer.fill(torch.from_numpy(np.array(raw.data, dtype=np.uint8, copy=True)), raw.name, source, rows)
        return True
    if raw.type_name not in ("Q4_0", "Q4_1", "Q8_0") or (raw.type_name == "Q8_0") != isinstance(layer, Int8Linear):
        return False
    n = layer.out_features if rows is None else rows.stop - rows.start
    if tuple(raw.shape) != (n, layer.in_features):
        raise ModelFileError(source, f"tensor {raw.name!r} has shape {tuple(raw.shape)}, expected "
                                     f"{(n, layer.in_features)}")
    _fill_from_raw(layer, raw, rows or slice(None))
    return True


def _fill_from_raw(layer: nn.Module, raw, rows: slice) -> None:
    n, k = raw.shape
    if raw.type_name == "Q8_0":
        q, s = int8_from_q8_0(raw.data, n, k)
        layer.qweight[rows].copy_(q)
        layer.scales[rows].copy_(s)
    else:
        q, s, z = int4_from_q4(raw.data, raw.type_name, n, k)
        layer.qweight[rows].copy_(q)
        layer.scales[rows].copy_(s)
        layer.zeros[rows].copy_(z)
    layer.unprepare()


def gguf_tensor_types(path) -> dict[str, str]:
    """Hugging Face weight name -> GGML type of every tensor in a GGUF file (reads no weights)."""
    from ..gguf import raw_tensor_types

    return raw_tensor_types(path)


def gguf_raw_tensors(path):
    from ..gguf import iter_raw_tensors

    return iter_raw_tensors(path)
