"""The fp32 glue of a decoder layer on the CPU, from cpu_ops.c (compiled into llmd.kernels.cpu_gemm's library):
RMSNorm, RoPE in place, SiLU(gate) * up, GELU-tanh(gate) * up and gpt-oss's clamped SwiGLU, the paged KV write, and
attention: decode tokens, and causal chunks of new tokens (prefill, speculative verify), with an optional sliding
window, logit soft-cap and per-head sink logits.

A layer's KV cache is the pair (k_cache, v_cache) [num_blocks, block_size, kv_heads, d] in fp32, fp16 or bf16, or
the 4-tuple (k, v, k_scale, v_scale) of llmd.model.kv_int8 (int8 values, fp32 scales [num_blocks, block_size,
kv_heads]); the kernels read each in its own type.

Each op replaces five to fifteen small torch calls whose fixed cost dominated a small model's decode step. Every
function returns None (or False) when the library is unavailable (no compiler, LLMD_CPU_GEMM=0 before the first
use, a failed self-check) or the tensors are not the plain fp32 CPU layouts it takes; the caller then runs its
torch code.
"""

from __future__ import annotations

import ctypes
import logging
import threading

import torch
import torch.nn.functional as F

from . import cpu_gemm

log = logging.getLogger("llmd.kernels.cpu_ops")

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
PARTITION = 256  # PART in cpu_ops.c: tokens per partition of a context in attention
# llmd_kv.dtype: the cache element types the kernels read (KV_* in cpu_kernels.h)
KV_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.int8: 3}


class KV(ctypes.Structure):
    """llmd_kv: one layer's paged cache as the C kernels take it."""

    _fields_ = [("dtype", ctypes.c_int64), ("num_blocks", ctypes.c_int64), ("block_size", ctypes.c_int64),
                ("kv_heads", ctypes.c_int64), ("d", ctypes.c_int64), ("k", ctypes.c_void_p), ("v", ctypes.c_void_p),
                ("k_scale", ctypes.c_void_p), ("v_scale", ctypes.c_void_p)]


def kv_view(kv_cache: tuple) -> KV | None:
    """The C description of a layer cache (a (k, v) pair in fp32/fp16/bf16, or an int8 (k, v, k_scale, v_scale)),
    or None where the kernels cannot read it (another dtype or device, a strided tensor, mismatched shapes)."""
    if len(kv_cache) == 2:
        (k, v), scales = kv_cache, None
    elif len(kv_cache) == 4:
        k, v, *scales = kv_cache
    else:
        return None
    code = KV_DTYPES.get(k.dtype)
    shape = k.shape
    if code is None or len(shape) != 4 or v.dtype is not k.dtype or v.shape != shape or not (k.is_cpu and v.is_cpu) \
            or not (k.is_contiguous() and v.is_contiguous()) or (scales is None) != (code != 3):
        return None
    view = KV(dtype=code, num_blocks=shape[0], block_size=shape[1], kv_heads=shape[2], d=shape[3],
              k=k.data_ptr(), v=v.data_ptr())
    if scales is not None:
        if any(s.dtype is not torch.float32 or not s.is_cpu or not s.is_contiguous() or s.shape != shape[:3]
               for s in scales):
            return None
        view.k_scale, view.v_scale = scales[0].data_ptr(), scales[1].data_ptr()
    return view


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    i64, ptr, f32, cint, kv = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int, ctypes.POINTER(KV)
    lib.llmd_rms_norm.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, f32]
    lib.llmd_rope.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64]
    lib.llmd_silu_mul.argtypes = [ptr, i64, ptr, i64, i64, i64]
    lib.llmd_gelu_mul.argtypes = [ptr, i64, ptr, i64, i64, i64]
    lib.llmd_gelu_mul2.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, i64]
    lib.llmd_swiglu_clamped_mul.argtypes = [ptr, i64, ptr, i64, i64, i64, f32, f32]
    lib.llmd_write_kv.argtypes = [ptr, i64, ptr, i64, ptr, i64, kv]
    lib.llmd_decode_attention.argtypes = [ptr, i64, ptr, i64, i64, kv, ptr, i64, ptr, i64, f32, i64, f32, ptr, ptr,
                                          i64, cint]
    lib.llmd_prefill_attention.argtypes = [ptr, i64, i64, i64, kv, ptr, i64, i64, f32, i64, f32, ptr, ptr, i64,
                                           cint]
    lib.llmd_argmax_rows.argtypes = [ptr, i64, i64, i64, ptr]
    for fn in (lib.llmd_rms_norm, lib.llmd_rope, lib.llmd_silu_mul, lib.llmd_gelu_mul, lib.llmd_gelu_mul2,
               lib.llmd_swiglu_clamped_mul,
               lib.llmd_write_kv, lib.llmd_decode_attention, lib.llmd_prefill_attention, lib.llmd_argmax_rows):
        fn.restype = cint
    return lib


def load() -> ctypes.CDLL | None:
    """The bound library, self-checked once against the torch code; None where it cannot be used."""
    global _lib, _tried
    if _tried:  # LLMD_CPU_GEMM is read until the first load: this runs once per layer and step
        return _lib
    if not cpu_gemm.enabled():
        return None
    if _checking.thread == threading.get_ident():  # the self-check's own calls
        return _checking.lib
    with _lock:
        if not _tried:
            _lib = _checked(cpu_gemm.load())
            _tried = True
    return _lib


class _checking:
    thread: int | None = None
    lib: ctypes.CDLL | None = None


def _checked(lib: ctypes.CDLL | None) -> ctypes.CDLL | None:
    if lib is None:
        return None
    try:
        _checking.lib, _checking.thread = _bind(lib), threading.get_ident()
        _self_check()
        return lib
    except Exception as exc:  # a broken build keeps the torch path
        log.warning("CPU glue ops unavailable, using torch: %s", exc)
        return None
    finally:
        _checking.lib = _checking.thread = None


def _plain(t: torch.Tensor) -> bool:
    """fp32 on the CPU with unit stride along the last dimension. (These checks run ~10 times per layer and step:
    is_cpu and is_contiguous are the cheap forms, `device.type` costs ~10x more.)"""
    return t.dtype is torch.float32 and t.is_cpu and (t.is_contiguous() or t.stride(-1) == 1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """x / sqrt(mean(x^2, -1) + eps) * weight over the last dimension (contiguous fp32 x and weight)."""
    ok = _plain(x) and x.is_contiguous() and _plain(weight) and weight.is_contiguous() \
        and weight.numel() == x.shape[-1]
    lib = load() if ok else None
    if lib is None:
        return None
    n = x.shape[-1]
    y = torch.empty_like(x)
    lib.llmd_rms_norm(x.data_ptr(), n, weight.data_ptr(), y.data_ptr(), n, x.numel() // n, n, eps)
    return y


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, -1) for fp32 rows [..., V] (the first of equal maxima, a NaN the largest): one vector pass
    in C where it runs (~10x torch's single-threaded argmax over a 262k vocabulary), else torch's."""
    ok = _plain(logits) and logits.dim() >= 1 and logits.shape[-1] > 0 and logits.numel() > 0
    lib = load() if ok else None
    if lib is None:
        return torch.argmax(logits, dim=-1)
    rows = logits.reshape(-1, logits.shape[-1])
    out = torch.empty(rows.shape[0], dtype=torch.int64)
    lib.llmd_argmax_rows(rows.data_ptr(), rows.stride(0), rows.shape[0], rows.shape[1], out.data_ptr())
    return out.view(logits.shape[:-1])


def rope_(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, heads: int, head_dim: int) -> bool:
    """Rotate-half RoPE in place on the first `heads` heads of each row of x [T, >= heads * head_dim], with cos and
    the signed sin of llmd.model.ops.apply_rope ([T, 1, head_dim]); the same values as apply_rope."""
    t = x.shape[0]
    ok = x.dim() == 2 and x.shape[1] >= heads * head_dim and _plain(x) and _plain(cos) and _plain(signed_sin) \
        and cos.is_contiguous() and signed_sin.is_contiguous() and cos.numel() == signed_sin.numel() == t * head_dim
    lib = load() if ok else None
    if lib is None:
        return False
    lib.llmd_rope(x.data_ptr(), x.stride(0), cos.data_ptr(), signed_sin.data_ptr(), t, heads, head_dim)
    return True


def silu_mul(gate_up: torch.Tensor, n: int) -> torch.Tensor | None:
    """silu(gate_up[:, :n]) * gate_up[:, n:] for the fused gate/up output [T, 2n]."""
    return _gated(gate_up, n, "llmd_silu_mul")


def gelu_mul(gate_up: torch.Tensor, n: int) -> torch.Tensor | None:
    """gelu_tanh(gate_up[:, :n]) * gate_up[:, n:] for the fused gate/up output [T, 2n] (GeGLU)."""
    return _gated(gate_up, n, "llmd_gelu_mul")


def gelu_mul_pair(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """gelu_tanh(gate) * up for separate [T, n] gate and up (each row's values contiguous; up may be a strided view,
    as a layer's slice of Gemma 4's per-layer inputs is): llmd_gelu_mul's values."""
    ok = gate.dim() == 2 and up.dim() == 2 and gate.shape == up.shape and _plain(gate) and _plain(up)
    lib = load() if ok else None
    if lib is None:
        return None
    t, n = gate.shape
    y = gate.new_empty((t, n))
    lib.llmd_gelu_mul2(gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0), y.data_ptr(), n, t, n)
    return y


def swiglu_clamped_mul(gate_up: torch.Tensor, n: int, alpha: float, limit: float) -> torch.Tensor | None:
    """gpt-oss's clamped SwiGLU for the fused gate/up output [T, 2n]: gate clamped above at limit, up to [-limit,
    limit], (up + 1) * (gate * sigmoid(gate * alpha)) in transformers' order of operations (alpha and limit as fp32)."""
    return _gated(gate_up, n, "llmd_swiglu_clamped_mul", alpha, limit)


def _gated(gate_up: torch.Tensor, n: int, fn: str, *params: float) -> torch.Tensor | None:
    """One C gated-activation call (`fn`: llmd_silu_mul, llmd_gelu_mul, llmd_swiglu_clamped_mul with its params) into
    a new [T, n], or None."""
    ok = gate_up.dim() == 2 and gate_up.shape[1] == 2 * n and _plain(gate_up)
    lib = load() if ok else None
    if lib is None:
        return None
    t = gate_up.shape[0]
    y = gate_up.new_empty((t, n))
    getattr(lib, fn)(gate_up.data_ptr(), gate_up.stride(0), y.data_ptr(), n, t, n, *params)
    return y


def _rows_of(t: torch.Tensor) -> bool:
    """[T, heads, d] whose rows of heads * d values are each contiguous."""
    return t.dim() == 3 and _plain(t) and t.stride(1) == t.shape[2]


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: tuple, slot_mapping: torch.Tensor) -> bool:
    """Store K/V [T, kv_heads, d] (fp32) into a layer cache at `slot_mapping`, converted to the cache's type (int8:
    kv_int8.quantize_int8's values and scales, bit for bit)."""
    ok = _rows_of(k) and _rows_of(v) and slot_mapping.dtype == torch.long and slot_mapping.is_contiguous() \
        and slot_mapping.numel() == k.shape[0] == v.shape[0]
    lib = load() if ok else None
    view = kv_view(kv_cache) if lib is not None else None
    if view is None or k.shape[1:] != v.shape[1:] or tuple(k.shape[1:]) != (view.kv_heads, view.d):
        return False
    rc = lib.llmd_write_kv(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), slot_mapping.data_ptr(),
                           k.shape[0], ctypes.byref(view))
    if rc != 0:
        raise IndexError("KV slot outside the cache")
    return True


def _sinks_ok(sinks: torch.Tensor | None, heads: int) -> bool:
    """None, or one fp32 logit per query head, contiguous on the CPU."""
    return sinks is None or (_plain(sinks) and sinks.is_contiguous() and sinks.numel() == heads)


def _attention_view(q: torch.Tensor, out: torch.Tensor, kv_cache: tuple) -> KV | None:
    if not (_rows_of(q) and _rows_of(out) and q.shape[1:] == out.shape[1:]):
        return None
    view = kv_view(kv_cache)
    if view is None or view.d != q.shape[2] or q.shape[1] % view.kv_heads:
        return None
    return view


def decode_attention(q: torch.Tensor, kv_cache: tuple, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     rows: torch.Tensor | None, scale: float, out: torch.Tensor, window: int | None = None,
                     softcap: float | None = None, sinks: torch.Tensor | None = None) -> bool:
    """Attention of single-token queries over their paged contexts, written into `out` [T, heads, d].

    q [T, heads, d] fp32; sequence b's query is row rows[b] (rows None: row b); block_tables [B, nb] and seq_lens
    [B] long. window: attend only to the last `window` tokens (None: all); the blocks before them are not read.
    softcap: scores become softcap * tanh(scores / softcap) before the softmax (Gemma 2; None: as they are).
    sinks: fp32 [heads], each head's logit joining its softmax denominator (gpt-oss; None: none).
    A long context is split across the threads. False (nothing written) where the op does not apply."""
    b = seq_lens.shape[0]
    ok = (window is None or window > 0) and (softcap is None or softcap > 0) \
        and block_tables.dtype == seq_lens.dtype == torch.long \
        and block_tables.is_contiguous() \
        and seq_lens.is_contiguous() and block_tables.dim() == 2 and block_tables.shape[0] == b \
        and (rows is None or (rows.dtype == torch.long and rows.is_contiguous() and rows.numel() == b)) \
        and _sinks_ok(sinks, q.shape[1])
    lib = load() if ok else None
    view = _attention_view(q, out, kv_cache) if lib is not None else None
    if view is None:
        return False
    if b == 0:
        return True
    rc = lib.llmd_decode_attention(
        q.data_ptr(), q.stride(0), None if rows is None else rows.data_ptr(), b, min(q.shape[0], out.shape[0]),
        ctypes.byref(view), block_tables.data_ptr(), block_tables.shape[1], seq_lens.data_ptr(), q.shape[1], scale,
        window or 0, softcap or 0.0, None if sinks is None else sinks.data_ptr(), out.data_ptr(), out.stride(0),
        torch.get_num_threads())
    if rc == -2:
        raise MemoryError("CPU decode attention could not allocate its scratch")
    if rc != 0:
        raise IndexError("a query row, a sequence's length or its block table lies outside its buffer")
    return True


def prefill_attention(q: torch.Tensor, kv_cache: tuple, block_table: torch.Tensor, context: int, scale: float,
                      out: torch.Tensor, window: int | None = None, softcap: float | None = None,
                      sinks: torch.Tensor | None = None) -> bool:
    """Causal attention of one sequence's chunk of new tokens q [L, heads, d] (positions context - L .. context - 1,
    their K/V already in the cache) over its paged context, written into `out` [L, heads, d]: query i sees the first
    context - L + i + 1 tokens, or with a window W the last W of them. block_table: the sequence's block ids (long).
    softcap, sinks: as for decode_attention. False where the op does not apply."""
    ok = out.shape == q.shape and block_table.dtype == torch.long and block_table.is_contiguous() \
        and block_table.dim() == 1 and context >= q.shape[0] > 0 and (window is None or window > 0) \
        and (softcap is None or softcap > 0) and q.dim() == 3 and _sinks_ok(sinks, q.shape[1])
    lib = load() if ok else None
    view = _attention_view(q, out, kv_cache) if lib is not None else None
    if view is None:
        return False
    rc = lib.llmd_prefill_attention(
        q.data_ptr(), q.stride(0), q.shape[0], context, ctypes.byref(view), block_table.data_ptr(),
        block_table.numel(), q.shape[1], scale, window or 0, softcap or 0.0,
        None if sinks is None else sinks.data_ptr(), out.data_ptr(), out.stride(0), torch.get_num_threads())
    if rc == -2:
        raise MemoryError("CPU prefill attention could not allocate its scratch")
    if rc != 0:
        raise IndexError("a block id lies outside the KV cache, or the block table is too short")
    return True


def decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale, window=None, softcap=None, sinks=None):
    """Torch reference: q [B, heads, d] (row b = sequence b) -> [B, heads, d]."""
    out = torch.empty_like(q)
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    for i, n in enumerate(seq_lens.tolist()):
        ids = block_tables[i, : (n + block_size - 1) // block_size]
        lo = 0 if window is None else max(0, n - window)
        k = k_cache[ids].flatten(0, 1)[lo:n].repeat_interleave(q.shape[1] // kv_heads, dim=1)
        v = v_cache[ids].flatten(0, 1)[lo:n].repeat_interleave(q.shape[1] // kv_heads, dim=1)
        scores = (q[i].unsqueeze(1) * k.transpose(0, 1)).sum(-1) * scale  # [heads, n]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if sinks is not None:  # each head's sink logit joins its softmax, then is dropped
            scores = torch.cat((scores, sinks[:, None]), dim=-1)
        probs = torch.softmax(scores, dim=-1)[:, :n - lo]
        out[i] = torch.einsum("hn,nhd->hd", probs, v)
    return out


def _self_check() -> None:
    """Each op against its torch form on a small case (odd sizes, GQA, several blocks); raises on a mismatch."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 40, generator=g), torch.rand(40, generator=g) + 0.5
    checks = [("rms_norm", rms_norm(x, w, 1e-5), F.rms_norm(x, (40,), w, 1e-5))]
    gu = torch.randn(3, 2 * 20, generator=g)
    checks.append(("silu_mul", silu_mul(gu, 20), F.silu(gu[:, :20]) * gu[:, 20:]))
    checks.append(("gelu_mul", gelu_mul(gu * 3, 20), F.gelu(gu[:, :20] * 3, approximate="tanh") * gu[:, 20:] * 3))
    gate, up = gu[:, :20].clamp(max=1.5) * 4, gu[:, 20:].clamp(min=-1.5, max=1.5) * 4  # beyond the limit (6) too
    checks.append(("swiglu_clamped_mul", swiglu_clamped_mul(gu * 4, 20, 1.702, 6.0),
                   (up + 1) * (gate * torch.sigmoid(gate * 1.702))))
    cos, sin = torch.randn(3, 1, 8, generator=g), torch.randn(3, 1, 8, generator=g)
    qk = torch.randn(3, 4 * 8, generator=g)
    want = qk.view(3, 4, 8) * cos + qk.view(3, 4, 8).roll(4, dims=-1) * sin
    rope_(qk, cos, sin, 4, 8)
    checks.append(("rope", qk.view(3, 4, 8), want))
    k_cache, v_cache = torch.randn(5, 4, 2, 8, generator=g), torch.randn(5, 4, 2, 8, generator=g)
    tables, lens = torch.tensor([[3, 1, 4], [0, 2, 0]]), torch.tensor([11, 5])
    q = torch.randn(2, 6, 8, generator=g)
    got = torch.empty_like(q)
    decode_attention(q, (k_cache, v_cache), tables, lens, None, 0.3, got)
    checks.append(("decode_attention", got, decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.3)))
    got_w = torch.empty_like(q)
    decode_attention(q, (k_cache, v_cache), tables, lens, None, 0.3, got_w, window=6)
    checks.append(("windowed decode_attention", got_w,
                   decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.3, window=6)))
    got_c = torch.empty_like(q)
    decode_attention(q * 8, (k_cache, v_cache), tables, lens, None, 0.3, got_c, softcap=2.0)
    checks.append(("soft-capped decode_attention", got_c,
                   decode_attention_ref(q * 8, k_cache, v_cache, tables, lens, 0.3, softcap=2.0)))
    sinks = torch.randn(6, generator=g)
    got_s = torch.empty_like(q)
    decode_attention(q, (k_cache, v_cache), tables, lens, None, 0.3, got_s, sinks=sinks)
    checks.append(("decode_attention with sinks", got_s,
                   decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.3, sinks=sinks)))
    k16, v16 = k_cache.half(), v_cache.half()  # a compact cache: read in place, widened in registers
    got16 = torch.empty_like(q)
    decode_attention(q, (k16, v16), tables, lens, None, 0.3, got16)
    checks.append(("fp16-cache decode_attention", got16,
                   decode_attention_ref(q, k16.float(), v16.float(), tables, lens, 0.3)))
    for name, got, want in checks:
        if got is None or not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
            raise RuntimeError(f"self-check of {name} failed")
