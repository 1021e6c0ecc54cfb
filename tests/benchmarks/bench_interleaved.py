"""The CPU integer path's GGUF matmuls in the file's layout against the interleaved one (kernels/cpu_interleaved.c),
streaming a model's worth of weights from memory, as a decode step does.

    python tests/benchmarks/bench_interleaved.py [--types Q4_0,Q4_1,Q5_0,Q5_1,Q8_0,IQ4_NL,Q2_K,..,Q6_K,IQ4_XS]
        [--rows 1,4,16] [--threads 1,2] [--hidden 2048] [--intermediate 8192] [--kv 512] [--layers 16]

Per type: one layer's q, k, v, o, gate, up and down matrices (Llama-3.2-1B's shapes by default) repeated --layers
times, each its own random blocks (so they stream from memory, not cache), called one after another with M rows on
the integer path the type's layers take (int8; Q4_1's int16). Prints the best of 4 rounds per layout: ms per pass
and GB/s of the type's bytes, and the speedup. Random codes: speed does not depend on their values.
"""

from __future__ import annotations

import argparse
import time

import torch
from llmd.kernels import cpu_gemm
from llmd.kernels import gguf_blocks as gb

SCALE_AT = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "IQ4_NL": (0,),
            "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
            "IQ4_XS": (0,)}  # fp16 scale fields set to a finite value


def blocks(type_name: str, n: int, k: int) -> torch.Tensor:
    elems, nbytes = gb.BLOCKS[type_name]
    q = torch.randint(0, 256, (n, k // elems * nbytes), dtype=torch.uint8)
    for at in SCALE_AT[type_name]:
        q.view(n, k // elems, nbytes)[:, :, at:at + 2] = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
    return q


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default="Q4_0,Q4_1,Q5_0,Q5_1,Q8_0,IQ4_NL,Q2_K,Q3_K,Q4_K,Q5_K,Q6_K,IQ4_XS")
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=8192)
    ap.add_argument("--kv", type=int, default=512)
    ap.add_argument("--layers", type=int, default=16)
    args = ap.parse_args()
    lib = cpu_gemm.load()
    if lib is None:
        raise SystemExit("the CPU kernels do not build here")
    h, i, kv = args.hidden, args.intermediate, args.kv
    shapes = [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i)]
    for type_name in args.types.split(","):
        layout = next(x8 for x8, t in gb.X8_OF.items() if t == type_name)
        act = cpu_gemm.activations(cpu_gemm.activation_kind([type_name]))
        kernels: dict[str, list] = {"file": [], "interleaved": []}
        total = 0
        for _ in range(args.layers):
            for n, k in shapes:
                q = blocks(type_name, n, k)
                total += q.numel()
                kernels["file"].append((cpu_gemm.GGUFKernel(lib, [(q, type_name)], k, act=act), k))
                kernels["interleaved"].append((cpu_gemm.GGUFKernel(lib, [(gb.x8_pack(q, layout), layout)], k,
                                                                   act=act), k))
        print(f"{type_name} ({act}): {total / 1e6:.0f} MB of blocks, {len(kernels['file'])} matmuls a pass")
        for m in map(int, args.rows.split(",")):
            for threads in map(int, args.threads.split(",")):
                xs = {k: torch.randn(m, k) for k in (h, i)}
                best = {name: float("inf") for name in kernels}
                for _ in range(4):  # alternating rounds: a busy moment does not fall on one layout only
                    for name, ks in kernels.items():
                        t0 = time.perf_counter()
                        for kernel, k in ks:
                            kernel(xs[k], threads)
                        best[name] = min(best[name], time.perf_counter() - t0)
                f, x = best["file"], best["interleaved"]
                print(f"  M={m:<3} threads={threads}: file layout {f * 1e3:7.1f} ms {total / f / 1e9:5.1f} GB/s   "
                      f"interleaved {x * 1e3:7.1f} ms {total / x / 1e9:5.1f} GB/s   {f / x:.2f}x")


if __name__ == "__main__":
    main()
