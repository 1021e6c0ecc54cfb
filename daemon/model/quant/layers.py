"""The weight-only quantized linear layers (int8 per channel or per group, int4 group-wise) and building them.

Where the matmul runs is decided once per layer, by `prepare(device, dtype)` at the end of loading, which sets the
layer's `kernel` (a `LinearKernel`, x [M, K] -> [M, N]); `forward` is then `self.kernel(x)` plus the bias. In order:
CUDA with Triton -> the fused kernels in llmd.kernels; CPU with fp32 activations -> the compiled kernel
llmd.kernels.cpu_gemm where it builds here and takes the shape; CPU with AVX-512 -> torch's own int8/int4 weight
kernels (torch._weight_int8pack_mm, torch._weight_int4pack_mm_for_cpu; elsewhere they are far slower than
dequantizing); otherwise dequantize + matmul. A layer used before it was prepared (or with activations of another
dtype) prepares itself on the first call. Replacing a weight buffer (fill_*) or moving the layer drops the kernel.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from llmd.kernels import cpu_gemm
from llmd.kernels import quant_matmul as qmm

from .bnb import _bnb_fill, _bnb_layer
from .modes import DEFAULT_INT4_GROUP, QuantSpec, parse_quant
from .quantize import quantize_int4, quantize_int8

LinearKernel = Callable[[torch.Tensor], torch.Tensor]  # x [M, K] -> x @ W.T [M, N], without the bias

_cpu_kernel_fast: dict[str, bool] = {}


def cpu_kernel_is_fast(kind: str) -> bool:
    """Whether torch's CPU kernel for `kind` ("int8" / "int4") is worth using over dequantize + matmul: torch
    vectorizes its int4/int8 weight kernels only for AVX-512, and elsewhere they are many times slower. A rule on
    the CPU's flags (the same answer on every run), not a timing."""
    if kind not in _cpu_kernel_fast:
        _cpu_kernel_fast[kind] = "avx512f" in cpu_gemm._cpu_flags()
    return _cpu_kernel_fast[kind]


def use_triton(device: torch.device) -> bool:
    import llmd.kernels as kernels

    return device.type == "cuda" and kernels.available()


def c_kernel(dtype: torch.dtype, build: Callable[[], LinearKernel | None]) -> LinearKernel | None:
    """The compiled CPU kernel `build` makes, for fp32 activations where the library loads (LLMD_CPU_GEMM=0: none)."""
    if dtype != torch.float32 or not cpu_gemm.enabled() or cpu_gemm.load() is None:
        return None
    return build()


class QuantizedLinear(nn.Module):
    """Base of the weight-only quantized layers: [..., in_features] -> [..., out_features]."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group_size: int,
                 dtype: torch.dtype | None = None, device=None):
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False) \
            if bias else None
        self.kernel: LinearKernel | None = None  # set by prepare
        self.kernel_dtype: torch.dtype | None = None  # the activations it was prepared for

    def _apply(self, fn, recurse=True):
        self.kernel = None  # a move or cast invalidates the prepared kernel (it holds the buffers' addresses)
        return super()._apply(fn, recurse)

    def prepare(self, device: torch.device, dtype: torch.dtype) -> LinearKernel:
        """Choose and set `self.kernel` for activations of `dtype` on `device` (see the module docstring)."""
        self.kernel, self.kernel_dtype = self._choose_kernel(torch.device(device), dtype), dtype
        return self.kernel

    def _choose_kernel(self, device: torch.device, dtype: torch.dtype) -> LinearKernel:
        raise NotImplementedError

    def unprepare(self) -> None:
        """Drop the kernel after the weights changed (the next call prepares a new one)."""
        self.kernel = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self.kernel
        if kernel is None or x.dtype is not self.kernel_dtype:
            kernel = self.prepare(x.device, x.dtype)
        if x.dim() == 2:
            y = kernel(x)  # the decode path: 4 calls per layer and step, so no more Python than needed
        else:
            y = kernel(x.reshape(-1, self.in_features)).reshape(*x.shape[:-1], self.out_features)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def dequantized_weight(self) -> torch.Tensor:
        raise NotImplementedError

    def _fallback(self, x: torch.Tensor) -> torch.Tensor:
        """Dequantize + matmul: the kernel of last resort."""
        return F.linear(x, self.dequantized_weight().to(x.dtype))

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, group={self.group_size}"


class Int8Linear(QuantizedLinear):
    """int8 weights [N, K] with scales [N, K / group_size] (group_size == K: per channel)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, group_size: int | None = None,
                 dtype: torch.dtype | None = None, device=None):
        group_size = group_size or in_features
        super().__init__(in_features, out_features, bias, group_size, dtype, device)
        self.register_buffer("qweight", torch.empty(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("scales", torch.empty(out_features, in_features // group_size,
                                                   dtype=torch.float32, device=device))

    def dequantized_weight(self) -> torch.Tensor:
        return qmm.dequantize_int8(self.qweight, self.scales, self.group_size)

    def _choose_kernel(self, device: torch.device, dtype: torch.dtype) -> LinearKernel:
        qweight, group = self.qweight, self.group_size
        if use_triton(device):
            scales = self.scales.to(dtype)
            return lambda x: qmm.int8_matmul(x, qweight, scales, group)
        if device.type != "cpu":
            return self._fallback
        c = c_kernel(dtype, lambda: cpu_gemm.layer_kernel("int8", qweight, self.scales, None, group))
        if c is not None:
            return c
        if group == self.in_features and cpu_kernel_is_fast("int8"):
            return self._native_cpu(dtype)
        return self._fallback

    def _native_cpu(self, dtype: torch.dtype) -> LinearKernel:
        """torch's CPU int8 weight kernel (per-channel scales only)."""
        qweight, scales = self.qweight, self.scales.view(-1).to(dtype).contiguous()
        return lambda x: torch._weight_int8pack_mm(x.contiguous(), qweight, scales)


class Int4Linear(QuantizedLinear):
    """int4 weights packed [N, K/2] with scales and zeros [N, K / group_size]."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, group_size: int = DEFAULT_INT4_GROUP,
                 dtype: torch.dtype | None = None, device=None):
        if in_features % group_size:
            raise ValueError(f"in_features {in_features} is not a multiple of the int4 group size {group_size}")
        super().__init__(in_features, out_features, bias, group_size, dtype, device)
        groups = in_features // group_size
        self.register_buffer("qweight", torch.empty(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.register_buffer("scales", torch.empty(out_features, groups, dtype=torch.float32, device=device))
        self.register_buffer("zeros", torch.empty(out_features, groups, dtype=torch.float32, device=device))

    def dequantized_weight(self) -> torch.Tensor:
        return qmm.dequantize_int4(self.qweight, self.scales, self.zeros, self.group_size)

    def _choose_kernel(self, device: torch.device, dtype: torch.dtype) -> LinearKernel:
        qweight, group = self.qweight, self.group_size
        if use_triton(device):
            scales, zeros = self.scales.to(dtype), self.zeros.to(dtype)
            return lambda x: qmm.int4_matmul(x, qweight, scales, zeros, group)
        if device.type != "cpu":
            return self._fallback
        c = c_kernel(dtype, lambda: cpu_gemm.layer_kernel("int4", qweight, self.scales, self.zeros, group))
        if c is not None:
            return c
        if dtype in (torch.float32, torch.bfloat16, torch.float16) and cpu_kernel_is_fast("int4"):
            native = self._native_cpu(dtype)
            if native is not None:
                return native
        return self._fallback

    def _native_cpu(self, dtype: torch.dtype) -> LinearKernel | None:
        """torch's CPU int4 kernel, which wants its own weight packing and [K/g, N, 2] (scale, zero) pairs; None
        where torch cannot pack this layer (its kernel wants N % 16 == 0) or lacks the op."""
        try:
            values = qmm.unpack_int4(self.qweight).to(torch.int32)
            weight = torch._convert_weight_to_int4pack_for_cpu(values, 1)
            scale_zeros = torch.stack((self.scales, self.zeros), dim=-1).transpose(0, 1).contiguous().to(dtype)
        except (RuntimeError, AttributeError):
            return None
        group = self.group_size
        return lambda x: torch._weight_int4pack_mm_for_cpu(x.contiguous(), weight, group, scale_zeros)


def quantize_linear(linear: nn.Module, mode: str | QuantSpec) -> nn.Module:
    """A quantized copy of an nn.Linear (weight [out, in], optional bias). mode: int8 | int4[-gN] | bnb-*."""
    spec = mode if isinstance(mode, QuantSpec) else parse_quant(mode)
    weight = linear.weight.detach()
    bias = getattr(linear, "bias", None)
    layer = empty_quantized(spec, linear.in_features, linear.out_features, bias is not None,
                            dtype=weight.dtype, device=weight.device)
    if layer is None:
        return linear
    fill_from_weight(layer, weight, spec)
    if bias is not None:
        layer.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
    return layer


def empty_quantized(spec: QuantSpec, in_features: int, out_features: int, bias: bool,
                    dtype: torch.dtype | None = None, device=None) -> nn.Module | None:
    """An unfilled quantized layer for `spec` (None for "none")."""
    if spec.method == "int8":
        return Int8Linear(in_features, out_features, bias, dtype=dtype, device=device)
    if spec.method == "int4":
        return Int4Linear(in_features, out_features, bias, spec.group_size, dtype=dtype, device=device)
    if spec.method in ("bnb-int8", "bnb-nf4"):
        return _bnb_layer(spec.method, in_features, out_features, bias, dtype)
    return None


def fills_rows(layer: nn.Module) -> bool:
    """Whether a part of a fused projection can be quantized into its rows of `layer` alone: llmd's layers quantize
    each output row on its own (per-row scales), bitsandbytes needs the assembled weight."""
    return isinstance(layer, QuantizedLinear)


def fill_from_weight(layer: nn.Module, weight: torch.Tensor, spec: QuantSpec, rows: slice | None = None) -> None:
    """Quantize an fp weight [N, K] into a layer made by `empty_quantized`, or into its `rows` (a part of a fused
    projection: int8 and int4 layers only, see fills_rows)."""
    if isinstance(layer, Int8Linear):
        q, s = quantize_int8(weight)
        if rows is None:
            layer.group_size = layer.in_features
            layer.qweight = q.to(layer.qweight.device)
            layer.scales = s.to(layer.scales.device)
        else:  # a layer made by empty_quantized is per channel already
            layer.qweight[rows].copy_(q)
            layer.scales[rows].copy_(s.view(q.shape[0], -1))
    elif isinstance(layer, Int4Linear):
        fill_int4(layer, *quantize_int4(weight, layer.group_size), rows=rows)
    else:
        _bnb_fill(layer, weight, spec.method)
    if isinstance(layer, QuantizedLinear):
        layer.unprepare()


def fill_int4(layer: Int4Linear, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
              rows: slice | None = None) -> None:
    """Store an already quantized weight (quantize_int4's or GPTQ's layout) in an int4 layer, or in its `rows`."""
    rows = rows or slice(None)
    layer.qweight[rows].copy_(packed)
    layer.scales[rows].copy_(scales)
    layer.zeros[rows].copy_(zeros)
    layer.unprepare()


def quantized_weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer (quantized layers keep their weights in buffers)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() in seen or t.is_meta:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total
