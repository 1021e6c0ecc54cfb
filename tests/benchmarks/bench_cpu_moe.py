"""One MoE layer's packed experts on the CPU at a real model's expert shapes: the Python grouping (Experts.grouped:
per expert hit a GGUFKernel for gate/up, the C activation and a GGUFKernel for down) vs the one C call
(llmd.kernels.cpu_moe).

    python tests/benchmarks/bench_cpu_moe.py [--shape qwen3-30b-a3b] [--threads 2] [--tokens 1,4] [--types ...]
        [--steps 40]

Shapes (--shape): qwen3-30b-a3b, hidden 2048, expert intermediate 768, 128 experts, top 8, Q4_K_M's types (gate, up
and down: Q4_K, Q4_K, Q6_K) by default; gpt-oss-20b, hidden 2880, expert intermediate 2880, 32 experts, top 4, MXFP4,
with biases on both projections and the clamped SwiGLU. Each step routes its tokens to fresh random experts (distinct
per token), as a decode step does, so the experts' weights (~390 / ~420 MB) come from memory as they would; prints ms
per layer (median and best over the steps, after a few warm-up steps; the paths take turns) for each path, on the
default int8 activation path. Weights are random codes: speed does not depend on their values. Both paths give the
same bits (tests/test_kernels_cpu_moe.py); this is checked on the first step too.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: the random blocks of test_gguf_blocks

from test_gguf_blocks import random_blocks  # noqa: E402

from llmd.model.config import MoEConfig  # noqa: E402
from llmd.model.moe import Experts  # noqa: E402
from llmd.model.ops import CPU_OPS  # noqa: E402
from llmd.model.quant.gguf_experts import GGUFExpertLinear  # noqa: E402


@dataclass(frozen=True)
class Shape:
    hidden: int
    inter: int
    experts: int
    top_k: int
    types: str  # gate, up, down
    gpt_oss: bool = False  # biases on both projections, the clamped SwiGLU


SHAPES = {"qwen3-30b-a3b": Shape(2048, 768, 128, 8, "Q4_K,Q4_K,Q6_K"),
          "gpt-oss-20b": Shape(2880, 2880, 32, 4, "MXFP4,MXFP4,MXFP4", gpt_oss=True)}


def packed(shape: Shape, k: int, parts: list[tuple[int, str]], seed: int) -> GGUFExpertLinear:
    layer = GGUFExpertLinear(shape.experts, k, parts, bias=shape.gpt_oss)
    for i, (part, (n, type_name)) in enumerate(zip(layer.parts, parts)):
        blocks = random_blocks(type_name, shape.experts * n, k, seed=seed + i, scale=0.002)
        part.qweight.copy_(torch.from_numpy(blocks).view(part.qweight.shape))
    if layer.bias is not None:
        layer.bias.copy_(torch.randn(layer.bias.shape, generator=torch.Generator().manual_seed(seed)) * 0.01)
    return layer


def layer(shape: Shape, types: list[str]) -> Experts:
    activation = "swiglu_clamped" if shape.gpt_oss else "silu"
    moe = MoEConfig(num_experts=shape.experts, top_k=shape.top_k, intermediate_size=shape.inter, activation=activation)
    experts = Experts(shape.hidden, moe, bias=shape.gpt_oss)
    experts.gate_up_proj = packed(shape, shape.hidden, [(shape.inter, types[0]), (shape.inter, types[1])], 0)
    experts.down_proj = packed(shape, shape.inter, [(shape.hidden, types[2])], 2)
    experts.ops = CPU_OPS
    experts.prepare(torch.device("cpu"), torch.float32)
    if experts.kernel is None:
        raise SystemExit("the compiled kernels are unavailable here")
    return experts


def routing(shape: Shape, tokens: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randperm(shape.experts, generator=g)[:shape.top_k] for _ in range(tokens)])
    return ids, torch.softmax(torch.randn(tokens, shape.top_k, generator=g), dim=-1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=list(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", default="1,4")
    ap.add_argument("--types", help="gate, up and down (default: the shape's)")
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shape = SHAPES[args.shape]
    types = (args.types or shape.types).split(",")
    experts = layer(shape, types)
    print(f"{args.shape}: hidden {shape.hidden}, expert {shape.inter}, {shape.experts} experts, top {shape.top_k}, "
          f"{'/'.join(types)}, {experts.moe.activation}{', biases' if shape.gpt_oss else ''}, "
          f"activations {experts.kernel.acts[0]}, {args.threads} threads")
    for tokens in map(int, args.tokens.split(",")):
        g = torch.Generator().manual_seed(tokens)
        x = torch.randn(tokens, shape.hidden, generator=g)
        steps = [routing(shape, tokens, g) for _ in range(args.steps)]
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
