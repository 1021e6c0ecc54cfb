"""One MoE layer's packed experts on the CPU at Qwen3-30B-A3B's shapes: the Python grouping (Experts.grouped: per
expert hit a GGUFKernel for gate/up, the C SiLU * up and a GGUFKernel for down) vs the one C call (llmd.kernels.cpu_moe).

    python tests/benchmarks/bench_cpu_moe.py [--threads 2] [--tokens 1,4] [--types Q4_K,Q4_K,Q6_K] [--steps 40]

Shapes: hidden 2048, expert intermediate 768, 128 experts, top 8 (gate, up and down of the given types, Q4_K_M's by
default). Each step routes its tokens to fresh random experts (8 distinct per token), as a decode step does, so the
experts' weights (~390 MB) come from memory as they would; prints ms per layer (median and best over the steps, after
a few warm-up steps; the paths take turns) for each path, on the default int8 activation path. Weights are random codes: speed does not depend on
their values. Both paths give the same bits (tests/test_kernels_cpu_moe.py); this is checked on the first step too.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: the random blocks of test_gguf_blocks

from test_gguf_blocks import random_blocks  # noqa: E402

from llmd.model.config import MoEConfig  # noqa: E402
from llmd.model.moe import Experts  # noqa: E402
from llmd.model.ops import CPU_OPS  # noqa: E402
from llmd.model.quant.gguf_experts import GGUFExpertLinear  # noqa: E402

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8


def packed(k: int, parts: list[tuple[int, str]], seed: int) -> GGUFExpertLinear:
    layer = GGUFExpertLinear(EXPERTS, k, parts)
    for i, (part, (n, type_name)) in enumerate(zip(layer.parts, parts)):
        blocks = random_blocks(type_name, EXPERTS * n, k, seed=seed + i, scale=0.002)
        part.qweight.copy_(torch.from_numpy(blocks).view(part.qweight.shape))
    return layer


def layer(types: list[str]) -> Experts:
    experts = Experts(HIDDEN, MoEConfig(num_experts=EXPERTS, top_k=TOP_K, intermediate_size=INTER))
    experts.gate_up_proj = packed(HIDDEN, [(INTER, types[0]), (INTER, types[1])], 0)
    experts.down_proj = packed(INTER, [(HIDDEN, types[2])], 2)
    experts.ops = CPU_OPS
    experts.prepare(torch.device("cpu"), torch.float32)
    if experts.kernel is None:
        raise SystemExit("the compiled kernels are unavailable here")
    return experts


def routing(tokens: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(tokens)])
    return ids, torch.softmax(torch.randn(tokens, TOP_K, generator=g), dim=-1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", default="1,4")
    ap.add_argument("--types", default="Q4_K,Q4_K,Q6_K", help="gate, up and down")
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    types = args.types.split(",")
    experts = layer(types)
    print(f"hidden {HIDDEN}, expert {INTER}, {EXPERTS} experts, top {TOP_K}, {'/'.join(types)}, "
          f"activations {experts.kernel.acts[0]}, {args.threads} threads")
    for tokens in map(int, args.tokens.split(",")):
        g = torch.Generator().manual_seed(tokens)
        x = torch.randn(tokens, HIDDEN, generator=g)
        steps = [routing(tokens, g) for _ in range(args.steps)]
        ids, w = steps[0]
        assert torch.equal(experts.grouped(x, ids, w), experts.kernel(x, ids, w))
        times: dict[str, list[float]] = {"python": [], "compiled": []}
        paths = {"python": experts.grouped, "compiled": experts.kernel}
        for name, fn in paths.items():
            for ids, w in steps[:4]:  # warm-up
                fn(x, ids, w)
        for ids, w in steps:  # the paths take turns, so both see the same load on a shared machine
            for name, fn in paths.items():
                t = time.perf_counter()
                fn(x, ids, w)
                times[name].append((time.perf_counter() - t) * 1e3)
        py, c = statistics.median(times["python"]), statistics.median(times["compiled"])
        print(f"T={tokens}: python {py:.2f} ms/layer (best {min(times['python']):.2f}), compiled {c:.2f} ms/layer "
              f"(best {min(times['compiled']):.2f}): {py / c:.2f}x")


if __name__ == "__main__":
    main()
