"""CPU decode speed of each quantization mode on SmolLM2-135M (batch 1 and 16), printed as a table.

    python tests/benchmarks/bench_quant.py [MODEL] [--modes none,int8,int4-g32,gguf] [--batches 1,16] [--steps 16]

The llama.cpp anchor (llama-cpp-python) is optional: it is used when importable, and skipped otherwise.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_driver import decode_tokens_per_second  # noqa: E402


def llama_cpp_tok_s(path: Path, steps: int) -> float | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=str(path), n_ctx=256, verbose=False)
    start = time.perf_counter()
    out = llm("The river town woke slowly", max_tokens=steps, temperature=0.0)
    return out["usage"]["completion_tokens"] / (time.perf_counter() - start)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?")
    parser.add_argument("--modes", default="none,int8,int4-g32,int4-g64,gguf")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    args = parser.parse_args(argv)
    if args.model:
        path = Path(args.model)
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from conftest import bundled_smollm2_path

        path = bundled_smollm2_path()
    from llmd.model import quant
    from llmd.model.loader import load_model

    batches = [int(b) for b in args.batches.split(",")]
    print(f"model {path.name}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"CPU int8 kernel fast: {quant.cpu_kernel_is_fast('int8')}, int4: {quant.cpu_kernel_is_fast('int4')}")
    print(f"{'mode':10} {'weights':>9} " + " ".join(f"{'b=' + str(b) + ' tok/s':>12}" for b in batches))
    for mode in args.modes.split(","):
        loaded = load_model(path, quant=mode)
        rates = [decode_tokens_per_second(loaded.model, b, args.prompt_len, args.steps) for b in batches]
        print(f"{mode:10} {loaded.report.weight_bytes / 2**20:7.0f}MiB " + " ".join(f"{r:12.1f}" for r in rates),
              flush=True)
        del loaded
    anchor = llama_cpp_tok_s(path, args.steps) if path.suffix == ".gguf" else None
    print("llama.cpp: " + (f"{anchor:.1f} tok/s at batch 1" if anchor else "not installed (optional anchor)"))


if __name__ == "__main__":
    main()
