"""ctypes binding of cpu_recurrent.c: the recurrent layers of hybrid models on the CPU (compiled into
llmd.kernels.cpu_gemm's library), the three functions of llmd.model.recurrent over a step's flattened batch:

- `causal_conv1d`: the short depthwise causal convolution of each sequence's new inputs after the K-1 inputs of its
  conv state, the last K-1 written back, then SiLU;
- `gated_delta_rule`: the gated delta rule token by token (q, k L2-normalised, q scaled by Dk^-0.5, Hv / Hk value
  heads per q/k head), the state read from and written back to each sequence's slot;
- `mamba2_scan`: Mamba2's selective scan token by token (dt = clamp(softplus(dt + dt_bias)), a D skip), the state
  updated in place at each sequence's slot.

A sequence's rows are `query_start[b] .. query_start[b + 1] - 1` of the flat batch, its state is at `slots[b]`, and a
sequence with `fresh[b]` starts from a zero state (the tensors of llmd.model.recurrent.StateMetadata). Work is shared
out by sequence and head (and tile of value columns or state rows), never by splitting a sum, so a sequence's results
are the same bits whatever else is in the batch and however many threads run.

fp32 only (the CPU's activations; the conv state and the recurrent state in fp32 too). Each function returns None
where the library is unavailable (no compiler, LLMD_CPU_GEMM=0, a failed build check) or the tensors are not the
layouts it takes; the caller then runs the torch reference.
"""

from __future__ import annotations

import ctypes
import threading

import torch

from . import cpu_gemm

_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
MAX_TAPS = 16  # cpu_recurrent.c's MAX_TAPS and MAX_DK
MAX_DK = 256


class StateBatch(ctypes.Structure):
    """llmd_state_batch (cpu_kernels.h)."""
    _fields_ = [("seqs", _i64), ("num_slots", _i64), ("tokens", _i64), ("slots", _ptr), ("starts", _ptr),
                ("fresh", _ptr)]


class Mamba2(ctypes.Structure):
    """llmd_mamba2 (cpu_kernels.h)."""
    _fields_ = [("x", _ptr), ("dt", _ptr), ("B", _ptr), ("C", _ptr), ("dt_bias", _ptr), ("A", _ptr), ("D", _ptr),
                ("ldx", _i64), ("lddt", _i64), ("ldb", _i64), ("ldc", _i64), ("h", _i64), ("g", _i64), ("p", _i64),
                ("n", _i64), ("dt_min", _f32), ("dt_max", _f32)]


class DeltaRule(ctypes.Structure):
    """llmd_delta_rule (cpu_kernels.h)."""
    _fields_ = [("q", _ptr), ("k", _ptr), ("v", _ptr), ("g", _ptr), ("beta", _ptr), ("ldq", _i64), ("ldk", _i64),
                ("ldv", _i64), ("ldg", _i64), ("ldb", _i64), ("hk", _i64), ("hv", _i64), ("dk", _i64), ("dv", _i64),
                ("scale", _f32)]


_lock = threading.Lock()
_bound: ctypes.CDLL | None = None


def load() -> ctypes.CDLL | None:
    """The library with this file's functions bound; None where it cannot be used."""
    global _bound
    lib = cpu_gemm.load()
    if lib is None or lib is _bound:
        return lib
    with _lock:
        lib.llmd_causal_conv1d.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr, ctypes.POINTER(StateBatch),
                                           ctypes.c_int, _ptr, _i64, ctypes.c_int]
        lib.llmd_gated_delta_rule.argtypes = [ctypes.POINTER(DeltaRule), _ptr, ctypes.POINTER(StateBatch), _ptr, _i64,
                                              ctypes.c_int]
        lib.llmd_mamba2_scan.argtypes = [ctypes.POINTER(Mamba2), _ptr, ctypes.POINTER(StateBatch), _ptr, _i64,
                                         ctypes.c_int]
        lib.llmd_causal_conv1d.restype = lib.llmd_gated_delta_rule.restype = lib.llmd_mamba2_scan.restype = \
            ctypes.c_int
        _bound = lib
    return lib


def _f32_rows(t: torch.Tensor, dim: int) -> bool:
    """fp32 on the CPU, `dim` dimensions, each row's values (all but the first dimension) contiguous."""
    if t.dtype is not torch.float32 or not t.is_cpu or t.dim() != dim:
        return False
    inner = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if stride != inner and size > 1:
            return False
        inner *= size
    return True


def _batch(slots: torch.Tensor, fresh: torch.Tensor, query_start: torch.Tensor, num_slots: int,
           tokens: int) -> StateBatch | None:
    b = slots.numel()
    ok = slots.dtype is torch.int64 and query_start.dtype is torch.int64 and fresh.dtype is torch.bool \
        and slots.is_cpu and fresh.is_cpu and query_start.is_cpu and slots.is_contiguous() \
        and fresh.is_contiguous() and query_start.is_contiguous() and fresh.numel() == b \
        and query_start.numel() == b + 1
    if not ok:
        return None
    return StateBatch(b, num_slots, tokens, slots.data_ptr(), query_start.data_ptr(), fresh.data_ptr())


def _raise(rc: int, what: str) -> None:
    if rc != 0:
        raise IndexError(f"{what}: a state slot outside the pool, or token offsets outside the batch")


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
                  slots: torch.Tensor, fresh: torch.Tensor, query_start: torch.Tensor,
                  silu: bool = True) -> torch.Tensor | None:
    """Depthwise causal convolution of x [T, C] with weight [C, K] (and bias [C]) over each sequence's tokens, the
    K-1 inputs before them read from conv_state [slots, C, K-1] (zero where fresh) and the last K-1 written back;
    then SiLU. Returns [T, C], or None where the op does not apply."""
    ok = _f32_rows(x, 2) and x.shape[0] > 0 and weight.dtype is torch.float32 and weight.is_cpu \
        and weight.dim() == 2 and weight.is_contiguous() and weight.shape[0] == x.shape[1] \
        and 1 <= weight.shape[1] <= MAX_TAPS and conv_state.dtype is torch.float32 and conv_state.is_cpu \
        and conv_state.is_contiguous() and tuple(conv_state.shape[1:]) == (x.shape[1], weight.shape[1] - 1) \
        and (bias is None or (bias.dtype is torch.float32 and bias.is_cpu and bias.is_contiguous()
                              and bias.numel() == x.shape[1]))
    lib = load() if ok else None
    batch = _batch(slots, fresh, query_start, conv_state.shape[0], x.shape[0]) if lib is not None else None
    if batch is None:
        return None
    out = torch.empty(x.shape, dtype=torch.float32)
    rc = lib.llmd_causal_conv1d(x.data_ptr(), x.stride(0), x.shape[1], weight.data_ptr(), weight.shape[1],
                                None if bias is None else bias.data_ptr(), conv_state.data_ptr(), ctypes.byref(batch),
                                int(silu), out.data_ptr(), out.stride(0), torch.get_num_threads())
    _raise(rc, "causal_conv1d")
    return out


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor,
                     query_start: torch.Tensor) -> torch.Tensor | None:
    """The gated delta rule over each sequence's tokens (llmd.model.recurrent.gated_delta_rule_ref's function): q, k
    [T, Hk, Dk], v [T, Hv, Dv], g (log decay) and beta [T, Hv], state [slots, Hv, Dk, Dv] read (zero where fresh) and
    written at each sequence's slot. Returns [T, Hv, Dv], or None where the op does not apply."""
    ok = all(_f32_rows(t, 3) for t in (q, k, v)) and _f32_rows(g, 2) and _f32_rows(beta, 2) \
        and state.dtype is torch.float32 and state.is_cpu and state.is_contiguous() and state.dim() == 4 \
        and q.shape == k.shape and q.shape[0] == v.shape[0] == g.shape[0] == beta.shape[0] > 0 \
        and 0 < q.shape[2] <= MAX_DK and v.shape[1] % q.shape[1] == 0 \
        and tuple(g.shape[1:]) == tuple(beta.shape[1:]) == (v.shape[1],) \
        and tuple(state.shape[1:]) == (v.shape[1], q.shape[2], v.shape[2])
    lib = load() if ok else None
    batch = _batch(slots, fresh, query_start, state.shape[0], q.shape[0]) if lib is not None else None
    if batch is None:
        return None
    t, hk, dk = q.shape
    hv, dv = v.shape[1:]
    out = torch.empty(t, hv, dv, dtype=torch.float32)
    rule = DeltaRule(q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(), q.stride(0),
                     k.stride(0), v.stride(0), g.stride(0), beta.stride(0), hk, hv, dk, dv, dk ** -0.5)
    rc = lib.llmd_gated_delta_rule(ctypes.byref(rule), state.data_ptr(), ctypes.byref(batch), out.data_ptr(),
                                   out.stride(0), torch.get_num_threads())
    _raise(rc, "gated_delta_rule")
    return out


def _f32_vector(t: torch.Tensor, n: int) -> bool:
    return t.dtype is torch.float32 and t.is_cpu and t.is_contiguous() and t.numel() == n


def mamba2_scan(x: torch.Tensor, dt: torch.Tensor, dt_bias: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                C: torch.Tensor, D: torch.Tensor, state: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor,
                query_start: torch.Tensor, dt_limit: tuple[float, float] = (0.0, float("inf"))) -> torch.Tensor | None:
    """Mamba2's selective scan over each sequence's tokens (llmd.model.recurrent.mamba2_scan_ref's function): x [T, H,
    P], dt [T, H] (before the bias), dt_bias, A, D [H], B and C [T, G, N], state [slots, H, P, N] read (zero where
    fresh) and written at each sequence's slot. Returns y [T, H, P] (the D skip added), or None where the op does not
    apply."""
    ok = _f32_rows(x, 3) and _f32_rows(dt, 2) and _f32_rows(B, 3) and _f32_rows(C, 3) and B.shape == C.shape \
        and x.shape[0] == dt.shape[0] == B.shape[0] > 0 and dt.shape[1] == x.shape[1] \
        and x.shape[1] % B.shape[1] == 0 and all(_f32_vector(t, x.shape[1]) for t in (dt_bias, A, D)) \
        and state.dtype is torch.float32 and state.is_cpu and state.is_contiguous() \
        and tuple(state.shape[1:]) == (x.shape[1], x.shape[2], B.shape[2])
    lib = load() if ok else None
    batch = _batch(slots, fresh, query_start, state.shape[0], x.shape[0]) if lib is not None else None
    if batch is None:
        return None
    t, h, p = x.shape
    g, n = B.shape[1:]
    out = torch.empty(t, h, p, dtype=torch.float32)
    scan = Mamba2(x.data_ptr(), dt.data_ptr(), B.data_ptr(), C.data_ptr(), dt_bias.data_ptr(), A.data_ptr(),
                  D.data_ptr(), x.stride(0), dt.stride(0), B.stride(0), C.stride(0), h, g, p, n, dt_limit[0],
                  dt_limit[1])
    rc = lib.llmd_mamba2_scan(ctypes.byref(scan), state.data_ptr(), ctypes.byref(batch), out.data_ptr(),
                              out.stride(0), torch.get_num_threads())
    _raise(rc, "mamba2_scan")
    return out
