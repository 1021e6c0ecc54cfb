"""GGUF model files: validated reading, dequantization, HF-style tensor names, config and tokenizer.

A GGUF file is untrusted input. `_parse_header` reads the whole header with bounds checks (every count, string
length, dimension and tensor offset+size is checked against the file size before it is used), so a truncated or
corrupt file becomes a `ModelFileError(path, problem)` instead of a crash or a hang. It is our own small parser
rather than `gguf.GGUFReader` because that reader trusts counts (a corrupt array length makes it loop for ever) and
takes ~6 s on SmolLM2's 100k-string vocabulary; the `gguf` package still supplies the type table (GGML_QUANT_SIZES)
and is the reference that the tests compare our header and dequantization against.

Two entry points:
- `load_gguf(path) -> GGUFModel`: config, fp32 tensors (lazily, one at a time) under Hugging Face names, tokenizer.
- `iter_raw_tensors(path)`: the tensors still packed in their GGML blocks, for quantized layers that keep them so.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import mmap
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

import numpy as np
import torch
from llmd.kernels import gguf_blocks as gb

from ..errors import ModelFileError, UnsupportedArchitecture
from . import gguf_gemma4, gguf_hybrid, gguf_nemotron_h
from .pooling import gguf_pooling

log = logging.getLogger(__name__)

# ggml type name -> (elements per block, bytes per block): the float types and every packed type that llmd keeps as
# it is in the file (llmd.kernels.gguf_blocks)
SUPPORTED_TYPES = {"F32": (1, 4), "F16": (1, 2), "BF16": (1, 2), **gb.BLOCKS}
# Other types that the gguf package can dequantize (IQ2/IQ3/IQ1, TQ, NVFP4, ...) have no kernel here: their weights
# are converted to Q8_0 blocks as they load (gguf's own Q8_0 quantizer), with one warning per type that names it and
# the measured cost (the relative RMS change of the first tensor converted). Types gguf cannot dequantize are refused.
CONVERTED_TO = "Q8_0"
_GGUF_MAGIC = b"GGUF"
_MAX_DIMS = 4
_MAX_ARRAY_NESTING = 4

# GGUF value type id -> struct format of a scalar (strings and arrays handled apart)
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


# ----------------------------------------------------------------------------------------------------------------
# Header: a bounds-checked parse, done before any tensor byte is read.


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type_id: int
    dims: tuple[int, ...]  # GGUF order: dims[0] is the contiguous (innermost) axis
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return _ggml_type_name(self.type_id)

    @property
    def shape(self) -> tuple[int, ...]:
        """PyTorch order (outermost first)."""
        return tuple(reversed(self.dims))


def _ggml_type_name(type_id: int) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        return f"unknown type id {type_id}"


class _Cursor:
    """Reads little-endian values from a buffer and refuses to read past its end."""

    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.size, self.path = buf, 0, len(buf), path

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise ModelFileError(
                self.path,
                f"truncated or corrupt GGUF: {what} needs {n} bytes at offset {self.pos}, "
                f"but the file is only {self.size} bytes",
            )

    def unpack(self, fmt: str, what: str):
        n = struct.calcsize("<" + fmt)
        self.need(n, what)
        value = struct.unpack_from("<" + fmt, self.buf, self.pos)[0]
        self.pos += n
        return value

    def string(self, what: str) -> str:
        length = self.unpack("Q", f"{what} length")
        self.need(length, what)
        raw = bytes(self.buf[self.pos : self.pos + length])
        self.pos += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ModelFileError(self.path, f"corrupt GGUF: {what} is not valid UTF-8") from None

    def skip_string(self, what: str) -> None:
        length = self.unpack("Q", f"{what} length")
        self.need(length, what)
        self.pos += length


def _read_value(cur: _Cursor, type_id: int, key: str, depth: int = 0):
    """Read one metadata value (scalar, string or array, as Python objects) with bounds checks."""
    if type_id in _SCALAR_FORMATS:
        return cur.unpack(_SCALAR_FORMATS[type_id], f"value of {key!r}")
    if type_id == _STRING:
        return cur.string(f"value of {key!r}")
    if type_id == _ARRAY:
        if depth >= _MAX_ARRAY_NESTING:
            raise ModelFileError(cur.path, f"corrupt GGUF: arrays nested too deep in {key!r}")
        item_type = cur.unpack("I", f"array type of {key!r}")
        count = cur.unpack("Q", f"array length of {key!r}")
        if item_type in _SCALAR_FORMATS:
            fmt = _SCALAR_FORMATS[item_type]
            nbytes = count * struct.calcsize("<" + fmt)
            cur.need(nbytes, f"array {key!r} ({count} items)")
            values = np.frombuffer(cur.buf, dtype=np.dtype("<" + fmt), count=count, offset=cur.pos).tolist()
            cur.pos += nbytes
            return values
        if item_type == _STRING:
            # each string takes at least its 8-byte length: a count that cannot fit is refused before looping
            cur.need(count * 8, f"array {key!r} ({count} strings)")
            return [cur.string(f"string in {key!r}") for _ in range(count)]
        if item_type == _ARRAY:
            cur.need(count * 12, f"array {key!r} ({count} arrays)")
            return [_read_value(cur, _ARRAY, key, depth + 1) for _ in range(count)]
        raise ModelFileError(cur.path, f"corrupt GGUF: unknown value type {item_type} in array {key!r}")
    raise ModelFileError(cur.path, f"corrupt GGUF: unknown value type {type_id} for key {key!r}")


def _parse_header(path: Path, buf) -> tuple[dict[str, Any], list[TensorInfo]]:
    """Parse the header with bounds checks: (metadata, every tensor's checked location)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    cur = _Cursor(buf, path)
    if cur.size < 24:
        raise ModelFileError(path, f"not a GGUF file: only {cur.size} bytes")
    magic = bytes(buf[0:4])
    if magic != _GGUF_MAGIC:
        raise ModelFileError(path, f"not a GGUF file: bad magic {magic!r} (expected {_GGUF_MAGIC!r})")
    cur.pos = 4
    version = cur.unpack("I", "version")
    if version not in (2, 3):
        raise ModelFileError(path, f"unsupported GGUF version {version} (supported: 2, 3)")
    tensor_count = cur.unpack("Q", "tensor count")
    kv_count = cur.unpack("Q", "metadata count")
    # smallest possible entries: a kv is 8 (key length) + 4 (type) + 1; a tensor info is 8 + 4 + 4 + 8
    cur.need(kv_count * 13 + tensor_count * 24, f"{kv_count} metadata entries and {tensor_count} tensor infos")

    alignment = 32
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cur.string("metadata key")
        type_id = cur.unpack("I", f"type of {key!r}")
        value = metadata[key] = _read_value(cur, type_id, key)
        if key == "general.alignment":
            if type_id != 4 or not value or value & (value - 1):
                raise ModelFileError(path, f"corrupt GGUF: general.alignment {value!r} is not a power of two")
            alignment = value

    infos: list[tuple[str, int, tuple[int, ...], int]] = []
    for _ in range(tensor_count):
        name = cur.string("tensor name")
        n_dims = cur.unpack("I", f"dimension count of {name!r}")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise ModelFileError(path, f"corrupt GGUF: tensor {name!r} has {n_dims} dimensions (1..{_MAX_DIMS})")
        dims = tuple(cur.unpack("Q", f"dimensions of {name!r}") for _ in range(n_dims))
        type_id = cur.unpack("I", f"type of {name!r}")
        rel_offset = cur.unpack("Q", f"data offset of {name!r}")
        infos.append((name, type_id, dims, rel_offset))

    data_start = -(-cur.pos // alignment) * alignment
    tensors, seen = [], set()
    for name, type_id, dims, rel_offset in infos:
        if name in seen:
            raise ModelFileError(path, f"corrupt GGUF: tensor {name!r} appears twice")
        seen.add(name)
        try:
            ggml_type = GGMLQuantizationType(type_id)
        except ValueError:
            raise ModelFileError(path, f"tensor {name!r} has unknown tensor type id {type_id}") from None
        block, type_size = GGML_QUANT_SIZES[ggml_type]
        if dims[0] % block:
            raise ModelFileError(
                path, f"corrupt GGUF: tensor {name!r} row of {dims[0]} is not a multiple of {ggml_type.name} blocks"
            )
        n_elements = 1
        for d in dims:
            n_elements *= d
        nbytes = n_elements // block * type_size
        offset = data_start + rel_offset
        if offset + nbytes > cur.size:
            raise ModelFileError(
                path,
                f"tensor {name!r} ({nbytes} bytes at offset {offset}) extends past the end of the file "
                f"({cur.size} bytes): the file is truncated or corrupt",
            )
        tensors.append(TensorInfo(name, type_id, dims, offset, nbytes))
    _check_no_overlap(path, tensors)
    return metadata, tensors


def _check_no_overlap(path: Path, tensors: list[TensorInfo]) -> None:
    """GGUF stores no tensor sizes, only offsets: a size that does not match a tensor's type and shape shows as two
    tensors sharing bytes. Refused with both names (before any tensor byte is read)."""
    ordered = sorted(tensors, key=lambda t: t.offset)
    for a, b in zip(ordered, ordered[1:]):
        if a.offset + a.nbytes > b.offset and a.nbytes and b.nbytes:
            raise ModelFileError(
                path,
                f"corrupt GGUF: tensor {a.name!r} ({a.type_name} {list(a.shape)}: {a.nbytes} bytes at offset "
                f"{a.offset}) overlaps tensor {b.name!r} at offset {b.offset}: its size does not match its type and "
                "shape",
            )


# ----------------------------------------------------------------------------------------------------------------
# Opening


class _GGUFFile:
    """A checked GGUF file: its tensor table, its metadata and a mmap of its bytes."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            if not self.path.is_file():
                raise ModelFileError(self.path, "not a regular file")
        except OSError as e:
            raise ModelFileError(self.path, f"cannot read the file: {e.strerror or e}") from None
        if size < 24:
            raise ModelFileError(self.path, f"not a GGUF file: only {size} bytes")
        try:
            with open(self.path, "rb") as f:
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise ModelFileError(self.path, f"cannot map the file: {e}") from None
        self.metadata, self.tensors = _parse_header(self.path, self._mmap)

    def raw_bytes(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes (a read-only view of the mapped file), offsets already checked."""
        return np.frombuffer(self._mmap, dtype=np.uint8, count=info.nbytes, offset=info.offset)


# ----------------------------------------------------------------------------------------------------------------
# Dequantization (vectorized over all blocks; matches gguf.quants.dequantize bit for bit)


def _f16_scales(blocks: np.ndarray, start: int) -> np.ndarray:
    return blocks[:, start : start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] packed bytes -> [n, 32] values: low nibbles are elements 0..15, high nibbles 16..31.
    (numpy, not torch: torch's uint8 bit operations on CPU are ~20x slower here and dominated load time.)"""
    out = np.empty((qs.shape[0], 32), dtype=np.float32)
    out[:, :16] = qs & 0x0F
    out[:, 16:] = qs >> 4
    return out


def dequantize(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Packed GGML bytes -> fp32 tensor of `shape` (PyTorch order). Raises ValueError for other types."""
    data = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
    if type_name == "F32":
        out = data.view(np.float32).copy()
    elif type_name == "F16":
        out = data.view(np.float16).astype(np.float32)
    elif type_name == "BF16":
        return torch.from_numpy(data.copy()).view(torch.bfloat16).to(torch.float32).reshape(shape)
    elif type_name in ("Q8_0", "Q4_0", "Q4_1"):
        blocks = data.reshape(-1, SUPPORTED_TYPES[type_name][1])
        d = _f16_scales(blocks, 0)
        if type_name == "Q8_0":
            out = d * blocks[:, 2:].copy().view(np.int8).astype(np.float32)
        elif type_name == "Q4_0":
            out = (_nibbles(blocks[:, 2:]) - np.float32(8.0)) * d
        else:
            out = d * _nibbles(blocks[:, 4:]) + _f16_scales(blocks, 2)
    elif type_name in gb.BLOCKS:
        rows = torch.from_numpy(data.copy()).view(-1, gb.BLOCKS[type_name][1])
        return gb.dequantize_blocks(rows, type_name).reshape(shape)
    elif gguf_can_dequantize(type_name):
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize as gguf_dequantize

        out = gguf_dequantize(data, GGMLQuantizationType[type_name]).astype(np.float32, copy=False)
    else:
        raise ValueError(f"unsupported tensor type {type_name}")
    return torch.from_numpy(out).reshape(shape)


@functools.lru_cache(maxsize=None)
def gguf_can_dequantize(type_name: str) -> bool:
    """Whether the gguf package has a dequantizer for this GGML type (tried on one zero block)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    try:
        qtype = GGMLQuantizationType[type_name]
        gguf_dequantize(np.zeros(GGML_QUANT_SIZES[qtype][1], dtype=np.uint8), qtype)
        return True
    except (KeyError, NotImplementedError, ValueError, TypeError):
        return False


def convert_to_q8_0(data: np.ndarray, type_name: str, shape: tuple[int, ...]) -> tuple[np.ndarray, float]:
    """A tensor of a type without a kernel here -> (Q8_0 block rows [rows, row bytes], relative RMS change)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize
    from gguf.quants import quantize as gguf_quantize

    values = gguf_dequantize(np.ascontiguousarray(data).reshape(-1), GGMLQuantizationType[type_name])
    values = values.astype(np.float32, copy=False).reshape(-1, shape[-1])
    blocks = gguf_quantize(values, GGMLQuantizationType.Q8_0)
    back = gguf_dequantize(blocks, GGMLQuantizationType.Q8_0)
    rms = float(np.sqrt(np.mean(np.square(values, dtype=np.float64))))
    err = float(np.sqrt(np.mean(np.square(back - values, dtype=np.float64))))
    return blocks, (err / rms if rms > 0 else 0.0)


# ----------------------------------------------------------------------------------------------------------------
# Architectures: one table entry per llama.cpp architecture that our decoder runs.
#
# A llama.cpp GGUF keeps its hyperparameters under "<arch>." metadata keys and its tensors under llama.cpp's names
# (gguf.constants TENSOR_NAMES). An entry says which config.json architecture the file is, how its tensor names map
# onto Hugging Face's, and its quirks: whether llama.cpp's converter permuted the q/k rows, which metadata keys and
# small tensors (RoPE frequency factors) become config fields. Every architecture outside the table is refused by name.


@dataclass(frozen=True)
class GGUFArch:
    hf_architecture: str  # the config.json architecture the file becomes (llmd.model.config.SUPPORTED_ARCHITECTURES)
    # blk.N.<gguf name> -> model.layers.N.<hf name>, on top of _LAYER_NAMES (an entry mapped to None is dropped)
    layer_names: dict[str, str | None] = field(default_factory=dict)
    # llama.cpp's converter interleaves each q/k head's rotary halves for its non-NEOX RoPE (llama arch only); the
    # NEOX-RoPE architectures (qwen2, qwen3, phi3, gemma) keep Hugging Face's row order
    permuted_qk: bool = False
    # "<arch>.<suffix>" metadata -> a config.json key, beyond _CONFIG_KEYS (value converted by the callable)
    config_keys: dict[str, tuple[str, Callable[[Any], Any]]] = field(default_factory=dict)
    # non-layer tensors that are configuration rather than weights (RoPE frequency factors): never loaded as weights,
    # handed to `quirks` as fp32 lists
    config_tensors: tuple[str, ...] = ()
    # last word on the config dict: quirks(cfg, meta, "<arch>.", {config tensor present: its values})
    quirks: Callable[[dict, dict, str, dict[str, list[float]]], None] | None = None
    # what llama.cpp's converter added to every `*norm.weight` (Gemma: 1, its RMSNorm multiplier is 1 + weight);
    # subtracted again as the tensors load, in fp32 as transformers' GGUF loader does; but not from the norms whose
    # Hugging Face name ends with one of `unshifted_norms`
    norm_shift: float = 0.0
    unshifted_norms: tuple[str, ...] = ()
    # other value transforms of the converter, undone as the (small) tensors load in fp32: HF name suffix -> the
    # undoing function (a ValueError it raises is the file's fault, named with the tensor)
    undo: dict[str, Callable[[torch.Tensor], torch.Tensor]] = field(default_factory=dict)
    # the tensors' layout against the metadata, from the header: check(path, {gguf name: shape}, config dict)
    check: Callable[[Path, dict[str, tuple[int, ...]], dict], None] | None = None
    # the same from the header before the config is built, which it may complete from the tensors (Gemma 4's V from
    # K), listing tensors to leave unread in cfg["llmd_unread_tensors"]
    screen: Callable[[Path, dict[str, tuple[int, ...]], dict], None] | None = None
    # non-layer tensors beyond _GLOBAL_NAMES: llama.cpp name -> Hugging Face module (Gemma 4's per-layer embeddings)
    global_names: dict[str, str] = field(default_factory=dict)


# blk.N.<gguf name> -> model.layers.N.<hf name>: the names every architecture here shares
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# the mixture-of-experts tensors (llmd.model.moe): the router, every expert's projection stacked [E, out, in], the
# shared expert and its gate, GLM's selection bias
_MOE_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "exp_probs_b": "mlp.gate.e_score_correction",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_0-9]+)(?:\.(weight|bias|scale))?$")
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.")
# parameters of their own, not a module's weight: blk.N.attn_sinks.weight is model.layers.N.self_attn.sinks
# (and Mamba2's blk.N.ssm_dt.bias, ssm_a, ssm_d: Granite's mamba.*, Nemotron-H's mixer.*)
_BARE_PARAMETERS = {"self_attn.sinks", *gguf_hybrid.BARE_PARAMETERS, *gguf_gemma4.BARE_PARAMETERS, "mamba.dt_bias",
                     "mamba.A_log", "mamba.D", *gguf_nemotron_h.BARE_PARAMETERS}

_REQUIRED = object()
# "<arch>.<suffix>" -> (config.json key, conversion, default): the keys every architecture here shares
_CONFIG_KEYS: dict[str, tuple[str, Callable[[Any], Any], Any]] = {
    "embedding_length": ("hidden_size", int, _REQUIRED),
    "feed_forward_length": ("intermediate_size", int, _REQUIRED),
    "block_count": ("num_hidden_layers", int, _REQUIRED),
    "attention.head_count": ("num_attention_heads", int, _REQUIRED),
    "attention.head_count_kv": ("num_key_value_heads", int, None),  # None: as many as the query heads
    "attention.key_length": ("head_dim", int, None),  # None: hidden size / heads
    "vocab_size": ("vocab_size", int, None),  # None: the vocabulary's length
    "attention.layer_norm_rms_epsilon": ("rms_norm_eps", float, 1e-5),
    "rope.freq_base": ("rope_theta", float, 10000.0),
    "context_length": ("max_position_embeddings", int, 2048),
}


def _rope_quirks(cfg: dict, meta: dict, p: str) -> None:
    """RoPE over fewer dimensions than a head (rope.dimension_count < head_dim) is a partial rotary factor."""
    n_rot = meta.get(p + "rope.dimension_count")
    if n_rot is not None and int(n_rot) != cfg["head_dim"]:
        cfg["partial_rotary_factor"] = int(n_rot) / cfg["head_dim"]


def _factors(factors: dict[str, list[float]], name: str, cfg: dict) -> list[float]:
    values = factors[name]
    rotary = int(cfg["head_dim"] * cfg.get("partial_rotary_factor", 1.0))
    if len(values) != rotary // 2:
        raise ValueError(f"tensor {name!r} has {len(values)} values for a rotary dimension of {rotary} "
                         f"(expected {rotary // 2})")
    if not all(math.isfinite(v) and v > 0 for v in values):
        raise ValueError(f"tensor {name!r} holds a factor that is not a positive finite number")
    return values


def _llama_quirks(cfg: dict, meta: dict, p: str, factors: dict[str, list[float]]) -> None:
    _rope_quirks(cfg, meta, p)
    scaling_type = meta.get(p + "rope.scaling.type")
    factor = meta.get(p + "rope.scaling.factor")
    if "rope_freqs.weight" in factors:
        # Llama 3.1+: llama.cpp's converter stores the llama3 scaling as one divisor per frequency, which llama.cpp
        # applies as they are; so do we (llmd.model.llama.rope_inv_freq)
        cfg["llmd_rope_freq_factors"] = _factors(factors, "rope_freqs.weight", cfg)
    elif scaling_type == "linear" and factor:
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}
    elif scaling_type not in (None, "none", "linear"):
        cfg["rope_scaling"] = {"rope_type": str(scaling_type)}  # refused by name in ModelConfig


def _moe_config(cfg: dict, meta: dict, p: str, tensor_names: set[str]) -> None:
    """A mixture of experts' settings (`<arch>.expert_count`, ...) in the family's config.json spelling, which
    llmd.model.config.moe_fields reads; a Llama file with experts is Mixtral. The layers without a router keep their
    dense MLP."""
    experts = meta.get(p + "expert_count")
    if not experts:
        return
    if cfg["architectures"] == ["LlamaForCausalLM"]:
        cfg["architectures"] = ["MixtralForCausalLM"]
    layers = cfg["num_hidden_layers"]
    cfg["num_experts"] = cfg["num_local_experts"] = cfg["n_routed_experts"] = int(experts)
    cfg["num_experts_per_tok"] = int(meta[p + "expert_used_count"])
    expert_ffn = meta.get(p + "expert_feed_forward_length")
    if expert_ffn:
        cfg["moe_intermediate_size"] = int(expert_ffn)
        if cfg["architectures"][0] in ("MixtralForCausalLM", "GptOssForCausalLM"):  # their experts' width
            cfg["intermediate_size"] = int(expert_ffn)
    shared = meta.get(p + "expert_shared_feed_forward_length")
    if shared:
        cfg["shared_expert_intermediate_size"] = int(shared)
    cfg["mlp_only_layers"] = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names]
    for key, hf_key, convert in (("expert_weights_norm", "norm_topk_prob", bool),
                                 ("expert_weights_scale", "routed_scaling_factor", float),
                                 ("expert_shared_count", "n_shared_experts", int),
                                 ("leading_dense_block_count", "first_k_dense_replace", int),
                                 ("expert_group_count", "n_group", int),
                                 ("expert_group_used_count", "topk_group", int)):
        if meta.get(p + key) is not None:
            cfg[hf_key] = convert(meta[p + key])


def _gpt_oss_quirks(cfg: dict, meta: dict, p: str) -> None:
    """Every other layer (the even ones) attends within the window, as llama.cpp and transformers lay them out; the
    YaRN of the released models does not truncate its correction range (their config.json's `truncate: false`,
    which a GGUF file has no key for)."""
    cfg["sliding_window"] = int(_meta(meta, p + "attention.sliding_window", 128))
    cfg["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                          for i in range(cfg["num_hidden_layers"])]
    if meta.get(p + "rope.scaling.type") == "yarn":
        cfg["rope_scaling"] = {**yarn_scaling(cfg, meta, p), "truncate": False}


def _glm4moe_quirks(cfg: dict, meta: dict, p: str) -> None:
    _rope_quirks(cfg, meta, p)
    cfg["num_hidden_layers"] -= int(meta.get(p + "nextn_predict_layers") or 0)  # counted in block_count
    if cfg.get("partial_rotary_factor") is None:
        cfg["partial_rotary_factor"] = 1.0  # the file says how many dimensions turn (GLM's own default is 0.5)
    gating = meta.get(p + "expert_gating_func")
    if gating is not None and int(gating) != 2:  # llama.cpp: 1 softmax, 2 sigmoid
        raise ValueError(f"{p}expert_gating_func {gating} (GLM-4.5 routes by sigmoid, 2)")


def _qwen35_quirks(cfg: dict, meta: dict, p: str, factors: dict[str, list[float]]) -> None:
    _qwen_quirks(cfg, meta, p, factors)
    gguf_hybrid.qwen35_quirks(cfg, meta, p)
    _mrope_quirks(cfg, meta, p)


def _qwen3vl_quirks(cfg: dict, meta: dict, p: str, factors: dict[str, list[float]]) -> None:
    """Qwen3-VL's text model (llmd.model.qwen3_vl): its multimodal RoPE sections and its DeepStack layer count (the
    mmproj file's features it adds; llama.cpp's converter writes n_deepstack_layers from the tower's config)."""
    _qwen_quirks(cfg, meta, p, factors)
    _mrope_quirks(cfg, meta, p)
    deepstack = int(meta.get(p + "n_deepstack_layers") or 0)
    if deepstack < 0:
        raise ValueError(f"{p}n_deepstack_layers {deepstack} is negative")
    cfg["llmd_deepstack"] = list(range(deepstack))  # (their count is what the text model needs)


def _mrope_quirks(cfg: dict, meta: dict, p: str) -> None:
    """rope.dimension_sections (llama.cpp pads mrope_section to four): the config's mrope_section."""
    sections = meta.get(p + "rope.dimension_sections")
    if sections is not None:
        if not isinstance(sections, list) or len(sections) < 3 or any(int(n) for n in sections[3:]):
            raise ValueError(f"{p}rope.dimension_sections {sections!r} is not three sections (and zeros)")
        cfg["rope_parameters"] = {**(cfg.get("rope_parameters") or {}),
                                  "mrope_section": [int(n) for n in sections[:3]]}


def _qwen_quirks(cfg: dict, meta: dict, p: str, factors: dict[str, list[float]]) -> None:
    _rope_quirks(cfg, meta, p)
    if "rope_freqs.weight" in factors:
        raise UnsupportedArchitecture(f"{p[:-1]} with per-frequency RoPE factors (rope_freqs) is not supported")
    scaling_type = meta.get(p + "rope.scaling.type")
    if scaling_type == "yarn":  # Qwen2.5's long context
        cfg["rope_scaling"] = yarn_scaling(cfg, meta, p)
    elif scaling_type not in (None, "none"):
        cfg["rope_scaling"] = {"rope_type": str(scaling_type)}  # refused by name in ModelConfig


# rope.scaling.yarn_<key> -> the transformers YaRN key llama.cpp's converter (convert_hf_to_gguf.py) writes it from
_YARN_KEYS = {"yarn_attn_factor": "attention_factor", "yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow"}


def yarn_scaling(cfg: dict, meta: dict, p: str) -> dict:
    """A GGUF's YaRN metadata as transformers' rope_scaling (completed and checked by llmd.model.config): factor,
    the pretraining context (original_context_length; absent: the file's context_length, as llama.cpp takes it) and
    the optional rope.scaling.yarn_* keys. An extrapolation factor other than 1 (yarn_ext_factor) has no transformers
    form: refused. (YaRN's `truncate` has no GGUF key: transformers' default, true, applies.)"""
    ext = meta.get(p + "rope.scaling.yarn_ext_factor")
    if ext is not None and float(ext) != 1.0:
        raise UnsupportedArchitecture(f"{p[:-1]} with YaRN extrapolation factor {ext} is not supported (only 1)")
    original = meta.get(p + "rope.scaling.original_context_length") or cfg["max_position_embeddings"]
    scaling = {"rope_type": "yarn", "factor": meta.get(p + "rope.scaling.factor"),
               "original_max_position_embeddings": int(original)}
    for suffix, key in _YARN_KEYS.items():
        if meta.get(p + "rope.scaling." + suffix) is not None:
            scaling[key] = float(meta[p + "rope.scaling." + suffix])
    return scaling


def _phi3_quirks(cfg: dict, meta: dict, p: str, factors: dict[str, list[float]]) -> None:
    _rope_quirks(cfg, meta, p)
    window = meta.get(p + "attention.sliding_window")
    if window:
        cfg["sliding_window"] = int(window)
    present = {"rope_factors_long.weight", "rope_factors_short.weight"} & set(factors)
    if len(present) == 1:
        raise ValueError(f"only one of the longrope factor tensors: {sorted(present)}")
    if present:
        # longrope (Phi-3 128k, Phi-3.5, Phi-4-mini): the factors as tensors, the rest as metadata
        cfg["rope_scaling"] = {
            "rope_type": "longrope",
            "long_factor": _factors(factors, "rope_factors_long.weight", cfg),
            "short_factor": _factors(factors, "rope_factors_short.weight", cfg),
            "original_max_position_embeddings": int(meta[p + "rope.scaling.original_context_length"]),
        }
        attn_factor = meta.get(p + "rope.scaling.attn_factor")
        if attn_factor is not None:
            cfg["rope_scaling"]["attention_factor"] = float(attn_factor)
# Gemma 2 / Gemma 3 text (llama.cpp's gemma2, gemma3). llama.cpp's converter (convert_hf_to_gguf.py, Gemma2Model /
# Gemma3Model) stores every `*norm.weight` as 1 + weight, the multiplier its plain RMSNorm applies, and keeps q/k rows
# in Hugging Face order (NEOX RoPE). The model computes (1 + weight) as the Hugging Face one does
# (llmd.model.gemma.GemmaRMSNorm). Values the file does not carry are llama.cpp's (src/llama-model.cpp): gemma3's
# sliding layers use RoPE base 10000 and every 6th layer is global; the attention scale is head_dim ** -0.5 except on
# the 27B models (hidden / heads).
_GEMMA_LAYER_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _gemma_quirks(cfg: dict, meta: dict, p: str, factors: dict[str, list[float]]) -> None:
    """The Gemma-only config.json keys (read by llmd.model.config.gemma_fields)."""
    arch = p.rstrip(".")
    head_dim = int(_meta(meta, p + "attention.key_length", 256))
    cfg["head_dim"] = head_dim
    big = cfg["num_hidden_layers"] == _GEMMA_27B_LAYERS[arch]
    cfg["query_pre_attn_scalar"] = cfg["hidden_size"] // cfg["num_attention_heads"] if big else head_dim
    cfg["sliding_window"] = int(_meta(meta, p + "attention.sliding_window", 4096))
    if arch == "gemma2":
        cfg["rope_theta"] = float(_meta(meta, p + "rope.freq_base", 10000.0))
        cfg["final_logit_softcapping"] = float(_meta(meta, p + "final_logit_softcapping", 30.0))
        cfg["attn_logit_softcapping"] = float(_meta(meta, p + "attn_logit_softcapping", 50.0))
        return
    cfg["rope_theta"] = float(_meta(meta, p + "rope.freq_base", 1_000_000.0))
    cfg["final_logit_softcapping"] = meta.get(p + "final_logit_softcapping")
    cfg["attn_logit_softcapping"] = meta.get(p + "attn_logit_softcapping")
    cfg["rope_local_base_freq"] = float(_meta(meta, p + "rope.freq_base_swa", 10000.0))
    pattern = meta.get(p + "attention.sliding_window_pattern")
    if isinstance(pattern, list):  # one flag per layer: True = sliding
        cfg["layer_types"] = ["sliding_attention" if flag else "full_attention" for flag in pattern]
    elif pattern:
        cfg["sliding_window_pattern"] = int(pattern)
    scaling, factor = meta.get(p + "rope.scaling.type"), meta.get(p + "rope.scaling.factor")
    if scaling == "linear" and factor:
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}  # the global layers only
    elif scaling not in (None, "none", "linear"):
        cfg["rope_scaling"] = {"rope_type": str(scaling)}  # refused by name in ModelConfig


# Granite 4 hybrids (llama.cpp's granitehybrid; llmd.model.mamba2). llama.cpp's converter (GraniteHybridModel, over
# Mamba2Model) writes: a head_count_kv per layer, 0 on the Mamba2 layers; the Mamba2 sizes as ssm.* keys (inner size,
# state size, group count, conv kernel, and the head count as time_step_rank); Granite's multipliers as
# attention.scale, embedding_scale, residual_scale and logit_scale; whether the attention uses RoPE as
# rope.scaling.finetuned (absent: it does, as llama.cpp reads it). Tensors: A_log as ssm_a = -exp(A_log) [heads, 1],
# D as ssm_d [heads, 1], the conv squeezed to [channels, K], the gated norm as [groups, inner / groups], dt_bias as
# ssm_dt.bias; the shared MLP's and experts' input_linear split into gate and up (ffn_gate/up_shexp, or ffn_gate/up
# without experts), their output_linear as ffn_down(_shexp|_exps), the router as ffn_gate_inp; q/k rows permuted as
# for llama.
_GRANITE_HYBRID_NAMES = {
    "ssm_in": "mamba.in_proj", "ssm_conv1d": "mamba.conv1d", "ssm_dt": "mamba.dt_bias", "ssm_a": "mamba.A_log",
    "ssm_d": "mamba.D", "ssm_norm": "mamba.norm", "ssm_out": "mamba.out_proj",
    "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "shared_mlp.gate_proj", "ffn_up_shexp": "shared_mlp.up_proj",
    "ffn_down_shexp": "shared_mlp.down_proj",
    "ffn_gate": "shared_mlp.gate_proj", "ffn_up": "shared_mlp.up_proj", "ffn_down": "shared_mlp.down_proj",
}
_MAMBA2_TRANSFORMS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    ".mamba.A_log": lambda a: torch.log(-a.reshape(-1)),
    ".mamba.D": lambda d: d.reshape(-1),
    ".mamba.norm.weight": lambda w: w.reshape(-1),
    ".mamba.conv1d.weight": lambda w: w.reshape(w.shape[0], 1, -1),
}


def _per_layer_max(value: Any) -> int:
    """A number, or one per layer (attention.head_count_kv, 0 on recurrent layers; Nemotron-H's feed_forward_length,
    0 on the layers without an MLP): the largest, the value of the layers that have one."""
    return max(int(v) for v in value) if isinstance(value, list) else int(value)


def _granite_hybrid_quirks(cfg: dict, meta: dict, p: str, factors: dict[str, list[float]]) -> None:
    """granitehybrid metadata in GraniteMoeHybridConfig's config.json keys (read by
    llmd.model.config.granite_hybrid_fields)."""
    layers, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    kv = meta.get(p + "attention.head_count_kv")
    per_layer = kv if isinstance(kv, list) else [kv] * layers
    if len(per_layer) != layers:
        raise ValueError(f"{p}attention.head_count_kv has {len(per_layer)} entries for {layers} layers")
    cfg["layer_types"] = ["attention" if v else "mamba" for v in per_layer]
    heads, inner = int(meta[p + "ssm.time_step_rank"]), int(meta[p + "ssm.inner_size"])
    if not heads or inner % heads or inner % hidden:
        raise ValueError(f"{p}ssm.inner_size {inner} does not split into {heads} heads of a multiple of "
                         f"hidden size {hidden}")
    cfg.update(mamba_n_heads=heads, mamba_d_head=inner // heads, mamba_expand=inner // hidden,
               mamba_d_state=int(meta[p + "ssm.state_size"]), mamba_n_groups=int(meta[p + "ssm.group_count"]),
               mamba_d_conv=int(meta[p + "ssm.conv_kernel"]), num_local_experts=0,
               position_embedding_type="rope" if meta.get(p + "rope.scaling.finetuned", True) else "nope",
               shared_intermediate_size=int(meta.get(p + "expert_shared_feed_forward_length")
                                            or cfg["intermediate_size"]))
    for key, hf_key in (("attention.scale", "attention_multiplier"), ("embedding_scale", "embedding_multiplier"),
                        ("residual_scale", "residual_multiplier"), ("logit_scale", "logits_scaling")):
        if meta.get(p + key):  # llama.cpp reads 0 as unset
            cfg[hf_key] = float(meta[p + key])
    cfg.setdefault("attention_multiplier", cfg["head_dim"] ** -0.5)


GGUF_ARCHITECTURES: dict[str, GGUFArch] = {
    # Llama 2/3.x, SmolLM2, Mistral 7B (llama.cpp writes Mistral as llama; its sliding window is not in the file)
    "llama": GGUFArch("LlamaForCausalLM", _MOE_NAMES, permuted_qk=True, config_tensors=("rope_freqs.weight",),
                      quirks=_llama_quirks),  # with experts: Mixtral (_moe_config)
    # Qwen2 / Qwen2.5 / Qwen2.5-Coder: q/k/v biases (attn_q.bias, ...), NEOX RoPE
    "qwen2": GGUFArch("Qwen2ForCausalLM", config_tensors=("rope_freqs.weight",), quirks=_qwen_quirks),
    # Qwen3 dense: RMSNorm over each q/k head before RoPE
    "qwen3": GGUFArch("Qwen3ForCausalLM", layer_names={"attn_q_norm": "self_attn.q_norm",
                                                       "attn_k_norm": "self_attn.k_norm"},
                      config_tensors=("rope_freqs.weight",), quirks=_qwen_quirks),
    # Phi-3 / 3.5 / 4: fused attn_qkv, and ffn_up holds gate and up: the fused layers of llmd.model.llama
    "phi3": GGUFArch("Phi3ForCausalLM", layer_names={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
                     config_tensors=("rope_factors_long.weight", "rope_factors_short.weight"),
                     quirks=_phi3_quirks),
    # Qwen1.5/Qwen2-MoE (a shared expert behind a sigmoid gate) and Qwen3-MoE (q/k norm): llmd.model.moe
    "qwen2moe": GGUFArch("Qwen2MoeForCausalLM", _MOE_NAMES, config_tensors=("rope_freqs.weight",),
                         quirks=_qwen_quirks),
    "qwen3moe": GGUFArch("Qwen3MoeForCausalLM", {**_MOE_NAMES, "attn_q_norm": "self_attn.q_norm",
                                                 "attn_k_norm": "self_attn.k_norm"},
                         config_tensors=("rope_freqs.weight",), quirks=_qwen_quirks),
    # gpt-oss: attention sinks, window and full layers alternating, YaRN, biased router and experts (MXFP4)
    "gpt-oss": GGUFArch("GptOssForCausalLM", {**_MOE_NAMES, "post_attention_norm": "post_attention_layernorm",
                                              "attn_sinks": "self_attn.sinks"},
                        quirks=lambda cfg, meta, p, factors: _gpt_oss_quirks(cfg, meta, p)),
    # GLM-4.5 / 4.5-Air: sigmoid routing with a selection bias, a shared expert, dense leading layers, partial
    # rotary; the multi-token-prediction layers after the decoder (nextn) are not run
    "glm4moe": GGUFArch("Glm4MoeForCausalLM", {**_MOE_NAMES, "post_attention_norm": "post_attention_layernorm",
                                               "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
                        quirks=lambda cfg, meta, p, factors: _glm4moe_quirks(cfg, meta, p)),
    "gemma2": GGUFArch("Gemma2ForCausalLM", _GEMMA_LAYER_NAMES, quirks=_gemma_quirks, norm_shift=1.0),
    "gemma3": GGUFArch("Gemma3ForCausalLM", _GEMMA_LAYER_NAMES, quirks=_gemma_quirks, norm_shift=1.0),
    # Qwen3-VL / Qwen3-VL-MoE's text models: Qwen3's / Qwen3-MoE's layers with multimodal RoPE and DeepStack
    # (llmd.model.qwen3_vl); their images come from the mmproj file beside them (llmd.model.vision.qwen3_5_gguf)
    "qwen3vl": GGUFArch("Qwen3VLTextModel", layer_names={"attn_q_norm": "self_attn.q_norm",
                                                         "attn_k_norm": "self_attn.k_norm"},
                        config_tensors=("rope_freqs.weight",), quirks=_qwen3vl_quirks),
    "qwen3vlmoe": GGUFArch("Qwen3VLMoeTextModel", {**_MOE_NAMES, "attn_q_norm": "self_attn.q_norm",
                                                   "attn_k_norm": "self_attn.k_norm"},
                           config_tensors=("rope_freqs.weight",), quirks=_qwen3vl_quirks),
    # Qwen3.5 / Qwen3.6 and Qwen3.5-MoE: Gated DeltaNet layers between gated attention layers (llmd.model.gguf_hybrid)
    "qwen35": GGUFArch("Qwen3_5ForCausalLM", gguf_hybrid.QWEN35_LAYER_NAMES, config_tensors=("rope_freqs.weight",),
                       quirks=_qwen35_quirks, norm_shift=1.0, unshifted_norms=gguf_hybrid.UNSHIFTED_NORMS,
                       undo=gguf_hybrid.UNDO, check=gguf_hybrid.check_layers),
    "qwen35moe": GGUFArch("Qwen3_5MoeForCausalLM", {**_MOE_NAMES, **gguf_hybrid.QWEN35_LAYER_NAMES},
                          config_keys={"feed_forward_length": ("intermediate_size", int)},
                          config_tensors=("rope_freqs.weight",), quirks=_qwen35_quirks, norm_shift=1.0,
                          unshifted_norms=gguf_hybrid.UNSHIFTED_NORMS, undo=gguf_hybrid.UNDO,
                          check=gguf_hybrid.check_layers),
    # Qwen3-Next: Qwen3.5-MoE's layers, value heads in Hugging Face's order, beta and alpha fused (ssm_ba: split by
    # llmd.model.qwen3_next)
    "qwen3next": GGUFArch("Qwen3NextForCausalLM", {**_MOE_NAMES, **gguf_hybrid.QWEN35_LAYER_NAMES,
                                                   "ssm_ba": "linear_attn.in_proj_ba"},
                          config_keys={"feed_forward_length": ("intermediate_size", int)},
                          config_tensors=("rope_freqs.weight",), quirks=_qwen35_quirks, norm_shift=1.0,
                          unshifted_norms=gguf_hybrid.UNSHIFTED_NORMS, undo=gguf_hybrid.UNDO,
                          check=gguf_hybrid.check_layers),
    # Granite 4.0-H: Mamba2 and attention layers, a shared MLP and (tiny, small) experts (llmd.model.mamba2)
    "granitehybrid": GGUFArch("GraniteMoeHybridForCausalLM", _GRANITE_HYBRID_NAMES, permuted_qk=True,
                              config_keys={"attention.head_count_kv": ("num_key_value_heads", _per_layer_max)},
                              quirks=_granite_hybrid_quirks, undo=_MAMBA2_TRANSFORMS),
    # Nemotron-H (Nano 9B/12B v2) and Nemotron 3 (Nano 30B-A3B, Super): Mamba2, attention without positions and
    # squared-ReLU MLP or experts layers, one mixer each (llmd.model.gguf_nemotron_h, llmd.model.mamba2)
    **{arch: GGUFArch("NemotronHForCausalLM", gguf_nemotron_h.LAYER_NAMES, permuted_qk=True,
                      config_keys={"attention.head_count_kv": ("num_key_value_heads", _per_layer_max),
                                   "feed_forward_length": ("intermediate_size", _per_layer_max)},
                      quirks=gguf_nemotron_h.quirks, undo=gguf_nemotron_h.undo(_MAMBA2_TRANSFORMS),
                      check=gguf_nemotron_h.check_layers) for arch in ("nemotron_h", "nemotron_h_moe")},
    # Gemma 4 text: per-layer embeddings, KV sharing, per-layer head shapes, proportional RoPE, experts beside the
    # MLP (llmd.model.gguf_gemma4)
    "gemma4": GGUFArch("Gemma4ForCausalLM", gguf_gemma4.LAYER_NAMES, config_tensors=("rope_freqs.weight",),
                       config_keys={"feed_forward_length": ("intermediate_size", gguf_gemma4.first_int),
                                    "attention.head_count_kv": ("num_key_value_heads", gguf_gemma4.first_int)},
                       quirks=gguf_gemma4.quirks, screen=gguf_gemma4.screen, global_names=gguf_gemma4.GLOBAL_NAMES),
}

# Architectures llama.cpp knows that our decoder does not run, with what they are, for the refusal message.
_REFUSED_KINDS = {
    "deepseek2": "a mixture-of-experts model",
    "llama4": "a mixture-of-experts model",
    "phimoe": "a mixture-of-experts model", "granitemoe": "a mixture-of-experts model",
    "mamba": "a state-space (Mamba) model", "mamba2": "a state-space (Mamba) model",
    "jamba": "a hybrid Mamba model", "rwkv6": "a recurrent (RWKV) model", "rwkv7": "a recurrent (RWKV) model",
    "clip": "a vision encoder (mmproj)", "qwen2vl": "a vision-language model", "qwen25vl": "a vision-language model",
    "gemma3n": "a Gemma 3n (per-layer embeddings) model",
}


def gguf_architecture(meta: dict, path: Path) -> tuple[str, GGUFArch]:
    """(the file's architecture name, its table entry); UnsupportedArchitecture naming it otherwise."""
    arch = meta.get("general.architecture")
    entry = GGUF_ARCHITECTURES.get(arch) if isinstance(arch, str) else None
    if entry is None:
        kind = _REFUSED_KINDS.get(arch) if isinstance(arch, str) else None
        raise UnsupportedArchitecture(
            f"{path}: GGUF architecture {arch!r}{f' ({kind})' if kind else ''} is not supported "
            f"(supported: {', '.join(GGUF_ARCHITECTURES)})"
        )
    return arch, entry


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """llama.cpp tensor name -> Hugging Face name; None for tensors we do not load."""
    entry = GGUF_ARCHITECTURES[arch]
    m = _LAYER_RE.match(gguf_name)
    if m:
        layer, base, suffix = m.groups()
        names = {**_LAYER_NAMES, **entry.layer_names}
        hf = names.get(f"{base}.{suffix}") or names.get(base)  # a name with its suffix first (ssm_dt.bias)
        if hf in _BARE_PARAMETERS:  # a parameter of its own, not a module's weight
            return f"model.layers.{layer}.{hf}"
        return f"model.layers.{layer}.{hf}.{suffix}" if hf and suffix in ("weight", "bias") else None
    if gguf_name in entry.config_tensors:
        return None
    base, _, suffix = gguf_name.rpartition(".")
    names = {**_GLOBAL_NAMES, **entry.global_names}
    return f"{names[base]}.{suffix}" if base in names else None


def unpermute_rows(w, n_heads: int):
    """Undo llama.cpp's q/k row interleave (its converter reorders each head's rotary halves into pairs).

    Works on any array whose first axis is the output dimension: fp weights, or packed GGML block rows (the
    permutation only moves whole rows, and quantization blocks never cross rows).
    """
    rows = w.shape[0]
    half = rows // n_heads // 2
    # llama.cpp stored, per head, row (2*i + j) what HF keeps at (j*half + i); swap the two axes back
    grouped = w.reshape(n_heads, half, 2, *w.shape[1:])
    return grouped.swapaxes(1, 2).reshape(w.shape)


def _meta(meta: dict, key: str, default=None):
    value = meta.get(key, default)
    return default if value is None else value


def hf_config_dict(meta: dict, tensor_names: set[str], path: Path,
                   factors: dict[str, list[float]] | None = None) -> dict:
    """GGUF metadata -> a Hugging Face style config.json dict (what ModelConfig.from_hf_config reads).

    `factors`: the values of the architecture's config tensors present in the file (see GGUFArch.config_tensors)."""
    arch, entry = gguf_architecture(meta, path)
    p = f"{arch}."
    cfg: dict[str, Any] = {"architectures": [entry.hf_architecture], "model_type": arch}
    keys = {**_CONFIG_KEYS, **{k: (*v, None) for k, v in entry.config_keys.items()}}
    for suffix, (key, convert, default) in keys.items():
        value = meta.get(p + suffix)
        if value is None and default is _REQUIRED:
            raise ModelFileError(path, f"GGUF metadata lacks {p + suffix!r}")
        try:
            cfg[key] = default if value is None else convert(value)
        except (TypeError, ValueError) as e:
            raise ModelFileError(path, f"GGUF metadata {p + suffix!r} has a bad value {value!r}: {e}") from None
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    if cfg["num_key_value_heads"] is None:
        cfg["num_key_value_heads"] = heads
    if cfg["head_dim"] is None:
        cfg["head_dim"] = hidden // heads if heads else 0
    if cfg["vocab_size"] is None:
        cfg["vocab_size"] = len(meta.get("tokenizer.ggml.tokens") or [])
    cfg["tie_word_embeddings"] = "output.weight" not in tensor_names
    cfg["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    cfg["use_qk_norm"] = "blk.0.attn_q_norm.weight" in tensor_names  # read where the family makes it optional
    cfg["rope_scaling"] = None
    if not (heads and hidden and cfg["num_hidden_layers"] and cfg["num_key_value_heads"]):
        raise ModelFileError(path, "GGUF metadata has a zero model size (heads, hidden size or layers)")
    if heads % cfg["num_key_value_heads"]:
        raise ModelFileError(path, f"GGUF metadata: {heads} heads is not a multiple of the KV head count")
    if entry.quirks is not None:
        try:
            entry.quirks(cfg, meta, p, factors or {})
        except UnsupportedArchitecture as e:
            raise UnsupportedArchitecture(f"{path}: {e}") from None
        except (KeyError, TypeError, ValueError) as e:
            raise ModelFileError(path, f"GGUF metadata of {arch!r} is incomplete or bad: {e!r}") from None
    try:
        _moe_config(cfg, meta, p, tensor_names)
    except (KeyError, TypeError, ValueError) as e:
        raise ModelFileError(path, f"GGUF mixture-of-experts metadata of {arch!r} is incomplete or bad: {e!r}") from None
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos_ids = [
        int(meta[k])
        for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        if meta.get(k) is not None
    ]
    cfg["llmd_pooling"] = gguf_pooling(meta)  # not a Hugging Face key: read by ModelConfig.from_hf_config
    cfg["bos_token_id"] = None if bos is None else int(bos)
    cfg["eos_token_id"] = list(dict.fromkeys(eos_ids))
    return cfg


def build_config(cfg: dict):
    from .config import ModelConfig

    return ModelConfig.from_hf_config(cfg)


# ----------------------------------------------------------------------------------------------------------------
# Public API


@dataclass
class RawTensor:
    """One tensor still packed as GGML blocks.

    `name` is the Hugging Face name, `type_name` the ggml type ("Q4_K", "Q6_K", "Q8_0", "F16", ...), `shape` the
    logical PyTorch shape (e.g. [out_features, in_features]), `data` a uint8 array [rows, row_bytes] with one
    matrix row per line (rows of q_proj/k_proj already in Hugging Face order). For a 1-D tensor rows == 1.
    Block layouts: llmd.kernels.gguf_blocks (a type without a kernel here arrives already converted to Q8_0).
    """

    name: str
    type_name: str
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass
class GGUFModel:
    config: Any  # llmd.model.config.ModelConfig
    tensors: Iterator[tuple[str, torch.Tensor]]
    tokenizer: Any  # llmd.model.tokenizer.Tokenizer
    metadata: dict = field(default_factory=dict)
    hf_config: dict = field(default_factory=dict)


class _Checked(NamedTuple):
    """One tensor we load: where it is, its Hugging Face name and the heads to un-permute its rows by (or None)."""

    info: TensorInfo
    name: str
    heads: int | None


def _iter_checked(gf: _GGUFFile, hf_cfg: dict) -> list[_Checked]:
    """Each tensor we load, checked; refuses unsupported types first."""
    entry = GGUF_ARCHITECTURES[hf_cfg["model_type"]]
    unread = set(hf_cfg.get("llmd_unread_tensors") or ())
    out = []
    for info in gf.tensors:
        if info.name in unread:
            continue
        block = _BLOCK_RE.match(info.name)
        if block and int(block.group(1)) >= hf_cfg["num_hidden_layers"]:
            continue  # a layer after the decoder's (GLM's multi-token prediction): not run
        name = hf_tensor_name(info.name, hf_cfg["model_type"])
        if name is None:
            if info.name in entry.config_tensors:
                continue
            # a tensor the decoder has no place for would be dropped silently and the model run without it
            raise ModelFileError(gf.path, f"tensor {info.name!r} is not part of the {hf_cfg['model_type']!r} "
                                          "architecture as llmd runs it")
        if info.type_name not in SUPPORTED_TYPES and not gguf_can_dequantize(info.type_name):
            raise ModelFileError(
                gf.path,
                f"tensor {info.name!r} has type {info.type_name}, which llmd does not load "
                f"(supported: {', '.join(SUPPORTED_TYPES)}; others the gguf package dequantizes load as Q8_0)",
            )
        heads = None
        if not entry.permuted_qk:
            pass
        elif name.endswith("q_proj.weight") or name.endswith("q_proj.bias"):
            heads = hf_cfg["num_attention_heads"]
        elif name.endswith("k_proj.weight") or name.endswith("k_proj.bias"):
            heads = hf_cfg["num_key_value_heads"]
        if heads is not None and info.shape[0] % (2 * heads):
            raise ModelFileError(gf.path, f"tensor {info.name!r} shape {info.shape} does not fit {heads} heads")
        if name.endswith("shared_expert_gate.weight") and len(info.dims) == 1:  # one output: [hidden] is [1, hidden]
            info = dataclasses.replace(info, dims=(info.dims[0], 1))
        shape = gguf_hybrid.model_shape(info.shape, name)
        if shape != info.shape:
            info = dataclasses.replace(info, dims=tuple(reversed(shape)))
        _check_experts(gf.path, info, name, hf_cfg)
        out.append(_Checked(info, name, heads))
    return out


def _check_experts(path: Path, info: TensorInfo, name: str, hf_cfg: dict) -> None:
    """A mixture of experts' router and stacked expert tensors against the metadata's expert count and widths, from
    the header (before any weight is read)."""
    experts = hf_cfg.get("num_experts")
    if not experts:
        return
    hidden = hf_cfg["hidden_size"]
    width = hf_cfg.get("moe_latent_size") or hidden  # (Nemotron 3 Super's experts work in a latent space)
    inter = hf_cfg.get("moe_intermediate_size") or hf_cfg["intermediate_size"]
    expected = {".mlp.gate.weight": (experts, hidden), ".mlp.experts.gate_proj.weight": (experts, inter, width),
                ".mlp.experts.up_proj.weight": (experts, inter, width),
                ".mlp.experts.down_proj.weight": (experts, width, inter)}
    for suffix, shape in expected.items():
        if name.endswith(suffix) and tuple(info.shape) != shape:
            raise ModelFileError(path, f"tensor {info.name!r} has shape {list(info.shape)}, expected {list(shape)} "
                                       f"for {experts} experts of width {inter} (in {width}) as the metadata "
                                       "says")


def _rows(x, checked: _Checked):
    """The tensor's rows (fp or packed) in Hugging Face order: un-permuted where llama.cpp permuted them."""
    return x if checked.heads is None else unpermute_rows(x, checked.heads)


def _checked_config(hf_cfg: dict, path: Path):
    """The ModelConfig of a file's config dict, its refusals naming the file."""
    try:
        return build_config(hf_cfg)
    except ModelFileError as e:
        raise ModelFileError(path, e.problem) from None
    except UnsupportedArchitecture as e:
        raise UnsupportedArchitecture(f"{path}: {e}") from None


def _open(path) -> tuple[_GGUFFile, dict]:
    gf = _GGUFFile(path)
    _, entry = gguf_architecture(gf.metadata, gf.path)
    factors = {}
    for info in gf.tensors:
        if info.name in entry.config_tensors:
            if info.type_name not in ("F32", "F16", "BF16") or len(info.shape) != 1:
                raise ModelFileError(gf.path, f"tensor {info.name!r} ({info.type_name} {list(info.shape)}) should be "
                                              "a 1-D float tensor")
            factors[info.name] = dequantize(gf.raw_bytes(info), info.type_name, info.shape).tolist()
    hf_cfg = hf_config_dict(gf.metadata, {t.name for t in gf.tensors}, gf.path, factors)
    if entry.screen is not None:
        entry.screen(gf.path, {t.name: t.shape for t in gf.tensors}, hf_cfg)
    _checked_config(hf_cfg, gf.path)
    if entry.check is not None:
        entry.check(gf.path, {t.name: t.shape for t in gf.tensors}, hf_cfg)
    return gf, hf_cfg


def iter_raw_tensors(path) -> Iterator[RawTensor]:
    """Yield every model tensor of a checked GGUF file still packed (see RawTensor), in file order.

    Types outside SUPPORTED_TYPES load converted to Q8_0 where the gguf package can dequantize them (one warning
    per type); any other type is refused (ModelFileError) before anything is yielded.
    """
    gf, hf_cfg = _open(path)
    return _raw_generator(gf, _iter_checked(gf, hf_cfg))


def quantized_elements(path) -> tuple[list[str], int]:
    """(the quantized types of a GGUF file's tensors, how many elements they hold); reads no weights."""
    gf = _GGUFFile(path)
    infos = [t for t in gf.tensors if t.type_name not in ("F32", "F16", "BF16")]
    return sorted({t.type_name for t in infos}), sum(int(np.prod(t.shape)) for t in infos)


def raw_tensor_types(path) -> dict[str, str]:
    """Hugging Face name -> the GGML type its RawTensor will have (after any Q8_0 conversion); reads no weights."""
    gf, hf_cfg = _open(path)
    return {c.name: c.info.type_name if c.info.type_name in SUPPORTED_TYPES else CONVERTED_TO
            for c in _iter_checked(gf, hf_cfg)}


Undo = Callable[[torch.Tensor], torch.Tensor]


def _undo_of(gf: _GGUFFile, name: str) -> Undo | None:
    """How the converter's change to the tensor of Hugging Face name `name` is undone (in fp32), or None where it
    stored the tensor as it is: the architecture's norm shift (GGUFArch.norm_shift), its other transforms (undo)."""
    entry = GGUF_ARCHITECTURES[gf.metadata["general.architecture"]]
    if entry.norm_shift and name.endswith("norm.weight") and not name.endswith(entry.unshifted_norms):
        shift = entry.norm_shift
        return lambda w: w.float() - shift
    return next((undo for suffix, undo in entry.undo.items() if name.endswith(suffix)), None)


def _undone(gf: _GGUFFile, c: _Checked, w: torch.Tensor, undo: Undo | None) -> torch.Tensor:
    if undo is None:
        return w
    try:
        return undo(w)
    except ValueError as e:
        raise ModelFileError(gf.path, f"tensor {c.info.name!r} {e}") from None


def _raw_generator(gf: _GGUFFile, checked: list[_Checked]) -> Iterator[RawTensor]:
    warned: set[str] = set()
    for c in checked:
        info = c.info
        undo = _undo_of(gf, c.name)
        if undo is not None:  # a small fp tensor: dequantized, undone, passed on as F32
            w = _undone(gf, c, dequantize(gf.raw_bytes(info), info.type_name, info.shape), undo)
            yield RawTensor(c.name, "F32", tuple(w.shape), w.contiguous().numpy().view(np.uint8).reshape(1, -1))
            continue
        rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
        data = gf.raw_bytes(info).reshape(rows, -1)
        type_name = info.type_name
        if type_name not in SUPPORTED_TYPES:
            data, change = convert_to_q8_0(data, type_name, info.shape)
            if type_name not in warned:
                warned.add(type_name)
                log.warning("%s: GGUF type %s has no kernel in llmd; its tensors load converted to %s (measured on "
                            "%s: relative RMS change %.2g)", gf.path.name, type_name, CONVERTED_TO, info.name, change)
            type_name = CONVERTED_TO
        yield RawTensor(c.name, type_name, info.shape, _rows(data, c))


def _dequantized(gf: _GGUFFile, c: _Checked) -> torch.Tensor:
    w = dequantize(gf.raw_bytes(c.info), c.info.type_name, c.info.shape)
    return _undone(gf, c, w if c.heads is None else _rows(w, c).contiguous(), _undo_of(gf, c.name))


def _dequant_generator(gf: _GGUFFile, checked: list[_Checked]) -> Iterator[tuple[str, torch.Tensor]]:
    for c in checked:
        yield c.name, _dequantized(gf, c)


def tensor_readers(path) -> dict[str, Callable[[], torch.Tensor]]:
    """Hugging Face name -> a function that reads that one tensor dequantized to fp32 (q/k rows in HF order), for
    callers that need tensors in their own order (calibrated quantization reads a layer at a time)."""
    gf, hf_cfg = _open(path)

    def reader(c: _Checked) -> Callable[[], torch.Tensor]:
        return lambda: _dequantized(gf, c)

    return {c.name: reader(c) for c in _iter_checked(gf, hf_cfg)}


def _small_metadata(meta: dict) -> dict:
    """Scalar keys only (no vocab arrays, no chat template) for display."""
    return {
        k: v
        for k, v in meta.items()
        if not isinstance(v, list) and not (isinstance(v, str) and len(v) > 200)
    }


def dequantized_tensors(path) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, fp32 tensor) of a checked GGUF file, dequantized one at a time as it is consumed."""
    gf, hf_cfg = _open(path)
    return _dequant_generator(gf, _iter_checked(gf, hf_cfg))


def gguf_config(path):
    """The model config of a checked GGUF file (header only: no tokenizer, no weights)."""
    _, hf_cfg = _open(path)
    return build_config(hf_cfg)


def load_gguf(path) -> GGUFModel:
    """Open and check a GGUF file; tensors are dequantized to fp32 one at a time as the iterator is consumed."""
    from .tokenizer import Tokenizer

    gf, hf_cfg = _open(path)
    checked = _iter_checked(gf, hf_cfg)
    tokenizer = Tokenizer.from_gguf(gf.metadata, path=gf.path)
    return GGUFModel(
        config=build_config(hf_cfg),
        tensors=_dequant_generator(gf, checked),
        tokenizer=tokenizer,
        metadata=_small_metadata(gf.metadata),
        hf_config=hf_cfg,
    )


def read_gguf_metadata(path) -> dict:
    """All metadata of a checked GGUF file (arrays included), e.g. for `llmd show` and the store."""
    return _GGUFFile(path).metadata
