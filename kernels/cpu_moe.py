"""ctypes binding of cpu_moe.c: a mixture-of-experts layer's packed GGUF experts for one step in one C call (llama.cpp's
mul_mat_id; compiled into llmd.kernels.cpu_gemm's library).

`MoEKernel(x, ids, weights)` computes what llmd.model.moe.Experts computes by grouping in Python, bit for bit: each
token's chosen experts' SwiGLU MLPs (gate/up, its bias, the C activation: SiLU * up or gpt-oss's clamped SwiGLU of
cpu_ops, down, its bias; or Nemotron-H's ungated relu(up)^2) with each expert's GGUFKernel arithmetic on the
activation path a packed layer takes (cpu_gemm.gguf_act: fp32, int8 or int16, chosen once per projection), then the
outputs times their weights summed in slot order. The pairs are grouped by expert in C, each token's activations are
quantized once (not once per expert), and the phases run in one OpenMP region instead of a few C calls per expert.
"""

from __future__ import annotations

import ctypes

import torch

from . import cpu_gemm
from . import gguf_blocks as gb

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p

# llmd_moe.*_act (cpu_gguf.h)
ACTS = {"fp32": 0, "int8": 1, "int16": 2}
# llmd_moe.activation (LLMD_MOE_*, cpu_kernels.h): llmd.model.config.MoEConfig.activation
ACTIVATIONS = {"silu": 0, "swiglu_clamped": 1, "gelu_tanh": 2, "relu2": 3}
UNGATED = ("relu2",)  # gate_up holds the up rows alone


class Moe(ctypes.Structure):
    """llmd_moe (cpu_kernels.h)."""
    _fields_ = [("experts", _i64), ("hidden", _i64), ("inter", _i64), ("gate_up_parts", _i64), ("down_parts", _i64),
                ("gate_up", _ptr), ("down", _ptr), ("gate_up_act", _i64), ("down_act", _i64),
                ("gate_up_bias", _ptr), ("down_bias", _ptr), ("activation", _i64), ("alpha", ctypes.c_float),
                ("limit", ctypes.c_float)]


def _bind(lib: ctypes.CDLL) -> None:
    fn = lib.llmd_moe_experts
    fn.argtypes = [ctypes.POINTER(Moe), _ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _i64, _ptr, ctypes.c_int]
    fn.restype = ctypes.c_int


def _parts_array(parts: list[tuple[torch.Tensor, str]], k: int) -> ctypes.Array:
    """Every expert's parts, expert-major ([E][parts]): expert e's blocks are qweight[e] of each part."""
    experts = parts[0][0].shape[0]
    array = (cpu_gemm.GGUFPart * (experts * len(parts)))()
    for i, (qweight, type_name) in enumerate(parts):
        if qweight.dim() != 3 or qweight.shape[0] != experts or qweight.shape[2] != gb.row_bytes(type_name, k):
            raise ValueError(f"{type_name} expert blocks of shape {tuple(qweight.shape)} do not hold {experts} "
                             f"experts' rows of K={k}")
        step = qweight.stride(0)
        for e in range(experts):
            part = array[e * len(parts) + i]
            part.type, part.n, part.q = cpu_gemm.GGUF_TYPE_IDS[type_name], qweight.shape[1], qweight.data_ptr() + e * step
    return array


def _bias(bias: torch.Tensor, experts: int, n: int, name: str) -> torch.Tensor:
    if tuple(bias.shape) != (experts, n) or not bias.is_cpu:
        raise ValueError(f"{name} bias of shape {tuple(bias.shape)} is not [{experts}, {n}] on the CPU")
    return bias.detach().to(torch.float32).contiguous()


class MoEKernel:
    """One MoE layer's experts on the CPU: gate_up and down given as their parts, each (qweight uint8
    [experts, rows, row bytes], GGML type name) as llmd.model.quant.gguf_experts.ExpertBlocks holds them (gate_up: gate
    rows then up rows, or the up rows alone for an ungated activation). act: the activation path for both projections
    (None: as LLMD_CPU_GEMM_ACT says for a packed layer; int16 falls back to fp32 for a projection whose types do not
    take it, as GGUFKernel does). biases: gate_up's [experts, gate_up rows] and down's [experts, hidden] (None: no
    bias), used as fp32. activation: a key of ACTIVATIONS ("swiglu_clamped": gpt-oss's, with its alpha and limit,
    passed as fp32 as the C op takes them)."""

    def __init__(self, lib, gate_up: list[tuple[torch.Tensor, str]], down: list[tuple[torch.Tensor, str]],
                 act: str | None = None, biases: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
                 activation: str = "silu", alpha: float = 0.0, limit: float = 0.0):
        _bind(lib)
        self.experts = gate_up[0][0].shape[0]
        rows = sum(q.shape[1] for q, _ in gate_up)
        self.inter = rows if activation in UNGATED else rows // 2
        self.hidden = sum(q.shape[1] for q, _ in down)
        parts = [(q.contiguous(), t) for q, t in gate_up], [(q.contiguous(), t) for q, t in down]
        bias = [None if b is None else _bias(b, self.experts, n, name)
                for b, n, name in zip(biases, (rows, self.hidden), ("gate_up", "down"))]
        self._keep = parts, bias  # the blocks and biases the pointers below point into live as long as the kernel
        self._gate_up, self._down = _parts_array(parts[0], self.hidden), _parts_array(parts[1], self.inter)
        self.acts = (cpu_gemm.gguf_act(lib, [t for _, t in gate_up], self.hidden, act),
                     cpu_gemm.gguf_act(lib, [t for _, t in down], self.inter, act))
        self.moe = Moe(self.experts, self.hidden, self.inter, len(gate_up), len(down),
                       ctypes.addressof(self._gate_up), ctypes.addressof(self._down), ACTS[self.acts[0]],
                       ACTS[self.acts[1]], *(None if b is None else b.data_ptr() for b in bias),
                       ACTIVATIONS[activation], alpha, limit)
        self.activation = activation
        self.types = ([t for _, t in gate_up], [t for _, t in down])
        self._fn = lib.llmd_moe_experts

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, hits: torch.Tensor | None = None,
                 threads: int | None = None) -> torch.Tensor:
        """x [T, hidden] fp32, each token's experts ids [T, k] and weights [T, k] -> [T, hidden]; hits (int64
        [experts], contiguous) gains each expert's (token, slot) pairs."""
        x = cpu_gemm._prepare_x(x, self.hidden)
        t, k = ids.shape
        if t != x.shape[0] or tuple(weights.shape) != (t, k):
            raise ValueError(f"ids {tuple(ids.shape)} and weights {tuple(weights.shape)} do not fit x "
                             f"{tuple(x.shape)}")
        ids = ids.to(torch.int64).contiguous()
        weights = weights.to(torch.float32).contiguous()
        if hits is not None and (hits.dtype is not torch.int64 or not hits.is_contiguous()
                                 or hits.numel() != self.experts):
            raise ValueError(f"hits must be a contiguous int64 tensor of {self.experts} counts")
        out = torch.empty(t, self.hidden, dtype=torch.float32)
        rc = self._fn(ctypes.byref(self.moe), x.data_ptr(), x.stride(0), t, k, ids.data_ptr(), weights.data_ptr(),
                      out.data_ptr(), self.hidden, None if hits is None else hits.data_ptr(),
                      threads or torch.get_num_threads())
        if rc == -2:
            raise MemoryError("the CPU experts kernel could not allocate its activations")
        if rc != 0:
            raise ValueError(f"the CPU experts kernel refused ids (0..{self.experts - 1}) or k={k} "
                             f"(types {self.types})")
        return out


def moe_kernel(gate_up: list[tuple[torch.Tensor, str]], down: list[tuple[torch.Tensor, str]],
               act: str | None = None, biases: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
               activation: str = "silu", alpha: float = 0.0, limit: float = 0.0) -> MoEKernel | None:
    """The MoEKernel of a layer's packed experts (arguments as MoEKernel's), for the caller to keep; None where the
    compiled kernels are off or unavailable or do not know a type or the activation (then the experts run one
    GGUFKernel each)."""
    lib = cpu_gemm.load()
    ok = lib is not None and all(t in cpu_gemm.GGUF_TYPE_IDS for _, t in gate_up + down) and activation in ACTIVATIONS
    return MoEKernel(lib, gate_up, down, act, biases, activation, alpha, limit) if ok else None
