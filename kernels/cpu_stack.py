"""ctypes binding of cpu_stack.c: a model's whole stack of quantized decoder layers (Llama-shaped, Gemma 2/3/4) on the
CPU in one call (compiled into llmd.kernels.cpu_gemm's library). The structures mirror the C ones field for field; llmd.model.cpu_stack
fills them from a model and a step."""

from __future__ import annotations

import ctypes

from . import cpu_ops

_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float

# llmd_linear.kind
# gguf: q points to the kernel's llmd_gguf_part array, group is its length
KINDS = {("int8", "fp32"): 0, ("int4", "fp32"): 1, ("int8", "int8"): 2, ("int4", "int8"): 3,
         ("gguf", "fp32"): 4, ("gguf", "int8"): 5, ("gguf", "int16"): 6}


# llmd_dims.act: the gated MLP's activation
ACTS = {"silu": 0, "gelu_tanh": 1}


class Linear(ctypes.Structure):
    _fields_ = [("kind", _i64), ("n", _i64), ("k", _i64), ("group", _i64),
                ("q", _ptr), ("s", _ptr), ("z", _ptr), ("bias", _ptr)]


class Layer(ctypes.Structure):
    _fields_ = [("input_norm", _ptr), ("post_norm", _ptr), ("qkv", Linear), ("o", Linear), ("gate_up", Linear),
                ("down", Linear), ("kv", cpu_ops.KV), ("window", _i64),  # window 0: full attention
                # Gemma 3 (None / 0 otherwise): q/k head norms, the attention / MLP output norms, local RoPE tables
                ("q_norm", _ptr), ("k_norm", _ptr), ("attn_out_norm", _ptr), ("mlp_out_norm", _ptr),
                ("local_rope", _i64),
                ("softcap", _f32),  # attention logit soft-cap (Gemma 2; 0: none)
                # Gemma 4 (Dims.gemma4): k, v (v.q None: V from K), up, the per-layer input gate and projection apart;
                # V's norm's ones, the per-layer input's norm; the layer's head shape and MLP width; KV sharing;
                # its output scalar
                ("k", Linear), ("v", Linear), ("up", Linear), ("ple_gate", Linear), ("ple_proj", Linear),
                ("v_norm", _ptr), ("ple_norm", _ptr), ("head_dim", _i64), ("kv_heads", _i64),
                ("intermediate", _i64), ("kv_shared", _i64), ("scalar", _f32)]


class Dims(ctypes.Structure):
    _fields_ = [("num_layers", _i64), ("hidden", _i64), ("heads", _i64), ("kv_heads", _i64), ("head_dim", _i64),
                ("intermediate", _i64), ("eps", _f32), ("scale", _f32), ("act", _i64),  # act: ACTS
                # Gemma 4's layers (head_dim, kv_heads, intermediate: the largest), its per-layer input width
                ("gemma4", _i64), ("ple", _i64)]


class Step(ctypes.Structure):
    _fields_ = [("T", _i64), ("cos", _ptr), ("ssin", _ptr), ("slots", _ptr),
                ("num_decodes", _i64), ("decode_rows", _ptr), ("decode_tables", _ptr), ("decode_lens", _ptr),
                ("decode_stride", _i64),
                ("num_chunks", _i64), ("chunks", _ptr), ("chunk_tables", _ptr), ("num_tables", _i64),
                ("chunk_stride", _i64), ("cos_local", _ptr), ("ssin_local", _ptr),
                ("window", _ptr),  # the window layers' own KV group: a Step's address (slots and tables), or None
                ("per_layer", _ptr)]  # Gemma 4's per-layer inputs [T, layers, ple]


_bound: dict[int, ctypes.CDLL] = {}


def load() -> ctypes.CDLL | None:
    """The library with llmd_decoder_stack bound; None where the C ops are unavailable (see cpu_ops.load)."""
    lib = cpu_ops.load()
    if lib is None:
        return None
    if id(lib) not in _bound:
        fn = lib.llmd_decoder_stack
        fn.argtypes = [ctypes.POINTER(Dims), ctypes.POINTER(Layer), ctypes.POINTER(Step), _ptr, ctypes.c_int]
        fn.restype = ctypes.c_int
        _bound[id(lib)] = lib
    return lib


def run(lib: ctypes.CDLL, dims: Dims, layers: ctypes.Array, step: Step, x_ptr: int, threads: int) -> None:
    """Every layer on x [T, hidden] (fp32, contiguous) in place; raises on an argument the C code refused."""
    rc = lib.llmd_decoder_stack(ctypes.byref(dims), layers, ctypes.byref(step), x_ptr, threads)
    if rc == -1:
        raise IndexError("a KV slot, query row, context length or block id lies outside its buffer")
    if rc == -2:
        raise MemoryError("the CPU layer stack could not allocate its activations")
    if rc != 0:
        raise ValueError("a quantized CPU kernel refused its layer's shape")
