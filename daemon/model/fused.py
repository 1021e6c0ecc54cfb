"""Checkpoints that store fused projections (Phi-3/4: `qkv_proj`, `gate_up_proj`; GGUF `phi3`: `attn_qkv`, and
`ffn_up` holding gate and up) split by rows into the q/k/v and gate/up projections that llmd.model.llama declares.

This is the one place that knows the split: the weight streams of both sources pass through `split_fused`. Once the
model declares its fused layers and the loader routes checkpoint names to row slices, a fused checkpoint tensor maps
onto its layer as it is and this module goes.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

from .config import ModelConfig

_FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def fused_parts(name: str, config: ModelConfig) -> list[tuple[str, int, int]] | None:
    """[(part name, first row, end row)] for a fused checkpoint tensor's name; None for any other name."""
    stem, _, suffix = name.rpartition(".")
    layer, _, module = stem.rpartition(".")
    layer, _, group = layer.rpartition(".")
    key = f"{group}.{module}"
    if key not in _FUSED:
        return None
    if key == "self_attn.qkv_proj":
        q = config.num_attention_heads * config.head_dim  # type: ignore[operator]
        kv = config.num_key_value_heads * config.head_dim  # type: ignore[operator]
        sizes = [q, kv, kv]
    else:
        sizes = [config.intermediate_size] * 2
    out, start = [], 0
    for part, size in zip(_FUSED[key], sizes, strict=True):
        out.append((f"{layer}.{part}.{suffix}", start, start + size))
        start += size
    return out


def fused_rows(config: ModelConfig, name: str) -> int | None:
    """How many rows a fused tensor of this name must have (None: not a fused name)."""
    parts = fused_parts(name, config)
    return parts[-1][2] if parts else None


def split_fused(stream: Iterable[tuple[str, object]], config: ModelConfig) -> Iterator[tuple[str, object]]:
    """(name, tensor) pairs with each fused tensor replaced by its parts (row slices: views, no copy)."""
    from ..errors import ModelFileError

    for name, tensor in stream:
        parts = fused_parts(name, config)
        if parts is None:
            yield name, tensor
            continue
        rows = tensor.shape[0]  # type: ignore[attr-defined]
        if rows != parts[-1][2]:
            raise ModelFileError("checkpoint", f"fused tensor {name!r} has {rows} rows, expected {parts[-1][2]}")
        for part, start, end in parts:
            yield part, tensor[start:end]  # type: ignore[index]


def split_fused_readers(readers: dict[str, Callable], config: ModelConfig) -> dict[str, Callable]:
    """The same split for name -> reader maps (calibrated quantization reads a layer at a time)."""
    out: dict[str, Callable] = {}
    for name, read in readers.items():
        parts = fused_parts(name, config)
        if parts is None:
            out[name] = read
            continue
        for part, start, end in parts:
            out[part] = (lambda read=read, start=start, end=end: read()[start:end].contiguous())
    return out
