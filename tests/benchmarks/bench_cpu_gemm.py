"""CPU weight-only matmul at SmolLM2-135M shapes: fp32 vs llmd's compiled int8/int4 kernel vs torch's own kernels.

    python tests/benchmarks/bench_cpu_gemm.py [--threads 1,2] [--rows 1,4,16,64] [--budget 0.3] [--baseline DIR]
    python tests/benchmarks/bench_cpu_gemm.py --gguf [Q4_K,Q6_K,...] [--threads 1] [--rows 1,4,16,64,256,512]

For each layer shape (hidden 576, intermediate 1536, vocab 49152), row count M and thread count it prints ms per
call (best of repeated calls) and the weight bytes streamed per second (GB/s) for:
  fp32        torch x @ w_t with w_t [K, N] contiguous, as llmd stores CPU fp weights
  int8 llmd   llmd.kernels.cpu_gemm, int8 per output channel (llmd's --quant int8)
  int4 llmd   llmd.kernels.cpu_gemm, int4 group 32 (the layout GGUF Q4_1 loads into on a GPU)
  int8 q8 / int4 q8   the same weights on llmd's integer path (activations quantized to int8 per block of 32),
              called as the layers call it (a prepared per-layer kernel)
  int8 torch  torch._weight_int8pack_mm (per channel)
  int4 torch  torch._weight_int4pack_mm_for_cpu (group 32)
  int8 base / int4 base   with --baseline DIR: the fp32-activation kernels of another tree's kernel sources (every
              .c in DIR, e.g. the last commit's: git archive HEAD kernels | tar -x -C /tmp/old, DIR /tmp/old/kernels),
              built the same way, to compare a kernel change side by side in one run
With --gguf (all packed types, or a list), instead: llmd's matmul straight from GGUF blocks of each type
(llmd.kernels.cpu_gemm.GGUFKernel) at shapes whose rows are whole 256-element super-blocks, in ms and in weights per
second (Gw/s), GB/s of the type's bytes and GFLOP/s, then the same blocks on the integer path (GGUFKernel(act="int8"):
activations quantized to int8 per block of 32, as a GGUF file's layers run by default) in ms and GB/s, on the output
head's path for Q8_0 and Q6_K (act="int16": activations quantized to int16 per block of 32) in ms, and fp32 at the
same shape.
Weights are random codes: speed does not depend on their values. The first llmd call builds the kernel if needed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from llmd.kernels import cpu_gemm
from llmd.model.quant import Int4Linear, Int8Linear

SHAPES = [("attn 576x576", 576, 576), ("mlp up 1536x576", 1536, 576), ("mlp down 576x1536", 576, 1536),
          ("lm_head 49152x576", 49152, 576)]
GROUP = 32


def best_ms(fn, budget_s: float) -> float:
    fn()  # warm-up (and first-use packing)
    best, start = float("inf"), time.perf_counter()
    while True:
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
        if time.perf_counter() - start > budget_s:
            return best * 1e3


def build_baseline(folder: str):
    """Another tree's kernel sources (every .c in `folder`) compiled with the kernel's own flags, bound like it."""
    out = Path(tempfile.mkdtemp(prefix="bench_cpu_gemm_")) / "baseline.so"
    flags = cpu_gemm._BASE_FLAGS + cpu_gemm.simd_flags() + ["-fopenmp"]
    sources = sorted(map(str, Path(folder).glob("*.c")))
    subprocess.run([cpu_gemm._compiler(), *flags, f"-I{folder}", *sources, "-o", str(out), "-lm"], check=True)
    return cpu_gemm._bind(out)


def layers(n: int, k: int):
    g = torch.Generator().manual_seed(0)
    w_t = torch.randn(k, n, generator=g) * 0.02
    i8 = Int8Linear(k, n)
    i8.qweight.copy_(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g))
    i8.scales.copy_(torch.rand(n, 1, generator=g) * 1e-3)
    i4 = Int4Linear(k, n, group_size=GROUP)
    i4.qweight.copy_(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g))
    i4.scales.copy_(torch.rand(n, k // GROUP, generator=g) * 1e-2)
    i4.zeros.copy_(torch.randn(n, k // GROUP, generator=g) * 1e-3)
    return w_t, i8, i4


GGUF_SHAPES = [("mlp down 576x1536", 576, 1536), ("mlp up 2048x1024", 2048, 1024), ("head 32768x1024", 32768, 1024)]


def gguf_table(types: list[str], threads: list[int], rows: list[int], budget: float) -> None:
    import sys

    import numpy as np


    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from test_gguf_blocks import random_blocks

    lib = cpu_gemm.load()
    if lib is None:
        print("llmd cpu_gemm kernel unavailable here: no GGUF figures")
        return
    print(f"{'type':7} {'shape':18} {'thr':>3} {'M':>4} {'ms':>9} {'Gw/s':>7} {'GB/s':>7} {'GFLOP/s':>8} "
          f"{'q8 ms':>9} {'q8 GB/s':>7} {'q16 ms':>9} {'fp32 ms':>9}")
    with torch.inference_mode():
        for name, n, k in GGUF_SHAPES:
            w_t = torch.randn(k, n) * 0.02
            for type_name in types:
                blocks = torch.from_numpy(np.ascontiguousarray(random_blocks(type_name, n, k, scale=0.001)))
                kernel = cpu_gemm.GGUFKernel(lib, [(blocks, type_name)], k, act="fp32")
                integer = cpu_gemm.GGUFKernel(lib, [(blocks, type_name)], k, act="int8")
                head = cpu_gemm.GGUFKernel(lib, [(blocks, type_name)], k, act="int16")  # Q8_0 / Q6_K only
                for t in threads:
                    torch.set_num_threads(t)
                    for m in rows:
                        x = torch.randn(m, k)
                        ms = best_ms(lambda: kernel(x), budget)
                        q8 = best_ms(lambda: integer(x), budget)
                        q16 = f"{best_ms(lambda: head(x), budget):9.3f}" if head.act == "int16" else f"{'-':>9}"
                        fp = best_ms(lambda: x @ w_t, budget)
                        print(f"{type_name:7} {name:18} {t:3d} {m:4d} {ms:9.3f} {n * k / ms / 1e6:7.2f} "
                              f"{blocks.numel() / ms / 1e6:7.2f} {2 * m * n * k / ms / 1e6:8.1f} {q8:9.3f} "
                              f"{blocks.numel() / q8 / 1e6:7.2f} {q16} {fp:9.3f}", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rows", default="1,4,16,64")
    parser.add_argument("--budget", type=float, default=0.3, help="seconds of repeated calls per figure")
    parser.add_argument("--baseline", help="another tree's kernels folder whose fp32-activation kernels run side by "
                        "side")
    parser.add_argument("--gguf", nargs="?", const="all", help="the GGUF block kernels instead (types, or all)")
    args = parser.parse_args(argv)
    if args.gguf:
        from llmd.kernels.gguf_blocks import PACKED_TYPES

        types = list(PACKED_TYPES) if args.gguf == "all" else args.gguf.split(",")
        rows = args.rows if args.rows != "1,4,16,64" else "1,4,16,64,256,512"
        gguf_table(types, [int(t) for t in args.threads.split(",")], [int(r) for r in rows.split(",")], args.budget)
        return
    base = build_baseline(args.baseline) if args.baseline else None
    if cpu_gemm.load() is None:
        print("llmd cpu_gemm kernel unavailable here (see the log line above); its columns show n/a")
    print(f"torch {torch.__version__}, kernel SIMD: {bool(cpu_gemm.load() and cpu_gemm.load().llmd_cpu_gemm_simd())}")
    names = ["fp32", "int8 llmd", "int8 q8", "int4 llmd", "int4 q8", "int8 torch", "int4 torch"]
    if base is not None:
        names[1:1] = ["int8 base"]
        names[4:4] = ["int4 base"]
    header = f"{'shape':18} {'thr':>3} {'M':>3} " + " ".join(f"{n + ' ms (GB/s)':>19}" for n in names)
    with torch.inference_mode():
        for name, n, k in SHAPES:
            w_t, i8, i4 = layers(n, k)
            b8, b4 = n * k + n * 4, n * k // 2 + n * k // GROUP * 8
            nbytes = {"fp32": n * k * 4, "int8 llmd": b8, "int8 q8": b8, "int8 torch": b8, "int8 base": b8,
                      "int4 llmd": b4, "int4 q8": b4, "int4 torch": b4, "int4 base": b4}
            k8 = k4 = None
            if cpu_gemm.load() is not None:
                os.environ["LLMD_CPU_GEMM_ACT"] = "int8"  # the integer path is opt-in, read when a layer is prepared
                k8 = cpu_gemm.layer_kernel("int8", i8.qweight, i8.scales, None, k)
                k4 = cpu_gemm.layer_kernel("int4", i4.qweight, i4.scales, i4.zeros, GROUP)
                assert k8.q8 and k4.q8
            fns = {
                "fp32": lambda x: x @ w_t,
                "int8 llmd": lambda x: cpu_gemm.int8_matmul(x, i8.qweight, i8.scales, k),
                "int4 llmd": lambda x: cpu_gemm.int4_matmul(x, i4.qweight, i4.scales, i4.zeros, GROUP),
                "int8 q8": lambda x: k8(x),
                "int4 q8": lambda x: k4(x),
                "int8 torch": i8._native_cpu(torch.float32),
                "int4 torch": i4._native_cpu(torch.float32),
                "int8 base": lambda x: cpu_gemm._int8(base, x, i8.qweight, i8.scales, k, None),
                "int4 base": lambda x: cpu_gemm._int4(base, x, i4.qweight, i4.scales, i4.zeros, GROUP, None),
            }
            print("\n" + header)
            for threads in (int(t) for t in args.threads.split(",")):
                torch.set_num_threads(threads)
                for m in (int(r) for r in args.rows.split(",")):
                    x = torch.randn(m, k)
                    cells = []
                    for method in names:
                        if ("llmd" in method or "q8" in method) and cpu_gemm.load() is None:
                            cells.append(f"{'n/a':>19}")
                            continue
                        try:
                            ms = best_ms(lambda: fns[method](x), args.budget)
                        except RuntimeError:  # this torch has no such kernel
                            cells.append(f"{'n/a':>19}")
                            continue
                        cells.append(f"{ms:8.3f} ({nbytes[method] / ms / 1e6:6.1f})".rjust(19))
                    print(f"{name:18} {threads:3d} {m:3d} " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
