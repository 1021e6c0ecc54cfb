"""What a model is, read from headers only (config.json, safetensors headers, GGUF metadata): never the weights."""

from __future__ import annotations

import collections
import json
import math
import struct
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..errors import ModelFileError
from ..model.pooling import is_embedding_folder, is_embedding_gguf
from .files import ModelFiles

MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024  # the format's own limit

# safetensors dtype -> the short name users know
_ST_DTYPES = {"F32": "fp32", "F16": "fp16", "BF16": "bf16", "F64": "fp64", "I8": "int8", "U8": "uint8",
              "I32": "int32", "I64": "int64", "F8_E4M3": "fp8", "F8_E5M2": "fp8", "BOOL": "bool"}


@dataclass
class ModelInfo:
    files: ModelFiles
    architecture: str | None = None
    parameters: int | None = None
    dtype: str | None = None  # the weights' storage type(s), e.g. "bf16" or "Q4_1 (+F32)"
    quantization: str | None = None  # None when the weights are plain floats
    context_length: int | None = None
    chat_template: bool = False
    embedding: bool = False  # an embedding model (its files declare a pooling), not a chat or completion one
    file_sizes: list[tuple[str, int]] = field(default_factory=list)  # (path relative to the model, bytes)

    @property
    def size_bytes(self) -> int:
        return sum(size for _, size in self.file_sizes)


def describe(files: ModelFiles) -> ModelInfo:
    return _describe_gguf(files) if files.kind == "gguf" else _describe_hf(files)


_GGUF_FACTS: dict[tuple, ModelInfo] = {}  # (real path, size, mtime) -> what the header said; listings re-read none
MAX_GGUF_FACTS = 256
_facts_lock = threading.Lock()


def _describe_gguf(files: ModelFiles) -> ModelInfo:
    """A GGUF header holds the whole vocabulary (tenths of a second to parse): each file is read once while it is
    unchanged."""
    real = files.path.resolve()
    try:
        st = real.stat()
    except OSError as exc:
        raise ModelFileError(files.path, f"cannot read: {exc.strerror}") from None
    key = (str(real), st.st_size, st.st_mtime_ns)
    with _facts_lock:
        known = _GGUF_FACTS.get(key)
    if known is None:
        known = _read_gguf(files)
        with _facts_lock:
            if len(_GGUF_FACTS) >= MAX_GGUF_FACTS:
                _GGUF_FACTS.pop(next(iter(_GGUF_FACTS)))
            _GGUF_FACTS[key] = known
    return replace(known, files=files, file_sizes=list(known.file_sizes))


def human_size(n: float | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # pragma: no cover


def human_count(n: int | None) -> str:
    if n is None:
        return "?"
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    if n >= 1e6:
        return f"{n / 1e6:.1f}M"
    return f"{n / 1e3:.1f}K" if n >= 1e3 else str(n)


# --- Hugging Face folders ---


def _describe_hf(files: ModelFiles) -> ModelInfo:
    folder = files.path
    config = _read_json(folder / "config.json")
    info = ModelInfo(files=files)
    archs = config.get("architectures") or []
    info.architecture = archs[0] if archs and isinstance(archs[0], str) else config.get("model_type")
    info.context_length = config.get("max_position_embeddings")
    quant = config.get("quantization_config")
    if isinstance(quant, dict):
        method = quant.get("quant_method", "quantized")
        bits = quant.get("bits") or ("4" if quant.get("load_in_4bit") else "8" if quant.get("load_in_8bit") else None)
        info.quantization = f"{method} {bits}-bit" if bits else str(method)

    params, dtypes = 0, collections.Counter[str]()
    for shard in sorted(folder.glob("*.safetensors")):
        for dtype, shape in _safetensors_tensors(shard):
            count = math.prod(shape)
            params += count
            dtypes[_ST_DTYPES.get(dtype, dtype.lower())] += count
    info.parameters = params or None
    info.dtype = _dtype_label(dtypes) or config.get("torch_dtype") or config.get("dtype")

    tok_config = folder / "tokenizer_config.json"
    has_template = (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file()
    if not has_template and tok_config.is_file():
        has_template = bool(_read_json(tok_config).get("chat_template"))
    info.chat_template = has_template
    info.embedding = is_embedding_folder(folder)
    info.file_sizes = [(str(p.relative_to(folder)), p.stat().st_size)
                       for p in sorted(folder.rglob("*")) if p.is_file()]
    return info


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelFileError(path, "missing") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ModelFileError(path, f"not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ModelFileError(path, "expected a JSON object")
    return data


def _safetensors_tensors(path: Path):
    """(dtype, shape) of every tensor, from the JSON header; every length is checked against the file first."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise ModelFileError(path, "truncated safetensors file (no header length)")
            (length,) = struct.unpack("<Q", head)
            if length > MAX_SAFETENSORS_HEADER or 8 + length > size:
                raise ModelFileError(path, f"bad safetensors header length {length} for a {size}-byte file")
            header = json.loads(fh.read(length))
    except OSError as exc:
        raise ModelFileError(path, f"cannot read: {exc.strerror}") from None
    except (ValueError, UnicodeDecodeError):
        raise ModelFileError(path, "safetensors header is not valid JSON") from None
    if not isinstance(header, dict):
        raise ModelFileError(path, "safetensors header is not a JSON object")
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict) or not isinstance(entry.get("shape"), list):
            raise ModelFileError(path, f"tensor {name!r} has no shape in the header")
        yield str(entry.get("dtype", "?")), [int(d) for d in entry["shape"]]


def _dtype_label(counts: collections.Counter) -> str | None:
    """The dominant storage type, with the others in parentheses."""
    if not counts:
        return None
    ordered = [name for name, _ in counts.most_common()]
    return ordered[0] + (f" (+{', '.join(ordered[1:])})" if len(ordered) > 1 else "")


# --- GGUF files ---


def _read_gguf(files: ModelFiles) -> ModelInfo:
    from ..model import gguf as gguf_reader  # metadata and tensor table, both checked against the file size

    header = gguf_reader._GGUFFile(files.path)
    meta, tensors = header.metadata, header.tensors
    info = ModelInfo(files=files)
    arch = meta.get("general.architecture")
    info.architecture = arch
    info.context_length = meta.get(f"{arch}.context_length") if arch else None
    info.chat_template = bool(meta.get("tokenizer.chat_template"))
    info.embedding = is_embedding_gguf(meta)
    types = collections.Counter[str]()
    params = 0
    for tensor in tensors:
        count = math.prod(tensor.shape)
        params += count
        types[tensor.type_name] += count
    info.parameters = params or None
    info.dtype = _dtype_label(types)
    main = types.most_common(1)[0][0] if types else None
    info.quantization = main if main and main not in ("F32", "F16", "BF16") else None
    info.file_sizes = [(files.path.name, files.path.stat().st_size)]
    return info
