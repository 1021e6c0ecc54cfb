"""Qwen3.5's MTP head as the draft, on a tiny random-weight Qwen3.5 (tests/tiny_models.py, fp32 on CPU): MTP off vs
on at batch 1 and 4. Prints figures; asserts nothing.

    .venv/bin/python tests/benchmarks/bench_mtp.py [--new-tokens 64] [--k 1,3] [--batches 1,4] [--rounds 2]

Modes: off; `mtp k=N` (speculative_mode draft, draft_model mtp: N guesses every step); `auto` (no draft named: the
model's head, with the adaptive policy of llmd.engine.spec_policy, prompt lookup first).

Two heads: `random` (random mtp.* weights: its guesses are as good as chance over a 600-token vocabulary, so
nearly nothing is accepted) and `4-token` (the same model whose output head tells only four tokens apart, so a
random guess is right about a time in four: what the bookkeeping costs and earns at a middling acceptance). A tiny
model's step is mostly fixed overhead, which one more small forward per guess adds to: the tok/s ratio here says
nothing of a real Qwen3.5's, whose weights could not be downloaded here; the greedy output is checked equal.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from llmd.engine import Engine, EngineConfig, SamplingParams, generate  # noqa: E402
from llmd.model.loader import load_model  # noqa: E402
from tiny_models import add_mtp_head, write_tiny_model  # noqa: E402


def four_token_head(folder: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    head = tensors["lm_head.weight"]
    kept = torch.zeros(head.shape[0], dtype=torch.bool)
    kept[[100, 200, 300, 400]] = True
    head[~kept] = 0
    head[kept] *= 4
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def run(loaded, prompts, new_tokens: int, **spec) -> dict:
    engine = Engine(loaded, EngineConfig(num_kv_blocks=512, max_num_batched_tokens=256, **spec))
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    results = generate(engine, prompts, params)
    t = [r.timings for r in results]
    span = max(x.finished for x in t) - min(x.first_token for x in t)
    stats = engine.stats().spec
    return {"tps": sum(x.num_generated_tokens - 1 for x in t) / span, "tokens": [r.token_ids for r in results],
            "acc": stats.acceptance_rate if stats else None, "len": stats.mean_accepted_length if stats else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--k", default="1,3", help="comma list of guesses per step")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--rounds", type=int, default=2, help="off/on runs interleaved; best tok/s is kept")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix="bench_mtp_"))
    models = {}
    for name in ("random", "4-token"):
        folder = write_tiny_model(root / name, "qwen3_5")
        add_mtp_head(folder)
        if name == "4-token":
            four_token_head(folder)
        models[name] = load_model(folder, dtype=torch.float32, device="cpu")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 570, (40,), generator=g).tolist() for _ in range(max(map(int, args.batches.split(","))))]
    print(f"tiny Qwen3.5 (4 layers, hidden 64) fp32 CPU, {args.threads} thread(s), greedy, {args.new_tokens} new "
          f"tokens, 40-token prompts, best of {args.rounds} interleaved round(s)")
    print(f"{'head':8} {'batch':>5} {'mode':8} {'tok/s':>8} {'accept':>7} {'acc/verify':>10} {'vs off':>7} same")
    modes = {"off": {}} | {f"mtp k={k}": dict(speculative_mode="draft", draft_model="mtp", num_speculative_tokens=int(k))
                           for k in args.k.split(",")} | {"auto": dict(speculative_mode="auto")}  # the head, adaptive
    for name, loaded in models.items():
        run(loaded, prompts[:1], 4)  # warm-up
        for batch in map(int, args.batches.split(",")):
            best: dict = {}
            for _ in range(args.rounds):
                for mode, spec in modes.items():
                    r = run(loaded, prompts[:batch], args.new_tokens, **spec)
                    if mode not in best or r["tps"] > best[mode]["tps"]:
                        best[mode] = r
            for mode, r in best.items():
                acc = "-" if r["acc"] is None else f"{r['acc']:.0%}"
                mlen = "-" if r["len"] is None else f"{r['len']:.2f}"
                same = "yes" if r["tokens"] == best["off"]["tokens"] else "NO"
                print(f"{name:8} {batch:5d} {mode:8} {r['tps']:8.1f} {acc:>7} {mlen:>10} "
                      f"{r['tps'] / best['off']['tps']:6.2f}x {same}", flush=True)


if __name__ == "__main__":
    main()
