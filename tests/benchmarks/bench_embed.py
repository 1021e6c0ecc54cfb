"""Embedding throughput: llmd's engine against transformers, side by side in one run, on the bundled SmolLM2.

For 1, 32 and 256 inputs of 128 tokens each, prints embeddings/s and tokens/s of both (wall and per CPU second,
steadier on a shared machine) and their ratio. llmd runs the inputs as prefill-only sequences through its scheduler
(the default CPU token budget, 512 per step); transformers runs AutoModel on batches of `--hf-batch` inputs and
mean-pools its last hidden state. Both fp32; `--quant` picks llmd's weight format (none: the same fp32 weights).

    python tests/benchmarks/bench_embed.py [--sizes 1,32,256] [--quant none] [--threads N]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from conftest import bundled_smollm2_path  # noqa: E402

from llmd.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from llmd.engine.types import EmbedParams  # noqa: E402
from llmd.model.loader import load_model  # noqa: E402

TOKENS = 128


def llmd_embed(engine: Engine, prompts: list[list[int]]) -> list[list[float]]:
    for i, ids in enumerate(prompts):
        engine.add_request(f"b{i}", ids, SamplingParams(), embed=EmbedParams())
    out: dict[str, list[float]] = {}
    while len(out) < len(prompts):
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o.embedding
    return [out[f"b{i}"] for i in range(len(prompts))]


@torch.inference_mode()
def hf_embed(model, prompts: list[list[int]], batch: int) -> torch.Tensor:
    vecs = []
    for i in range(0, len(prompts), batch):
        hidden = model(torch.tensor(prompts[i : i + batch])).last_hidden_state
        vecs.append(F.normalize(hidden.mean(1), dim=-1))
    return torch.cat(vecs)


def timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1,32,256")
    ap.add_argument("--quant", default="none")
    ap.add_argument("--hf-batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModel

    path = bundled_smollm2_path()
    loaded = load_model(path, dtype=torch.float32, device="cpu", quant=args.quant)
    engine = Engine(loaded, EngineConfig())
    ref = AutoModel.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    rng = random.Random(0)
    print(f"SmolLM2-135M, {TOKENS} tokens per input, llmd --quant {args.quant} (budget "
          f"{engine.config.max_num_batched_tokens} tokens/step), transformers batch {args.hf_batch}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'inputs':>6} | {'llmd emb/s':>10} {'tok/s':>8} {'tok/cpu-s':>9} | {'hf emb/s':>9} {'tok/s':>8} "
          f"{'tok/cpu-s':>9} | {'llmd/hf':>7} {'min cos':>8}")
    llmd_embed(engine, [[rng.randrange(5, 49152) for _ in range(TOKENS)]])  # warm-up
    hf_embed(ref, [[rng.randrange(5, 49152) for _ in range(TOKENS)]], 1)
    for n in map(int, args.sizes.split(",")):
        prompts = [[rng.randrange(5, 49152) for _ in range(TOKENS)] for _ in range(n)]
        ours, w1, c1 = timed(lambda: llmd_embed(engine, prompts))
        theirs, w2, c2 = timed(lambda: hf_embed(ref, prompts, args.hf_batch))
        cos = F.cosine_similarity(torch.tensor(ours), theirs, dim=-1).min().item()
        toks = n * TOKENS
        print(f"{n:>6} | {n / w1:>10.2f} {toks / w1:>8.0f} {toks / c1:>9.0f} | {n / w2:>9.2f} {toks / w2:>8.0f} "
              f"{toks / c2:>9.0f} | {w2 / w1:>7.2f} {cos:>8.5f}")
    engine.check_no_leaks()


if __name__ == "__main__":
    main()
