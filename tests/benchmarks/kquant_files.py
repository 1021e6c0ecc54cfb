"""K-quant GGUF files for the benchmarks, made from the bundled SmolLM2 GGUF by llama.cpp's own quantizer.

    path = kquant_files.requantized("Q4_K_M")   # cached in $XDG_CACHE_HOME/llmd/bench-gguf/, made once (seconds)

The bundled file is Q4_1, so its weights are re-quantized from those values (allow_requantize): the file has
llama.cpp's real tensor mix for the type (SmolLM2's 576-wide rows are not whole 256-element super-blocks, so there,
as in Gemma 3's 640-wide rows, llama.cpp falls back to Q5_0 / Q8_0 / IQ4_NL; ffn_down's 1536-wide rows get the
K-quant). Needs llama-cpp-python (`make bench-anchor`); returns None without it.
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

FTYPES = ("Q4_K_M", "Q4_K_S", "Q5_K_M", "Q6_K", "Q3_K_M", "Q2_K", "IQ4_XS", "IQ4_NL", "Q5_0", "Q8_0")


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "llmd" / "bench-gguf"


def requantized(ftype: str, source: Path | None = None) -> Path | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    if source is None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from conftest import bundled_smollm2_path

        source = bundled_smollm2_path()
    out = cache_dir() / f"{source.stem.split('.')[0]}.{ftype}.gguf"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.allow_requantize = True
    params.nthread = os.cpu_count() or 1
    tmp = out.with_suffix(".tmp")
    rc = llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama.cpp could not quantize {source} to {ftype} (rc {rc})")
    tmp.replace(out)
    return out


if __name__ == "__main__":
    for name in sys.argv[1:] or ["Q4_K_M"]:
        print(requantized(name))
