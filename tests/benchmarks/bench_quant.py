"""CPU decode speed of each quantization mode on SmolLM2-135M (batch 1 and 16), next to llama.cpp on the same GGUF.

    python tests/benchmarks/bench_quant.py [MODEL] [--modes none,int8,int4-g32,gguf] [--batches 1,16] [--steps 16]
        [--threads N]

Both sides decode the same random prompts greedily for the same number of steps with the same thread count, and only
the decode steps are timed. llama.cpp runs the GGUF's own quantization; its row is the anchor of the ratio columns.
It is optional (`make bench-anchor`); without it the llmd rows still print.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llamacpp_anchor  # noqa: E402
from decode_driver import decode_tokens_per_second  # noqa: E402


def llama_cpp_row(path: Path, batches, prompt_len: int, steps: int) -> tuple[list[float], str] | None:
    """llama.cpp's decode tok/s per batch size on the prompts decode_driver gives llmd, and its table row."""
    anchor = llamacpp_anchor.load(path, torch.get_num_threads())
    if anchor is None:
        return None
    try:
        print(f"llama.cpp build: {anchor.cpu_features()}")
        rates = [anchor.generate(llamacpp_anchor.same_prompts(anchor.n_vocab, b, prompt_len), steps, warmup=2)
                 .decode_tok_s for b in batches]
        row = f"{'llama.cpp':10} {anchor.weight_bytes() / 2**20:7.0f}MiB " + " ".join(f"{r:12.1f}" for r in rates)
        return rates, row + "   (runs the GGUF's own quantization; the anchor)"
    finally:
        anchor.close()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?")
    parser.add_argument("--modes", default="none,int8,int4-g32,int4-g64,gguf")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for both (default: torch's choice)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
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
    anchor = llama_cpp_row(path, batches, args.prompt_len, args.steps) if path.suffix == ".gguf" else None
    if anchor is None:
        print(llamacpp_anchor.MISSING if path.suffix == ".gguf" else "llama.cpp: needs a .gguf model, no anchor")
    print(f"{'mode':10} {'weights':>9} " + " ".join(f"{'b=' + str(b) + ' tok/s':>12}" for b in batches)
          + ("".join(f" {'b=' + str(b) + ' llmd/l.cpp':>15}" for b in batches) if anchor else ""))
    if anchor:
        print(anchor[1], flush=True)
    for mode in args.modes.split(","):
        loaded = load_model(path, quant=mode)
        rates = [decode_tokens_per_second(loaded.model, b, args.prompt_len, args.steps) for b in batches]
        ratios = "".join(f" {r / a:14.2f}x" for r, a in zip(rates, anchor[0])) if anchor else ""
        print(f"{mode:10} {loaded.report.weight_bytes / 2**20:7.0f}MiB " + " ".join(f"{r:12.1f}" for r in rates)
              + ratios, flush=True)
        del loaded


if __name__ == "__main__":
    main()
