"""K-quant GGUF files on the CPU: llmd with every tensor kept packed next to llama.cpp on the same file, one run.

    python tests/benchmarks/bench_kquant.py [FILE.gguf ...] [--types Q4_K_M,Q6_K] [--batches 1,16] [--steps 16]
        [--prefill 1000] [--threads N]

Without files, the bundled SmolLM2 GGUF is re-quantized by llama.cpp to each of --types (kquant_files.py, cached).
Per file: the file's tensor bytes and llmd's resident weight bytes (the packed blocks; target <= 1.15x), decode tok/s
at each batch size (same random prompts, greedy, only the decode steps timed) and a cold prefill of --prefill tokens
(one sequence, one forward, nothing cached), each next to llama.cpp with the ratio llmd / llama.cpp. The two engines
run in --rounds alternating rounds and each figure is the best of its rounds, so a busy moment of a shared machine
does not fall on one engine only.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kquant_files  # noqa: E402
import llamacpp_anchor  # noqa: E402
from decode_driver import decode_tokens_per_second  # noqa: E402


@torch.inference_mode()
def llmd_prefill_tok_s(model, tokens: int, block_size: int = 16) -> float:
    """One forward of a `tokens`-long prompt into an empty KV cache (after one untimed warm-up forward)."""
    from llmd.model.attention import AttentionMetadata, allocate_kv_cache

    cfg = model.config
    blocks = -(-tokens // block_size)
    kv = allocate_kv_cache(cfg.num_hidden_layers, blocks + 1, block_size, cfg.num_key_value_heads, cfg.head_dim,
                           torch.float32, "cpu")
    prompt = torch.randint(0, cfg.vocab_size, (tokens,), generator=torch.Generator().manual_seed(1))
    best = float("inf")
    for _ in range(2):
        meta = AttentionMetadata.build([tokens], [tokens], [list(range(1, blocks + 1))], block_size)
        t0 = time.perf_counter()
        hidden = model(prompt, torch.arange(tokens), kv, meta)
        model.compute_logits(hidden[-1:])
        best = min(best, time.perf_counter() - t0)
    return tokens / best


def llama_cpp_figures(anchor, batches, prompt_len, steps, prefill) -> dict:
    """One round of llama.cpp's figures on the loaded file (decode tok/s per batch size, prefill tok/s)."""
    out = {}
    for b in batches:
        out[b] = anchor.generate(llamacpp_anchor.same_prompts(anchor.n_vocab, b, prompt_len), steps,
                                 warmup=2).decode_tok_s
    prompt = llamacpp_anchor.same_prompts(anchor.n_vocab, 1, prefill)
    out["prefill"] = prefill / anchor.generate(prompt, 0).prefill_s
    return out


def llmd_figures(model, batches, prompt_len, steps, prefill) -> dict:
    out = {b: decode_tokens_per_second(model, b, prompt_len, steps) for b in batches}
    out["prefill"] = llmd_prefill_tok_s(model, prefill)
    return out


def file_bytes_by_type(path: Path) -> Counter:
    from llmd.model.gguf import _GGUFFile

    counts: Counter = Counter()
    for t in _GGUFFile(path).tensors:
        counts[t.type_name] += t.nbytes
    return counts


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*")
    parser.add_argument("--types", default="Q4_K_M,Q6_K")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--prefill", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=3, help="alternating llmd / llama.cpp rounds (best of each)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from llmd.kernels import cpu_gemm
    from llmd.model.quant import packed_weight_bytes
    from llmd.model.loader import load_model

    paths = [Path(f) for f in args.files] or [kquant_files.requantized(t) for t in args.types.split(",")]
    if any(p is None for p in paths):
        print(llamacpp_anchor.MISSING + " (it also makes the K-quant files)")
        return
    batches = [int(b) for b in args.batches.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, llmd CPU kernels: {cpu_gemm.available()} "
          f"({' '.join(cpu_gemm.simd_flags()) or 'portable'}; LLMD_CPU_ISA=avx2 matches the anchor's AVX2 build)")
    for path in paths:
        by_type = file_bytes_by_type(path)
        total = sum(by_type.values())
        print(f"\n{path.name}: tensors {total / 2**20:.1f} MiB ("
              + ", ".join(f"{k} {v / 2**20:.1f}" for k, v in by_type.most_common()) + ")")
        anchor = llamacpp_anchor.load(path, torch.get_num_threads())
        loaded = load_model(path, quant="gguf", device="cpu")
        resident = loaded.report.weight_bytes
        packed = packed_weight_bytes(loaded.model)
        print(f"  llmd resident weights {resident / 2**20:.1f} MiB = {resident / total:.3f}x the file's tensors "
              f"(packed GGUF blocks: " + ", ".join(f"{k} {v / 2**20:.1f}" for k, v in packed.items()) + ")")
        # the machine may be shared: both engines run in alternating rounds and each keeps its best figure
        ours: dict = {}
        ref: dict = {}
        for _ in range(args.rounds):
            if anchor is not None:
                for key, value in llama_cpp_figures(anchor, batches, args.prompt_len, args.steps,
                                                    args.prefill).items():
                    ref[key] = max(ref.get(key, 0.0), value)
            for key, value in llmd_figures(loaded.model, batches, args.prompt_len, args.steps, args.prefill).items():
                ours[key] = max(ours.get(key, 0.0), value)
        if anchor is not None:
            anchor.close()
        labels = [(f"decode b={b} tok/s", b) for b in batches] + [(f"prefill {args.prefill} tok/s", "prefill")]
        print(f"  {'':22} {'llmd':>9} {'llama.cpp':>10} {'ratio':>7}   (best of {args.rounds} alternating rounds)")
        for label, key in labels:
            other = ref.get(key, float("nan"))
            print(f"  {label:22} {ours[key]:9.1f} {other:10.1f} {ours[key] / other:6.2f}x", flush=True)
        del loaded


if __name__ == "__main__":
    main()
