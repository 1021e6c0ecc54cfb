"""A cache of quantized checkpoints in the XDG cache (`llmd.config.cache_dir()/quantized`), so the second start of a
model with --quant int8 / int4 reads packed weights instead of quantizing again.

An entry holds the model that `LoadPipeline.run()` (llmd.model.loader) makes, head tied and weights laid out for the
device, and is one safetensors file named by the identity of the source files (resolved path, size, mtime), the mode,
the dtype, the device type (the CPU holds fp linears transposed), whether the head is quantized, the calibration
(method + text, for int4) and the llmd version; a changed source, calibration or llmd misses and rebuilds.
Entries are written to a temporary name and renamed, carry a CRC32 per tensor, and are read tensor by tensor into
the pipeline's empty model, so loading never holds more than the quantized model plus one tensor. An unreadable
or damaged entry is logged, deleted and rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import time
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from .. import __version__
from ..config import cache_dir
from ..errors import ModelFileError
from .calibrate import CALIBRATION
from .quant import QuantizedLinear, QuantSpec
from .weights import LoadReport, current_rss_bytes, iter_safetensors, peak_rss_bytes

if TYPE_CHECKING:
    from .loader import LoadPipeline

log = logging.getLogger(__name__)

CACHED_METHODS = ("int8", "int4")  # llmd's own quantizers; GGUF blocks and bitsandbytes need no cache
_ST_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int8: "I8",
             torch.uint8: "U8", torch.int32: "I32", torch.int64: "I64"}


def quant_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/llmd/quantized`; LLMD_QUANT_CACHE_DIR overrides it (the test suite points it at a temp dir)."""
    override = os.environ.get("LLMD_QUANT_CACHE_DIR", "")
    return Path(override) if override else cache_dir() / "quantized"


def entry_path(sources: list[Path], spec: QuantSpec, dtype: torch.dtype, device: torch.device,
               quantize_head: bool) -> Path:
    """The cache file for these source files and settings (the name changes whenever any of them does)."""
    resolved = [Path(p).resolve() for p in sources]
    identity = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in resolved]
    key = json.dumps({"files": identity, "mode": spec.label, "dtype": str(dtype), "device": device.type,
                      "head": quantize_head,
                      "calibration": CALIBRATION if spec.calibrate else None, "llmd": __version__,
                      "layout": "fused"})  # q/k/v and gate/up as one layer each
    where = hashlib.sha256(str(resolved[0]).encode()).hexdigest()[:16]
    return quant_cache_dir() / f"{where}-{spec.label}-{hashlib.sha256(key.encode()).hexdigest()[:24]}.safetensors"


def cached_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """What an entry holds: every parameter plus the packed buffers of quantized layers (not rope tables etc.)."""
    state = dict(model.named_parameters())
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            for buf_name in ("qweight", "scales", "zeros"):
                buf = getattr(module, buf_name, None)
                if buf is not None:
                    state[f"{name}.{buf_name}"] = buf
    return state


def write_entry(path: Path, model: nn.Module) -> None:
    """Write the model's quantized state as safetensors (tensor by tensor, then an atomic rename)."""
    state = cached_state(model)
    header, offset, crcs = {}, 0, {}
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(b"\0" * 8)  # header length, patched once the CRCs are known
            placeholder = None
            for name, t in state.items():
                data = t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes() if t.numel() else b""
                crcs[name] = zlib.crc32(data)
                if placeholder is None:  # the header goes first: reserve room for it, CRCs included
                    meta = {"llmd": __version__, "crc32": json.dumps({n: 0xFFFFFFFF for n in state})}
                    placeholder = len(json.dumps({"__metadata__": meta, **header}).encode()) + 64
                    placeholder += (-placeholder) % 8
                    f.write(b" " * placeholder)
                f.write(data)
            body = json.dumps({"__metadata__": {"llmd": __version__, "crc32": json.dumps(crcs)}, **header}).encode()
            f.seek(0)
            f.write(struct.pack("<Q", placeholder))
            f.write(body.ljust(placeholder, b" "))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    # older entries for the same source and mode (a changed file, another llmd) are dead weight
    prefix = path.name.rsplit("-", 1)[0] + "-"
    for old in path.parent.glob(prefix + "*.safetensors"):
        if old != path:
            old.unlink(missing_ok=True)


def read_entry(path: Path, model: nn.Module) -> int:
    """Fill the empty model from an entry; every expected tensor exactly once, shapes, dtypes and CRCs checked."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > 100 * 2**20:
            raise ModelFileError(path, "header too large")
        try:
            crcs = json.loads(json.loads(f.read(length))["__metadata__"]["crc32"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ModelFileError(path, f"bad header ({exc})") from None
    want = cached_state(model)
    for name, tensor in iter_safetensors([path]):
        target = want.pop(name, None)
        if target is None or tuple(target.shape) != tuple(tensor.shape) or target.dtype != tensor.dtype:
            raise ModelFileError(path, f"tensor {name!r} does not fit this model")
        if zlib.crc32(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"") != crcs.get(name):
            raise ModelFileError(path, f"tensor {name!r}: checksum mismatch")
        target.data.copy_(tensor)
    if want:
        raise ModelFileError(path, f"{len(want)} tensors missing (e.g. {sorted(want)[0]})")
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            module.unprepare()
    return len(crcs)


def cached(pipeline: LoadPipeline) -> tuple[nn.Module, LoadReport]:
    """The pipeline's model: read from its cache entry into `pipeline.empty()`, else made by `pipeline.run()`, after
    which the entry is written. Modes other than int8/int4 just run the pipeline."""
    spec = pipeline.spec
    if spec.method not in CACHED_METHODS:
        return pipeline.run()
    path = entry_path(pipeline.source.files, spec, pipeline.dtype, pipeline.device, pipeline.quantize_head)
    if path.is_file():
        start = time.perf_counter()
        model = pipeline.empty()
        try:
            count = read_entry(path, model)
        except (ModelFileError, OSError, struct.error) as exc:
            log.warning("ignoring a damaged quantized-weight cache entry %s (%s); quantizing again", path, exc)
            path.unlink(missing_ok=True)
            del model
        else:
            log.info("read quantized weights from the cache (%s)", path)
            pipeline.prepare(model)
            weight_bytes = sum(t.numel() * t.element_size() for t in cached_state(model).values())
            return model, LoadReport(time.perf_counter() - start, count, weight_bytes, current_rss_bytes(),
                                     peak_rss_bytes())
    model, report = pipeline.run()
    try:
        write_entry(path, model)
    except OSError as exc:  # a full or read-only cache must not stop the model from loading
        log.warning("could not write the quantized-weight cache %s (%s)", path, exc)
    return model, report
