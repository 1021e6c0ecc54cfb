"""Building a model and streaming weights into it without holding two copies.

The module is built on the meta device (no memory), materialised once with uninitialised storage in the target dtype
and device, then every checkpoint tensor is copied into its parameter one at a time. Safetensors files are opened
through `safe_open`, which memory-maps the file, so at most one source tensor is resident besides the model.
"""

from __future__ import annotations

import json
import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch
from safetensors import safe_open

from ..errors import ModelFileError
from .config import ModelConfig
from .llama import CausalLM

# Tensors some checkpoints carry that we recompute instead of loading.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass
class LoadReport:
    seconds: float
    tensors: int
    weight_bytes: int  # bytes of the materialised parameters
    rss_bytes: int  # resident memory of this process after loading
    peak_rss_bytes: int

    def summary(self) -> str:
        mib = 1024 * 1024
        return (f"{self.tensors} tensors in {self.seconds:.2f} s; weights {self.weight_bytes / mib:.0f} MiB, "
                f"process RSS {self.rss_bytes / mib:.0f} MiB (peak {self.peak_rss_bytes / mib:.0f} MiB)")


def build_empty(config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> CausalLM:
    """The model with uninitialised parameters in `dtype` on `device`, allocated exactly once."""
    with torch.device("meta"):
        model = CausalLM(config)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.init_buffers(device)  # fp32 RoPE frequencies, recomputed (buffers on meta hold no values)
    return model.eval().requires_grad_(False)


def load_tensors(model: CausalLM, tensors: Iterable[tuple[str, torch.Tensor]], source: str | Path) -> LoadReport:
    """Copy (name, tensor) pairs with HF names into the model. Every parameter must be filled exactly once."""
    start = time.perf_counter()
    params = dict(model.named_parameters())
    missing = set(params)
    count = 0
    for name, tensor in tensors:
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        if name == "lm_head.weight" and model.lm_head is None:
            continue  # tied embeddings: some checkpoints still store the (identical) head
        param = params.get(name)
        if param is None:
            raise ModelFileError(source, f"unexpected tensor {name!r} for {model.config.architecture}")
        if tuple(tensor.shape) != tuple(param.shape):
            raise ModelFileError(
                source, f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
            )
        param.data.copy_(tensor)
        missing.discard(name)
        count += 1
    if missing:
        shown = ", ".join(sorted(missing)[:5])
        raise ModelFileError(source, f"{len(missing)} tensors missing from the checkpoint (e.g. {shown})")
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return LoadReport(time.perf_counter() - start, count, weight_bytes, current_rss_bytes(), peak_rss_bytes())


def safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint's files: from model.safetensors.index.json when present, else model.safetensors / *.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelFileError(index, f"not a valid safetensors index ({exc})") from None
        files = []
        for name in names:
            # Shards are plain file names in the folder (symlinks allowed: the hub cache links snapshots to blobs).
            if not isinstance(name, str) or Path(name).name != name or name in (".", ".."):
                raise ModelFileError(index, f"shard {name!r} is not a file name inside the model folder")
            path = folder / name
            if not path.is_file():
                raise ModelFileError(folder / name, "shard listed in the index is missing")
            files.append(path)
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelFileError(folder, "no *.safetensors weights found (only safetensors is supported, never pickle)")
    return files


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) one at a time from memory-mapped safetensors files."""
    for path in files:
        try:
            handle = safe_open(str(path), framework="pt", device="cpu")
        except Exception as exc:  # safetensors raises its own error types for truncated/corrupt headers
            raise ModelFileError(path, f"cannot read safetensors file ({exc})") from None
        with handle as f:
            for name in f.keys():
                try:
                    tensor = f.get_tensor(name)
                except Exception as exc:
                    raise ModelFileError(path, f"cannot read tensor {name!r} ({exc})") from None
                yield name, tensor


def load_hf_weights(model: CausalLM, folder: Path) -> LoadReport:
    return load_tensors(model, iter_safetensors(safetensors_files(folder)), folder)


def current_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
