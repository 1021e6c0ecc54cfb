"""Building a model and streaming weights into it without holding two copies.

The module is built on the meta device (no memory), materialised once with uninitialised storage in the target dtype
and device, then every checkpoint tensor is read and copied into its parameter one at a time, so at most one source
tensor is resident besides the model. Safetensors headers are checked against the file size before any read.
"""

from __future__ import annotations

import json
import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch

from ..errors import ModelFileError
from .config import ModelConfig
from .registry import build_model

# Tensors some checkpoints carry that we recompute instead of loading.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass
class LoadReport:
    seconds: float
    tensors: int
    weight_bytes: int  # bytes of the materialised parameters
    rss_bytes: int  # resident memory of this process after loading
    peak_rss_bytes: int
    host_bytes: int = 0  # of weight_bytes, what stays in host memory on a GPU (llmd.model.host_table)

    def summary(self) -> str:
        mib = 1024 * 1024
        return (f"{self.tensors} tensors in {self.seconds:.2f} s; weights {self.weight_bytes / mib:.0f} MiB, "
                f"process RSS {self.rss_bytes / mib:.0f} MiB (peak {self.peak_rss_bytes / mib:.0f} MiB)"
                + (f"; {self.host_bytes / mib:.0f} MiB of the weights in host memory" if self.host_bytes else ""))


def build_empty(config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> torch.nn.Module:
    """The model with uninitialised parameters in `dtype` on `device`, allocated exactly once."""
    with torch.device("meta"):
        model = build_model(config)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.init_buffers(device)  # fp32 RoPE frequencies, recomputed (buffers on meta hold no values)
    return model.eval().requires_grad_(False)


def expected_tensors(model: torch.nn.Module, names: Iterable[str]) -> dict[str, set[str]]:
    """Parameter (or buffer) names -> the checkpoint tensors that fill them: a fused projection's parts
    (`CausalLM.checkpoint_parts`), any other name itself."""
    out = {}
    for name in names:
        module, _, leaf = name.rpartition(".")
        out[name] = {f"{part}.{leaf}" for part, _ in model.checkpoint_parts(module)}
    return out


def load_tensors(model: torch.nn.Module, tensors: Iterable[tuple[str, torch.Tensor]], source: str | Path) -> LoadReport:
    """Copy (name, tensor) pairs with HF names into the model: a part of a fused projection (q/k/v_proj,
    gate/up_proj) into its rows (`CausalLM.route`), a fused projection stored as such as a whole. Every parameter
    must be filled exactly once."""
    start = time.perf_counter()
    params = dict(model.named_parameters())
    parts = expected_tensors(model, params)
    missing = set().union(*parts.values()) if parts else set()
    count = 0
    for name, tensor in tensors:
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        if name == "lm_head.weight" and model.lm_head is None:
            continue  # tied embeddings: some checkpoints still store the (identical) head
        target, rows = model.route(name)
        param = params.get(target)
        if param is None:
            raise ModelFileError(source, f"unexpected tensor {name!r} for {model.config.architecture}")
        dest = param.data if rows is None else param.data[rows]  # rows: a slice, or an index into experts
        if tuple(tensor.shape) != tuple(dest.shape):
            raise ModelFileError(
                source, f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
            )
        dest.copy_(tensor)
        missing -= parts[target] if rows is None else model.covers(name)
        count += 1
    if missing:
        shown = ", ".join(sorted(missing)[:5])
        raise ModelFileError(source, f"{len(missing)} tensors missing from the checkpoint (e.g. {shown})")
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return LoadReport(time.perf_counter() - start, count, weight_bytes, current_rss_bytes(), peak_rss_bytes())


def text_model_tensors(tensors: Iterable, renames: dict[str, str], unread: tuple[str, ...],
                       skip: Callable[[str], bool] | None = None) -> Iterator:
    """An image-text checkpoint's tensors as its text model's: a name that starts with a key of `renames` starts with
    its value instead (`model.language_model.X` -> `model.X`); a name that starts with one of `unread` (towers,
    projectors, MTP heads), or that `skip` refuses once renamed, is left out. Items are (name, tensor) pairs or GGUF
    RawTensors (renamed in place)."""
    for item in tensors:
        name = item.name if hasattr(item, "name") else item[0]
        if name.startswith(unread):
            continue
        prefix = next((p for p in renames if name.startswith(p)), None)
        if prefix is not None:
            name = renames[prefix] + name.removeprefix(prefix)
            if hasattr(item, "name"):
                item.name = name
            else:
                item = (name, item[1])
        if skip is None or not skip(name):
            yield item


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


# safetensors dtype codes -> torch dtypes (the format is little-endian, like every platform torch runs on here).
_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
_MAX_HEADER_BYTES = 100 * 1024 * 1024


def read_safetensors_header(path: Path, f) -> tuple[int, dict[str, dict]]:
    """(offset of the data section, {name: {"dtype", "shape", "data_offsets"}}), every entry checked against the
    file size, so a truncated or corrupt file fails here with a clear error before any tensor is read."""
    size = path.stat().st_size
    raw = f.read(8)
    if len(raw) < 8:
        raise ModelFileError(path, "not a safetensors file (shorter than its 8-byte header length)")
    header_len = int.from_bytes(raw, "little")
    if header_len > min(size - 8, _MAX_HEADER_BYTES):
        raise ModelFileError(path, f"safetensors header length {header_len} does not fit the file ({size} bytes)")
    try:
        header = json.loads(f.read(header_len))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ModelFileError(path, f"safetensors header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ModelFileError(path, "safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    data_start, data_len = 8 + header_len, size - 8 - header_len
    for name, entry in header.items():
        try:
            dtype = _ST_DTYPES[entry["dtype"]]
            shape = [int(d) for d in entry["shape"]]
            begin, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ModelFileError(path, f"tensor {name!r}: bad or unsupported header entry {entry!r}") from None
        numel = 1
        for d in shape:
            if d < 0:
                raise ModelFileError(path, f"tensor {name!r}: negative dimension in shape {shape}")
            numel *= d
        if not 0 <= begin <= end <= data_len:
            raise ModelFileError(path, f"tensor {name!r}: data [{begin}, {end}) lies beyond the end of the file "
                                       f"(data section is {data_len} bytes; truncated?)")
        if end - begin != numel * dtype.itemsize:
            raise ModelFileError(path, f"tensor {name!r}: {end - begin} bytes do not hold shape {shape} of {entry['dtype']}")
        entry["torch_dtype"], entry["shape"], entry["data_offsets"] = dtype, shape, (begin, end)
    return data_start, header


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) one at a time, each read from its file into a fresh buffer.

    Plain reads rather than mmap: the file's pages are not mapped into the process, so peak memory is the model plus
    the largest single tensor (a memory-mapped checkpoint would count every touched page on top of the weights).
    """
    for path in files:
        try:
            with open(path, "rb") as f:
                data_start, header = read_safetensors_header(path, f)
                for name, entry in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                    begin, end = entry["data_offsets"]
                    f.seek(data_start + begin)
                    buf = bytearray(end - begin)
                    if f.readinto(buf) != len(buf):
                        raise ModelFileError(path, f"tensor {name!r}: file ended early (truncated?)")
                    dtype = entry["torch_dtype"]
                    tensor = torch.frombuffer(buf, dtype=dtype) if buf else torch.empty(0, dtype=dtype)
                    yield name, tensor.reshape(entry["shape"])
        except OSError as exc:
            raise ModelFileError(path, f"cannot read ({exc.strerror or exc})") from None


def safetensors_readers(files: list[Path]) -> dict[str, Callable[[], torch.Tensor]]:
    """Name -> a function that reads that one tensor (headers checked now), for callers that need tensors in their
    own order rather than file order (calibrated quantization reads a layer at a time)."""
    readers = {}
    for path in files:
        try:
            with open(path, "rb") as f:
                data_start, header = read_safetensors_header(path, f)
        except OSError as exc:
            raise ModelFileError(path, f"cannot read ({exc.strerror or exc})") from None
        for name, entry in header.items():
            readers[name] = tensor_reader(path, data_start, entry)
    return readers


def tensor_reader(path: Path, data_start: int, entry: dict) -> Callable[[], torch.Tensor]:
    def read() -> torch.Tensor:
        begin, end = entry["data_offsets"]
        buf = bytearray(end - begin)
        try:
            with open(path, "rb") as f:
                f.seek(data_start + begin)
                if f.readinto(buf) != len(buf):
                    raise ModelFileError(path, "file ended early (truncated?)")
        except OSError as exc:
            raise ModelFileError(path, f"cannot read ({exc.strerror or exc})") from None
        dtype = entry["torch_dtype"]
        return (torch.frombuffer(buf, dtype=dtype) if buf else torch.empty(0, dtype=dtype)).reshape(entry["shape"])
    return read


def load_hf_weights(model: torch.nn.Module, folder: Path) -> LoadReport:
    return load_tensors(model, iter_safetensors(safetensors_files(folder)), folder)


def current_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
