"""How a model's files say its embeddings are pooled.

- A Hugging Face folder in sentence-transformers layout lists its modules in `modules.json`; the Pooling module's
  `config.json` (usually `1_Pooling/config.json`) sets one `pooling_mode_*` switch: `lasttoken` for decoder
  embedding models such as Qwen3-Embedding, `mean_tokens`, or `cls_token`.
- A GGUF file may carry `<arch>.pooling_type` (llama.cpp's enum: 1 mean, 2 cls, 3 last).
- Anything else (a chat model) is mean-pooled, as Ollama and llama-server do.
Matryoshka models (embeddings that may be cut to fewer dimensions) say so in config.json, as vLLM reads it:
`is_matryoshka: true`, optionally with the allowed `matryoshka_dimensions`.
"""

from __future__ import annotations

import json
from pathlib import Path

DEFAULT_POOLING = "mean"
POOLING_KINDS = ("mean", "last", "cls")  # as llmd.engine.types.EmbedParams takes them
_ST_MODES = (("pooling_mode_lasttoken", "last"), ("pooling_mode_mean_tokens", "mean"), ("pooling_mode_cls_token", "cls"))
_GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}
MAX_MODULES_JSON_BYTES = 64 * 1024


def _small_json(path: Path) -> object:
    if not path.is_file() or path.stat().st_size > MAX_MODULES_JSON_BYTES:
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def hf_folder_pooling(folder: Path) -> str:
    """The pooling a sentence-transformers folder declares; DEFAULT_POOLING when it declares none."""
    modules = _small_json(folder / "modules.json")
    if not isinstance(modules, list):
        return DEFAULT_POOLING
    for module in modules:
        if not isinstance(module, dict) or not str(module.get("type", "")).endswith(".Pooling"):
            continue
        sub = (folder / str(module.get("path", ""))).resolve()
        if not sub.is_relative_to(folder.resolve()):  # a module path never leaves the model's folder
            return DEFAULT_POOLING
        cfg = _small_json(sub / "config.json")
        if isinstance(cfg, dict):
            return next((kind for key, kind in _ST_MODES if cfg.get(key) is True), DEFAULT_POOLING)
    return DEFAULT_POOLING


def is_embedding_folder(folder: Path) -> bool:
    """An embedding model: a sentence-transformers folder (its modules.json lists a Pooling module)."""
    modules = _small_json(folder / "modules.json")
    return isinstance(modules, list) and any(
        isinstance(m, dict) and str(m.get("type", "")).endswith(".Pooling") for m in modules)


def is_embedding_gguf(meta: dict) -> bool:
    """An embedding model: a GGUF file that declares its pooling (as Ollama tells embedding models apart)."""
    return f"{meta.get('general.architecture')}.pooling_type" in meta


def gguf_pooling(meta: dict) -> str:
    arch = meta.get("general.architecture")
    value = meta.get(f"{arch}.pooling_type")
    return _GGUF_POOLING.get(value, DEFAULT_POOLING) if isinstance(value, int) else DEFAULT_POOLING


def matryoshka_dimensions(cfg: dict, hidden_size: int) -> list[int] | None:
    """The sizes an embedding may be cut to (None: only the full size)."""
    if not cfg.get("is_matryoshka"):
        return None
    dims = cfg.get("matryoshka_dimensions")
    if isinstance(dims, list) and all(isinstance(d, int) and 0 < d <= hidden_size for d in dims) and dims:
        return sorted(set(dims))
    return list(range(1, hidden_size + 1))
