"""What the C layer stack (llmd.model.cpu_stack) saves at decode, on a model file as the user runs it. Prints figures.

    python tests/benchmarks/bench_cpu_stack.py FILE [--threads 2] [--steps 24] [--prompt 64]

Decode steps at batch 1 (the LM head, the greedy pick and the forward, as a served step makes them) after a --prompt
token prefill, fp16 KV (the CPU default) in two groups where the model mixes window and global layers, as the engine
keeps it: the model's modules and the stack called in turn on one sequence's cache, so a drift in a shared machine's
load falls on both. Best and median ms per step of each, and the median ratio over the pairs of steps.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_driver import paged_kv  # noqa: E402


@torch.inference_mode()
def main(argv=None) -> None:
    from llmd.model.cpu_stack import CompiledCpuForward
    from llmd.model.loader import load_model
    from llmd.model.ops import greedy_tokens

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--prompt", type=int, default=64)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_model(args.file).model
    stack = CompiledCpuForward.try_build(model)
    if stack is None:
        print("the C layer stack does not apply to this model here: nothing to compare")
        return
    n = args.prompt
    kv, build = paged_kv(model, 1, n + 2 * args.steps + 3, kv_cache_dtype="fp16", kv_groups=True)
    last = stack(torch.randint(0, model.config.vocab_size, (n,)), torch.arange(n), kv, build([n], [n]))[-1:]
    times: dict[str, list[float]] = {"modules": [], "stack": []}
    for step in range(args.steps + 1):  # the first pair untimed
        for name, forward in (("modules", model), ("stack", stack)):
            t = time.perf_counter()
            ids = greedy_tokens(model.compute_logits(last))
            n += 1
            last = forward(ids, torch.tensor([n - 1]), kv, build([1], [n]))
            if step:
                times[name].append(time.perf_counter() - t)
    print(f"{Path(args.file).name}: {args.threads} thread(s), {args.steps} decode steps each after {args.prompt} "
          f"tokens, fp16 KV")
    for name, ts in times.items():
        best, median = min(ts), statistics.median(ts)
        print(f"  {name:8s} best {best * 1e3:7.1f} ms ({1 / best:6.2f} tok/s)   median {median * 1e3:7.1f} ms "
              f"({1 / median:6.2f} tok/s)")
    ratio = statistics.median(a / b for a, b in zip(times["modules"], times["stack"]))
    print(f"  modules / stack, median over the pairs of steps: {ratio:.3f}")


if __name__ == "__main__":
    main()
