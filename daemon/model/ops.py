"""The per-token glue ops of a decoder layer (RMSNorm, RoPE, SiLU * up, GELU-tanh * up (fused or apart), gpt-oss's
clamped SwiGLU), bound once per model to the C library or to torch, so each `forward` in llmd.model.llama (and
llmd.model.moe) has one line per op and no device branch.

`choose_ops(device, dtype)` picks the table when the model is prepared for its device (llmd.model.loader): `CPU_OPS`
on the CPU with fp32 weights where the compiled ops (llmd.kernels.cpu_ops) load, else `TORCH_OPS`. A C op still
runs its torch code on a tensor it does not take (not fp32, not contiguous), so either table is correct everywhere;
the choice is only about speed. Each replaces five to fifteen small torch calls whose fixed cost dominated a small
model's decode step. (A model that was never prepared, built directly in a test, uses TORCH_OPS.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ..kernels import cpu_ops, openmp


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:  # torch's fused op, bit-identical to the steps below for fp32 (tested)
        return F.rms_norm(x, weight.shape, weight, eps)
    # Normalise in fp32 and cast back before the weight multiply, exactly as transformers does.
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE, x * cos + rotate_half(x) * sin, with rotate_half's sign folded into the sin table
    (rotate_half(x) * sin == roll(x, d/2) * signed_sin exactly): fewer ops per layer on the decode path."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def torch_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, heads: int, head_dim: int
               ) -> torch.Tensor:
    return apply_rope(x[:, : heads * head_dim].view(x.shape[0], heads, head_dim), cos, signed_sin)


def torch_silu_mul(gate_up: torch.Tensor, n: int) -> torch.Tensor:
    gate, up = gate_up.split(n, dim=-1)
    return F.silu(gate) * up


def torch_gelu_mul(gate_up: torch.Tensor, n: int) -> torch.Tensor:
    gate, up = gate_up.split(n, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def torch_gelu_mul_pair(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") * up


def torch_swiglu_clamped_mul(gate_up: torch.Tensor, n: int, alpha: float, limit: float) -> torch.Tensor:
    gate, up = gate_up.split(n, dim=-1)  # transformers' order of operations (gpt-oss)
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def c_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    y = cpu_ops.rms_norm(x, weight, eps)
    return y if y is not None else torch_rms_norm(x, weight, eps)


def c_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    if cpu_ops.rope_(x, cos, signed_sin, heads, head_dim):  # in place
        return x[:, : heads * head_dim].view(x.shape[0], heads, head_dim)
    return torch_rope(x, cos, signed_sin, heads, head_dim)


def c_silu_mul(gate_up: torch.Tensor, n: int) -> torch.Tensor:
    y = cpu_ops.silu_mul(gate_up, n)
    return y if y is not None else torch_silu_mul(gate_up, n)


def c_gelu_mul(gate_up: torch.Tensor, n: int) -> torch.Tensor:
    y = cpu_ops.gelu_mul(gate_up, n)
    return y if y is not None else torch_gelu_mul(gate_up, n)


def c_gelu_mul_pair(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    y = cpu_ops.gelu_mul_pair(gate, up)
    return y if y is not None else torch_gelu_mul_pair(gate, up)


def c_swiglu_clamped_mul(gate_up: torch.Tensor, n: int, alpha: float, limit: float) -> torch.Tensor:
    y = cpu_ops.swiglu_clamped_mul(gate_up, n, alpha, limit)
    return y if y is not None else torch_swiglu_clamped_mul(gate_up, n, alpha, limit)


@dataclass(frozen=True)
class Ops:
    """One implementation of each op."""

    name: str
    # x [..., n] / sqrt(mean(x^2) + eps) * weight [n]
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    # (x [T, >= heads * d], cos, signed sin [T, 1, d], heads, d) -> the first `heads` heads of each row rotated,
    # [T, heads, d] (the C op rotates x in place and returns a view of it)
    rope: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, int], torch.Tensor]
    # (gate_up [T, 2n], n) -> silu(gate) * up [T, n]
    silu_mul: Callable[[torch.Tensor, int], torch.Tensor]
    # (gate_up [T, 2n], n) -> gelu_tanh(gate) * up [T, n] (GeGLU: Gemma)
    gelu_mul: Callable[[torch.Tensor, int], torch.Tensor]
    # (gate_up [T, 2n], n, alpha, limit) -> (clamp(up, -limit, limit) + 1) * (g * sigmoid(g * alpha)) [T, n],
    # g = min(gate, limit): gpt-oss's clamped SwiGLU
    swiglu_clamped_mul: Callable[[torch.Tensor, int, float, float], torch.Tensor]
    # (gate [T, n], up [T, n]) -> gelu_tanh(gate) * up [T, n]: gate and up apart (Gemma 4)
    gelu_mul_pair: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


TORCH_OPS = Ops("torch", torch_rms_norm, torch_rope, torch_silu_mul, torch_gelu_mul,
                torch_swiglu_clamped_mul, torch_gelu_mul_pair)
CPU_OPS = Ops("cpu", c_rms_norm, c_rope, c_silu_mul, c_gelu_mul, c_swiglu_clamped_mul, c_gelu_mul_pair)


def choose_ops(device: torch.device, dtype: torch.dtype) -> Ops:
    """The table for a model on `device` computing in `dtype`."""
    if device.type == "cpu" and dtype == torch.float32 and cpu_ops.load() is not None:
        return CPU_OPS
    return TORCH_OPS


def bind_ops(model: torch.nn.Module, ops: Ops) -> None:
    """Every module of `model` that runs ops (it has an `ops` attribute) runs these."""
    for module in model.modules():
        if hasattr(module, "ops"):
            module.ops = ops


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dimension, torch.argmax's answer: the compiled vector pass for fp32 CPU rows (torch's is
    single-threaded and ~0.4 ms over a 262k vocabulary, a few % of a small model's decode step), else torch's."""
    return cpu_ops.argmax(logits) if logits.is_cpu else torch.argmax(logits, dim=-1)


def release_cpu_threads() -> bool:
    """Hand back the calling thread's OpenMP worker threads (llmd.kernels.openmp): a model loader after the load,
    an engine thread going idle. Its next parallel region starts new ones."""
    return openmp.release_pool()
