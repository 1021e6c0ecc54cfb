"""Weight-only quantized linear layers and the `--quant` modes.

Modes: none | int8 | int4 (group 64; int4-g32 / int4-g64 / int4-g128 pick the group) | bnb-int8 | bnb-nf4.
- int8: per-output-channel symmetric scales, w = q * scale.
- int4: group-wise asymmetric, two values packed per byte, w = (q - 8) * scale + zero (layout: llmd.kernels.quant_matmul).
- GGUF Q4_0 / Q4_1 blocks convert to int4 g32 by rearranging bytes (no dequantize/re-quantize), as does a tied Q8_0
  token table into the int8 g32 head; every other GGUF tensor stays packed as the file has it
  (llmd.model.gguf_layers, llmd.kernels.gguf_blocks).

Quantization happens while the weights stream in (`quantizing_stream`): each linear's fp weight is quantized as soon
as it is read, so the unquantized model never sits whole in memory.

Where the matmul runs: CUDA + Triton -> the fused kernels in llmd.kernels; CPU with fp32 activations -> the compiled
kernel llmd.kernels.cpu_gemm when it builds here; else on CPU torch's own int8/int4 weight kernels
(torch._weight_int8pack_mm, torch._weight_int4pack_mm_for_cpu) where they beat fp32; otherwise dequantize + matmul.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from llmd.kernels import cpu_gemm
from llmd.kernels import quant_matmul as qmm

from ..config import QUANT_MODES  # the torch-free list the settings validate against
from ..errors import ModelFileError

DEFAULT_INT4_GROUP = 64


@dataclass(frozen=True)
class QuantSpec:
    method: str  # "none" | "int8" | "int4" | "bnb-int8" | "bnb-nf4" | "gguf" (keep what the GGUF file holds)
    group_size: int = 0
    # int4 from --quant: quantized with AWQ + GPTQ on calibration text while the model loads (llmd.model.calibrate),
    # not weight by weight; quantize_linear / quantize_model have no activations and always quantize weight by weight
    calibrate: bool = False

    @property
    def label(self) -> str:
        return f"int4-g{self.group_size}" if self.method == "int4" else self.method


def parse_quant(mode: str | None, source_kind: str = "hf", device: str | torch.device = "cpu") -> QuantSpec:
    """A --quant value -> QuantSpec.

    None / "auto": a GGUF file keeps its own quantization (packed int4/int8 layers) on CUDA, and on CPU wherever llmd's
    compiled CPU kernel (llmd.kernels.cpu_gemm) builds: that is faster and ~5x smaller than fp32 there. Without it a
    GGUF is dequantized on CPU, since torch's own CPU int4/int8 kernels are many times slower than fp32 without
    AVX-512. HF folders: none.
    "gguf": keep the GGUF file's own quantization everywhere.
    """
    if mode is None or mode == "auto":
        on_cuda = torch.device(device).type == "cuda"
        keep = source_kind == "gguf" and (on_cuda or cpu_gemm.available())
        return QuantSpec("gguf" if keep else "none")
    mode = mode.strip().lower()
    if mode == "gguf":
        if source_kind != "gguf":
            raise ValueError("--quant gguf keeps a GGUF file's own quantization; this model is not a GGUF file")
        return QuantSpec("gguf")
    m = re.fullmatch(r"int4(?:-g(\d+))?", mode)
    if m:
        group = int(m.group(1) or DEFAULT_INT4_GROUP)
        if group not in (32, 64, 128):
            raise ValueError(f"int4 group size must be 32, 64 or 128, not {group}")
        return QuantSpec("int4", group, calibrate=True)
    if mode in ("none", "int8", "bnb-int8", "bnb-nf4"):
        return QuantSpec(mode)
    raise ValueError(f"unknown quantization {mode!r}; choose one of: {', '.join(QUANT_MODES)}")


# ---------------------------------------------------------------------------------------------------------------
# Quantizers (tensor -> packed form)


# Quantizers pick their grid per group (per row for int8) to minimise the squared reconstruction error: a min/max
# grid spends levels on rare outliers, so a few clipped ranges are tried and the best kept per group; int4 then
# refits scale and offset by least squares for the chosen codes. Ratio 1.0 (plain min/max) is always a candidate and
# a refit is only kept where it lowers the error, so the result is never worse than min/max.
INT4_CLIP_RATIOS = tuple(1.0 - 0.025 * i for i in range(13))  # 1.0 .. 0.7 of the min/max half-range
INT8_CLIP_RATIOS = tuple(1.0 - 0.01 * i for i in range(11))  # 1.0 .. 0.9 of max |w|
INT4_REFIT_STEPS = 2
_CHUNK_ELEMENTS = 1 << 22  # rows are quantized in chunks of about this many weights to bound the temporaries


def _row_chunks(n: int, row_elements: int) -> Iterator[slice]:
    rows = max(1, _CHUNK_ELEMENTS // max(1, row_elements))
    for start in range(0, n, rows):
        yield slice(start, min(n, start + rows))


def _best_clip(u: torch.Tensor, ratios: Iterable[float], offset: float, qmin: float, qmax: float) -> torch.Tensor:
    """u: weights in units of the unclipped step, centred ([..., group]); returns the ratio r per group whose grid
    q = clamp(round(u / r + offset)) reconstructs u best: sum(((q - offset) * r - u)^2). Ties keep the earlier."""
    buf = torch.empty_like(u)
    best_err = best_ratio = None
    for r in ratios:
        torch.mul(u, 1.0 / r, out=buf).add_(offset).round_().clamp_(qmin, qmax).sub_(offset).mul_(r).sub_(u).square_()
        err = buf.sum(-1)
        if best_err is None:
            best_err, best_ratio = err, torch.full_like(err, r)
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_ratio = torch.where(better, r, best_ratio)
    return best_ratio


def quantize_int8(weight: torch.Tensor, clip: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """fp [N, K] -> (int8 [N, K], fp32 scales [N, 1]); symmetric per output channel, clip ratio searched per row."""
    w_all = weight.to(torch.float32)
    n, k = w_all.shape
    q_out = torch.empty(n, k, dtype=torch.int8, device=weight.device)
    s_out = torch.empty(n, 1, dtype=torch.float32, device=weight.device)
    for rows in _row_chunks(n, k):
        w = w_all[rows]
        scales = (w.abs().amax(dim=1, keepdim=True) / 127.0).clamp_min(1e-10)
        if clip:
            scales = scales * _best_clip(w / scales, INT8_CLIP_RATIOS, 0.0, -127, 127).unsqueeze(-1)
        q_out[rows] = torch.round(w / scales).clamp_(-127, 127).to(torch.int8)
        s_out[rows] = scales
    return q_out, s_out


def quantize_int4(weight: torch.Tensor, group_size: int, clip: bool = True,
                  refit_steps: int = INT4_REFIT_STEPS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp [N, K] -> (uint8 [N, K/2], scales [N, K/g], zeros [N, K/g]) fp32; asymmetric per group.

    clip=False, refit_steps=0 is plain min/max rounding (the baseline the tests compare against)."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"in_features {k} is not a multiple of the int4 group size {group_size}")
    groups = k // group_size
    w_all = weight.to(torch.float32).view(n, groups, group_size)
    q_out = torch.empty(n, groups, group_size, dtype=torch.uint8, device=weight.device)
    s_out = torch.empty(n, groups, dtype=torch.float32, device=weight.device)
    z_out = torch.empty_like(s_out)
    for rows in _row_chunks(n, k):
        q, scale, low = fit_int4_grid(w_all[rows], clip, refit_steps)
        q_out[rows] = q.to(torch.uint8)
        s_out[rows] = scale
        z_out[rows] = low + 8.0 * scale  # w = q * s + low = (q - 8) * s + zero
    return qmm.pack_int4(q_out.view(n, k)), s_out, z_out


def fit_int4_grid(w: torch.Tensor, clip: bool = True, refit_steps: int = INT4_REFIT_STEPS):
    """w [..., group] fp32 -> (codes 0..15 as fp32 [..., group], scale [...], low [...]) with w ~ codes * scale + low:
    the clip ratio searched per group, then least-squares refits of (scale, low)."""
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    centre = (lo + hi) * 0.5
    scale = ((hi - lo) / 15.0).clamp_min(1e-10)
    if clip:
        scale = scale * _best_clip((w - centre.unsqueeze(-1)) / scale.unsqueeze(-1), INT4_CLIP_RATIOS, 7.5, 0, 15)
    low = centre - 7.5 * scale  # the value of code 0
    q = torch.round((w - low.unsqueeze(-1)) / scale.unsqueeze(-1)).clamp_(0, 15)
    for _ in range(refit_steps):
        q, scale, low = _refit_int4(w, q, scale, low)
    return q, scale, low


def _int4_error(w, q, scale, low) -> torch.Tensor:
    return (q * scale.unsqueeze(-1) + low.unsqueeze(-1) - w).square_().sum(-1)


def _refit_int4(w, q, scale, low):
    """One least-squares step: the (scale, low) that fit codes q best, then codes re-rounded to that grid; kept per
    group only where the squared error drops (a degenerate or negative fit is never taken)."""
    g = w.shape[-1]
    sq, sqq, sw, sqw = q.sum(-1), (q * q).sum(-1), w.sum(-1), (q * w).sum(-1)
    det = g * sqq - sq * sq
    new_scale = (g * sqw - sq * sw) / det.clamp_min(1e-12)
    usable = (det > 0) & (new_scale > 1e-10)
    new_scale = torch.where(usable, new_scale, scale)
    new_low = torch.where(usable, (sw - new_scale * sq) / g, low)
    new_q = torch.round((w - new_low.unsqueeze(-1)) / new_scale.unsqueeze(-1)).clamp_(0, 15)
    better = _int4_error(w, new_q, new_scale, new_low) < _int4_error(w, q, scale, low)
    return (torch.where(better.unsqueeze(-1), new_q, q), torch.where(better, new_scale, scale),
            torch.where(better, new_low, low))


# ---------------------------------------------------------------------------------------------------------------
# Modules


_cpu_kernel_fast: dict[str, bool] = {}


def cpu_kernel_is_fast(kind: str) -> bool:
    """Whether torch's CPU kernel for `kind` ("int8" / "int4") beats dequantize + fp32 matmul on this CPU.

    torch's int4/int8 weight kernels are only vectorized for some CPUs (AVX-512); elsewhere they are far slower
    than the fallback. Decided once per process by timing both on one 1024x1024 layer (a few milliseconds).
    """
    if kind not in _cpu_kernel_fast:
        import time

        torch.manual_seed(0)
        layer = (Int8Linear if kind == "int8" else Int4Linear)(1024, 1024)
        fill_from_weight(layer, torch.randn(1024, 1024), QuantSpec(kind, 0 if kind == "int8" else 64))
        x = torch.randn(1, 1024)

        def best(fn) -> float:
            times = []
            for _ in range(5):
                t = time.perf_counter()
                fn(x)
                times.append(time.perf_counter() - t)
            return min(times)

        with torch.inference_mode():
            try:
                native = best(layer._native_cpu)
            except RuntimeError:
                native = float("inf")
            _cpu_kernel_fast[kind] = native < best(layer._fallback)
    return _cpu_kernel_fast[kind]


def _use_triton(x: torch.Tensor) -> bool:
    import llmd.kernels as kernels

    return x.is_cuda and kernels.available()


class QuantizedLinear(nn.Module):
    """Base of the weight-only quantized layers: [..., in_features] -> [..., out_features]."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group_size: int,
                 dtype: torch.dtype | None = None, device=None):
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False) \
            if bias else None
        self._cpu_cache: dict = {}  # per activation dtype: scales cast once, prepacked forms for torch's CPU kernels

    def _apply(self, fn, recurse=True):
        self._cpu_cache = {}  # a move or cast invalidates the prepacked forms
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = cpu_gemm.prepared_kernel(self._cpu_cache, self._buffers["qweight"])  # once _matmul prepared one
        if kernel is not None and x.dim() == 2 and x.dtype is torch.float32 and x.is_cpu:
            y = kernel(x)  # the decode path: 4 calls per layer and step, so no more Python than needed
        else:
            y = self._matmul(x.reshape(-1, self.in_features)).reshape(*x.shape[:-1], self.out_features)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def dequantized_weight(self) -> torch.Tensor:
        raise NotImplementedError

    @classmethod
    def concat(cls, layers: list["QuantizedLinear"]) -> "QuantizedLinear | None":
        """One layer computing `layers`' outputs side by side (same input; each output row keeps its own codes and
        scales, so the values are unchanged), or None unless they are alike in kind, width, group and bias."""
        first = layers[0]
        if any(type(m) is not cls or m.in_features != first.in_features or m.group_size != first.group_size
               or (m.bias is None) != (first.bias is None) for m in layers):
            return None
        fused = cls(first.in_features, sum(m.out_features for m in layers), first.bias is not None, first.group_size,
                    device="meta")
        for name, _ in list(fused.named_buffers()):
            fused.register_buffer(name, torch.cat([getattr(m, name) for m in layers]))
        if first.bias is not None:
            fused.bias = nn.Parameter(torch.cat([m.bias for m in layers]), requires_grad=False)
        return fused

    def _fallback(self, x: torch.Tensor) -> torch.Tensor:
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

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if _use_triton(x):
            scales = self._cpu_cache.get(("cuda", x.dtype))
            if scales is None:
                scales = self._cpu_cache[("cuda", x.dtype)] = self.scales.to(x.dtype)
            return qmm.int8_matmul(x, self.qweight, scales, self.group_size)
        if x.device.type == "cpu" and x.dtype == torch.float32:
            gemm = cpu_gemm.layer_kernel(self._cpu_cache, "int8", self.qweight, self.scales, None, self.group_size)
            if gemm is not None:
                return gemm(x)
        if x.device.type == "cpu" and self.group_size == self.in_features and cpu_kernel_is_fast("int8"):
            return self._native_cpu(x)
        return self._fallback(x)

    def _native_cpu(self, x: torch.Tensor) -> torch.Tensor:
        scales = self._cpu_cache.get(x.dtype)
        if scales is None:
            scales = self._cpu_cache[x.dtype] = self.scales.view(-1).to(x.dtype).contiguous()
        return torch._weight_int8pack_mm(x.contiguous(), self.qweight, scales)


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

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if _use_triton(x):
            sz = self._cpu_cache.get(("cuda", x.dtype))
            if sz is None:
                sz = self._cpu_cache[("cuda", x.dtype)] = (self.scales.to(x.dtype), self.zeros.to(x.dtype))
            return qmm.int4_matmul(x, self.qweight, sz[0], sz[1], self.group_size)
        if x.device.type == "cpu" and x.dtype == torch.float32:
            gemm = cpu_gemm.layer_kernel(self._cpu_cache, "int4", self.qweight, self.scales, self.zeros,
                                         self.group_size)
            if gemm is not None:
                return gemm(x)
        if x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16, torch.float16) \
                and cpu_kernel_is_fast("int4") and self._cpu_cache.get(x.dtype) is not False:
            try:
                return self._native_cpu(x)
            except RuntimeError:  # torch cannot pack this layer (its kernel wants N % 16 == 0): dequantize
                pass
        return self._fallback(x)

    def _native_cpu(self, x: torch.Tensor) -> torch.Tensor:
        packed = self._cpu_cache.get(x.dtype)
        if packed is None:
            packed = self._cpu_cache[x.dtype] = self._prepack_cpu(x.dtype)
        if packed is False:
            raise RuntimeError("torch has no CPU int4 kernel here")
        weight, scale_zeros = packed
        return torch._weight_int4pack_mm_for_cpu(x.contiguous(), weight, self.group_size, scale_zeros)

    def _prepack_cpu(self, dtype: torch.dtype):
        """torch's CPU int4 kernel wants its own weight packing and [K/g, N, 2] (scale, zero) pairs."""
        try:
            values = qmm.unpack_int4(self.qweight).to(torch.int32)
            weight = torch._convert_weight_to_int4pack_for_cpu(values, 1)
            scale_zeros = torch.stack((self.scales, self.zeros), dim=-1).transpose(0, 1).contiguous().to(dtype)
            return weight, scale_zeros
        except (RuntimeError, AttributeError):  # an older torch without the op: dequantize instead
            return False


# ---------------------------------------------------------------------------------------------------------------
# Building quantized layers


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


def fill_from_weight(layer: nn.Module, weight: torch.Tensor, spec: QuantSpec) -> None:
    """Quantize an fp weight [N, K] into a layer made by `empty_quantized`."""
    if isinstance(layer, Int8Linear):
        q, s = quantize_int8(weight)
        layer.group_size = layer.in_features
        layer.qweight = q.to(layer.qweight.device)
        layer.scales = s.to(layer.scales.device)
    elif isinstance(layer, Int4Linear):
        fill_int4(layer, *quantize_int4(weight, layer.group_size))
    else:
        _bnb_fill(layer, weight, spec.method)
    layer._cpu_cache = {} if isinstance(layer, QuantizedLinear) else None


def fill_int4(layer: Int4Linear, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> None:
    """Store an already quantized weight (quantize_int4's or GPTQ's layout) in an int4 layer."""
    layer.qweight.copy_(packed)
    layer.scales.copy_(scales)
    layer.zeros.copy_(zeros)
    layer._cpu_cache = {}


def _bnb():
    try:
        import bitsandbytes
    except ImportError:
        raise ValueError("--quant bnb-int8/bnb-nf4 needs bitsandbytes (pip install bitsandbytes)") from None
    return bitsandbytes


def _bnb_layer(method: str, in_features: int, out_features: int, bias: bool, dtype) -> nn.Module:
    bnb = _bnb()
    if method == "bnb-int8":
        layer = bnb.nn.Linear8bitLt(in_features, out_features, bias=bias, has_fp16_weights=False, threshold=6.0,
                                    device="meta")
    else:
        layer = bnb.nn.Linear4bit(in_features, out_features, bias=bias, quant_type="nf4",
                                  compute_dtype=dtype or torch.float32, device="meta")
    layer.weight = None  # set by _bnb_fill from the checkpoint tensor; the loader must not expect an fp weight
    return layer


def _bnb_fill(layer: nn.Module, weight: torch.Tensor, method: str) -> None:
    """bitsandbytes quantizes when the parameter moves to its device."""
    bnb = _bnb()
    device = weight.device
    if method == "bnb-int8":
        param = bnb.nn.Int8Params(weight.to(torch.float16 if device.type == "cuda" else weight.dtype).cpu(),
                                  requires_grad=False, has_fp16_weights=False)
    else:
        param = bnb.nn.Params4bit(weight.cpu(), requires_grad=False, quant_type="nf4")
    layer.weight = param.to(device)


# ---------------------------------------------------------------------------------------------------------------
# GGUF blocks -> packed layers, without dequantizing


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


# ---------------------------------------------------------------------------------------------------------------
# Applying a mode to a model while it loads


def linear_modules(model: nn.Module, include_lm_head: bool) -> dict[str, nn.Linear]:
    """The projections to quantize, by module name (embeddings and, by default, the output head stay as they are)."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and (include_lm_head or not name.endswith("lm_head")):
            out[name] = module
    return out


def swap_in_quantized(model: nn.Module, spec: QuantSpec, include_lm_head: bool = False,
                      dtype: torch.dtype | None = None, device=None,
                      gguf_types: dict[str, str] | None = None) -> dict[str, nn.Module]:
    """Replace the model's linear layers by unfilled quantized ones (call before the weights load).

    For spec "gguf" the layer follows each tensor's GGML type (gguf_types: weight name -> type), the output head
    included: Q4_0/Q4_1 -> int4 g32 (an exact byte rearrangement, for the tuned int4 kernels), every other packed
    type (llmd.kernels.gguf_blocks: Q4_K, Q6_K, Q5_0, Q8_0, ...) -> a GGUFLinear keeping the file's blocks, float
    types stay a plain linear; a packed token table becomes a GGUFEmbedding. Returns {module name: new layer}.
    """
    from llmd.kernels.gguf_blocks import BLOCKS

    from .gguf_layers import GGUFEmbedding, GGUFLinear

    swapped = {}
    if spec.method == "gguf":
        include_lm_head = True  # a packed head stays packed (a Q6_K head dequantized would be 5x its bytes)
        emb = model.model.embed_tokens
        kind = (gguf_types or {}).get("model.embed_tokens.weight")
        if kind in BLOCKS:
            model.model.embed_tokens = swapped["model.embed_tokens"] = GGUFEmbedding(
                emb.num_embeddings, emb.embedding_dim, kind, dtype or torch.float32, device=device)
    for name, linear in linear_modules(model, include_lm_head).items():
        if spec.method == "gguf":
            kind = (gguf_types or {}).get(f"{name}.weight")
            if kind in ("Q4_0", "Q4_1"):
                layer = Int4Linear(linear.in_features, linear.out_features, linear.bias is not None, 32,
                                   dtype=dtype, device=device)
            elif kind in BLOCKS:
                layer = GGUFLinear(linear.in_features, linear.out_features, kind, linear.bias is not None,
                                   dtype=dtype, device=device)
            else:
                continue
        else:
            if spec.method == "int4" and linear.in_features % spec.group_size:
                raise ValueError(f"{name}: in_features {linear.in_features} is not a multiple of the int4 group "
                                 f"size {spec.group_size}; pick a smaller group (int4-g32)")
            layer = empty_quantized(spec, linear.in_features, linear.out_features, linear.bias is not None,
                                    dtype=dtype, device=device)
            if layer is None:
                continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, layer)
        swapped[name] = layer
    return swapped


def quantizing_stream(
    tensors: Iterable, swapped: dict[str, nn.Module], spec: QuantSpec, source,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass (name, tensor) pairs through, except the weights of swapped layers, which are quantized into their layer
    on the spot. Items may also be GGUF RawTensor objects: packed blocks go straight into their layer (GGUFLinear,
    GGUFEmbedding; Q8_0/Q4 rearranged into int8/int4 layers), everything else is dequantized and continues as an fp
    tensor.

    A calibrated spec leaves the swapped layers empty (their weights are only checked to be present): they are
    filled afterwards, layer by layer, by llmd.model.calibrate.quantize_calibrated."""
    from .gguf import RawTensor, dequantize

    pending = {f"{name}.weight": layer for name, layer in swapped.items()}
    for item in tensors:
        if isinstance(item, RawTensor):
            if spec.calibrate and pending.pop(item.name, None) is not None:
                continue  # read again, by name, during calibration
            layer = pending.get(item.name)
            if layer is not None and spec.method == "gguf" and _fill_packed(layer, item, source):
                del pending[item.name]
                continue
            name = item.name
            tensor = dequantize(item.data, item.type_name, item.shape)
        else:
            name, tensor = item
        layer = pending.pop(name, None)
        if layer is None:
            yield name, tensor
        elif not spec.calibrate:
            fill_from_weight(layer, tensor, spec)
    if pending:
        shown = ", ".join(sorted(pending)[:5])
        raise ModelFileError(source, f"{len(pending)} quantized weights missing from the checkpoint (e.g. {shown})")


class Int8RowEmbedding(nn.Module):
    """Token embeddings read from an int8 head's rows, dequantized on lookup: a tied table is kept once, as int8."""

    def __init__(self, head: Int8Linear, dtype: torch.dtype):
        super().__init__()
        self.head = [head]  # a list, so the shared buffers are not registered (and counted) twice
        self.dtype = dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        head, ids = self.head[0], input_ids.reshape(-1)
        scales = head.scales.index_select(0, ids).repeat_interleave(head.group_size, dim=-1)
        rows = head.qweight.index_select(0, ids).to(torch.float32) * scales
        return rows.to(self.dtype).view(*input_ids.shape, head.in_features)


def _fill_packed(layer: nn.Module, raw, source) -> bool:
    """Fill a swapped layer from a GGUF tensor's blocks without dequantizing; False when the types do not pair
    (the tensor is then dequantized and the layer quantized from it)."""
    from .gguf_layers import GGUFEmbedding, GGUFLinear

    if isinstance(layer, (GGUFLinear, GGUFEmbedding)):
        if raw.type_name != layer.type_name:
            return False
        layer.fill(torch.from_numpy(np.array(raw.data, dtype=np.uint8, copy=True)), raw.name, source)
        return True
    if raw.type_name not in ("Q4_0", "Q4_1", "Q8_0") or (raw.type_name == "Q8_0") != isinstance(layer, Int8Linear):
        return False
    if tuple(raw.shape) != (layer.out_features, layer.in_features):
        raise ModelFileError(source, f"tensor {raw.name!r} has shape {tuple(raw.shape)}, expected "
                                     f"{(layer.out_features, layer.in_features)}")
    _fill_from_raw(layer, raw)
    return True


def _fill_from_raw(layer: nn.Module, raw) -> None:
    n, k = raw.shape
    if raw.type_name == "Q8_0":
        q, s = int8_from_q8_0(raw.data, n, k)
        layer.qweight.copy_(q)
        layer.scales.copy_(s)
    else:
        q, s, z = int4_from_q4(raw.data, raw.type_name, n, k)
        layer.qweight.copy_(q)
        layer.scales.copy_(s)
        layer.zeros.copy_(z)
    layer._cpu_cache = {}


def quantize_model(model: nn.Module, mode: str | QuantSpec, include_lm_head: bool = False) -> nn.Module:
    """Post-load transform: quantize a loaded model's linear layers in place, one layer at a time."""
    spec = mode if isinstance(mode, QuantSpec) else parse_quant(mode)
    if spec.method == "none":
        return model
    for name, linear in linear_modules(model, include_lm_head).items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, quantize_linear(linear, spec))
    return model


def quantize_tied_head(model: nn.Module, spec: QuantSpec) -> None:
    """Give a tied-embedding model a separate quantized output head (the embedding table stays as it is).
    The head is the largest single matmul of a small model's decode step."""
    if getattr(model, "lm_head", None) is not None or spec.method in ("none", "gguf"):
        return
    emb = model.model.embed_tokens.weight
    head = nn.Linear(emb.shape[1], emb.shape[0], bias=False, device="meta")
    layer = empty_quantized(spec, head.in_features, head.out_features, False, dtype=emb.dtype, device=emb.device)
    fill_from_weight(layer, emb.detach(), spec)
    model.lm_head = layer


def quantized_weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer (quantized layers keep their weights in buffers)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() in seen or t.is_meta:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def build_empty_quantized(config, dtype: torch.dtype, device, spec: QuantSpec, include_lm_head: bool = False,
                          gguf_types: dict[str, str] | None = None):
    """Like llmd.model.weights.build_empty, with quantized layers swapped in while the model is still on the meta
    device, so no full-precision copy of the swapped weights is ever allocated. Returns (model, swapped layers)."""
    from .llama import CausalLM

    with torch.device("meta"):
        model = CausalLM(config)
    model = model.to(dtype=dtype)  # before the swap: scales and zeros stay fp32
    swapped = swap_in_quantized(model, spec, include_lm_head, dtype=dtype, device="meta", gguf_types=gguf_types)
    model = model.to_empty(device=device)
    model.init_buffers(device)
    return model.eval().requires_grad_(False), swapped


def gguf_tensor_types(path) -> dict[str, str]:
    """Hugging Face weight name -> GGML type of every tensor in a GGUF file (reads no weights)."""
    from .gguf import raw_tensor_types

    return raw_tensor_types(path)


def gguf_raw_tensors(path):
    from .gguf import iter_raw_tensors

    return iter_raw_tensors(path)
