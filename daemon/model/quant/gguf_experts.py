"""Every expert's projection kept as the GGUF file's blocks (llama.cpp's stacked `ffn_*_exps` tensors).

A GGUFExpertLinear is the packed form of llmd.model.moe.ExpertLinear: the same `expert(e, x)`, with each part (gate
and up side by side, which Q4_K_M files may store in different types; or down alone) held as uint8
[E, out, row bytes] of its GGML type, so resident bytes are the file's. Expert e's matmul is a GGUFLinear (or a
GGUFConcat of its parts) viewing the e-th slice of the blocks: the kernel each device has for a packed layer (the
compiled CPU kernel, Triton on CUDA, the torch dequantizer otherwise) serves the experts too, and a row's result never
depends on the other rows (llmd.kernels.cpu_gemm.GGUFKernel). On the CPU with fp32 activations a layer's experts
instead run as one C call per step (`cpu_experts_kernel`, llmd.kernels.cpu_moe: llama.cpp's mul_mat_id), chosen by
llmd.model.moe.Experts.prepare, with the per-expert layers' very bits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from llmd.kernels import cpu_moe
from llmd.kernels import gguf_blocks as gb

from ...errors import ModelFileError
from .gguf_layers import GGUFConcat, GGUFLinear

if TYPE_CHECKING:
    from ..config import MoEConfig


class ExpertBlocks(nn.Module):
    """One part of every expert's projection: `qweight` uint8 [E, out, row bytes] of `type_name`."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, type_name: str, device=None):
        super().__init__()
        self.in_features, self.out_features, self.type_name = in_features, out_features, type_name
        self.register_buffer("qweight", torch.empty(num_experts, out_features, gb.row_bytes(type_name, in_features),
                                                    dtype=torch.uint8, device=device))


class GGUFExpertLinear(nn.Module):
    """[m, in] -> [m, out] through expert e, the weight kept as GGUF blocks (parts side by side along out)."""

    def __init__(self, num_experts: int, in_features: int, parts: list[tuple[int, str]], bias: bool = False,
                 dtype: torch.dtype | None = None, device=None):
        super().__init__()
        self.num_experts, self.in_features = num_experts, in_features
        self.out_features = sum(n for n, _ in parts)
        self.parts = nn.ModuleList(ExpertBlocks(num_experts, in_features, n, t, device) for n, t in parts)
        self.bias = nn.Parameter(torch.empty(num_experts, self.out_features, dtype=dtype, device=device),
                                 requires_grad=False) if bias else None
        self._experts: list[nn.Module] | None = None  # expert e's packed layer (views of the blocks), made on use

    def _apply(self, fn, recurse=True):
        self._experts = None  # a move invalidates the views and their kernels
        return super()._apply(fn, recurse)

    def prepare(self, device: torch.device, dtype: torch.dtype) -> None:
        """One packed layer per expert, each with the device's kernel chosen (views: no bytes are copied)."""
        experts = []
        for e in range(self.num_experts):
            layers = []
            for part in self.parts:
                layer = GGUFLinear(self.in_features, part.out_features, part.type_name, device="meta")
                layer.qweight = part.qweight[e]
                layer.shared_blocks = True  # the fused expert kernel reads them in the file's layout
                layers.append(layer)
            layer = layers[0] if len(layers) == 1 else GGUFConcat(layers)
            layer.prepare(device, dtype)
            experts.append(layer)
        self._experts = experts

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        if self._experts is None:
            self.prepare(x.device, x.dtype)
        assert self._experts is not None
        y = self._experts[e](x)
        return y if self.bias is None else y + self.bias[e].to(y.dtype)

    def kernel_weights(self):
        """Every expert's blocks as the fused kernel takes them (llmd.kernels.moe_matmul.ExpertWeights)."""
        from llmd.kernels.moe_matmul import ExpertWeights

        return ExpertWeights(tuple((p.qweight, p.type_name) for p in self.parts), self.in_features,
                             None if self.bias is None else self.bias.detach())

    def fill(self, raw, source, rows: object) -> None:
        """Copy a stacked GGUF tensor's blocks into the part its rows name (None: the only part)."""
        start = rows[1].start if isinstance(rows, tuple) else None
        offsets = np.cumsum([0] + [p.out_features for p in self.parts]).tolist()
        part = self.parts[0] if start is None else self.parts[offsets.index(start)]
        if raw.type_name != part.type_name:
            raise ModelFileError(source, f"tensor {raw.name!r} is {raw.type_name}, expected {part.type_name}")
        expected = (self.num_experts, part.out_features, part.in_features)
        if tuple(raw.shape) != expected:
            raise ModelFileError(source, f"tensor {raw.name!r} has shape {tuple(raw.shape)}, expected {expected} "
                                         "(experts, outputs, inputs)")
        blocks = torch.from_numpy(np.array(raw.data, dtype=np.uint8, copy=True))
        part.qweight.copy_(blocks.view(part.qweight.shape))
        self._experts = None

    def dequantized_weight(self) -> torch.Tensor:
        """fp32 [E, out, in]: the file's exact values (tests compare against it)."""
        return torch.cat([gb.dequantize_blocks(p.qweight.reshape(-1, p.qweight.shape[-1]), p.type_name)
                          .view(self.num_experts, p.out_features, self.in_features) for p in self.parts], dim=1)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, in={self.in_features}, types={[p.type_name for p in self.parts]}"


def cpu_experts_kernel(gate_up: nn.Module, down: nn.Module, device: torch.device, dtype: torch.dtype,
                       moe: MoEConfig) -> cpu_moe.MoEKernel | None:
    """The compiled kernel running a layer's experts in one C call (llmd.kernels.cpu_moe), on the activation path
    their own GGUFKernels take, with their biases and the layer's activation, where both projections are
    GGUFExpertLinear on the CPU, for fp32 activations where the library loads; else None (the experts run one packed
    layer each)."""
    if device.type != "cpu" or not isinstance(gate_up, GGUFExpertLinear) or not isinstance(down, GGUFExpertLinear):
        return None
    if dtype != torch.float32:
        return None
    return cpu_moe.moe_kernel([(p.qweight, p.type_name) for p in gate_up.parts],
                              [(p.qweight, p.type_name) for p in down.parts], biases=(gate_up.bias, down.bias),
                              activation=moe.activation, alpha=moe.swiglu_alpha,
                              limit=moe.swiglu_limit)  # None where the library is off
