"""Every exported matmul entry of this tree's CPU kernel library against another tree's, bit for bit.

    python tests/benchmarks/compare_cpu_gemm_builds.py BASELINE_DIR [--variants vnni,avx512,avx2,portable,serial]

BASELINE_DIR holds the other tree's kernel sources (every .c there is compiled into one library, as
llmd.kernels.cpu_gemm builds this tree's SOURCES), e.g. the last commit's:
    mkdir /tmp/base && git archive HEAD kernels | tar -x -C /tmp/base   ->   /tmp/base/kernels
For a refactor that must not change one bit (a file split, a clean-up of the tiles). Both libraries are built with
each variant's flags: vnni (this CPU's SIMD flags, as `load()` builds), avx512 (AVX-512 VL/BW without VNNI), avx2,
portable (no SIMD flags) and serial (vnni without OpenMP); a variant whose flags this CPU lacks is skipped. Each entry
(llmd_int8/int4_matmul and their _q8 forms, llmd_gguf_dequant, llmd_gguf_(parts_)matmul(_q8, _q16) for every GGUF
type, llmd_gguf_q16_type, llmd_q8_work_bytes, llmd_moe_experts) runs on random inputs at several shapes, row counts
(1 to 70: every tile and rows-in-lanes path), strided x and y, 1 and 2 threads, and bad arguments; the outputs (the
whole y buffer, its untouched margin included) and return codes must be the same bits. Prints one line per variant
and each difference; exits 1 on any.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from llmd.kernels import cpu_gemm, cpu_moe
from llmd.kernels import gguf_blocks as gb

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_gguf_blocks import random_blocks  # noqa: E402

ROWS = [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 33, 70]
THREADS = [1, 2]


def variants() -> dict[str, list[str] | None]:
    """name -> flags (None where this CPU cannot run that build)."""
    simd = cpu_gemm.simd_flags()
    avx2 = simd[:3] if simd else None
    avx512 = [f for f in simd if f not in ("-mavx512vnni", "-mavxvnni")] if "-mavx512bw" in simd else None
    omp = ["-fopenmp"]
    return {"vnni": simd + omp if "-mavx512vnni" in simd or "-mavxvnni" in simd else None,
            "avx512": avx512 + omp if avx512 else None, "avx2": avx2 + omp if avx2 else None,
            "portable": omp, "serial": simd or None}


def build(sources: list[Path], flags: list[str], out: Path) -> ctypes.CDLL:
    cc = cpu_gemm._compiler()
    include = f"-I{sources[0].parent}"
    subprocess.run([cc, *cpu_gemm._BASE_FLAGS, *flags, include, *map(str, sources), "-o", str(out), "-lm"], check=True)
    lib = cpu_gemm._bind(out)
    cpu_moe._bind(lib)
    return lib


def f32(t: torch.Tensor) -> int:
    return t.data_ptr()


class Cases:
    """Named calls on one library; each returns (rc, output tensor or None). Inputs are made once, shared by both."""

    def __init__(self) -> None:
        self.g = torch.Generator().manual_seed(0)
        self.cases: list[tuple[str, object]] = []
        self._int_layers()
        self._gguf()
        self._moe()
        self._misc()

    def add(self, name: str, fn) -> None:
        self.cases.append((name, fn))

    def x(self, m: int, k: int, pad: int = 5) -> torch.Tensor:
        """m rows of k values in rows of k + pad (a stride past K)."""
        return (torch.randn(m, k + pad, generator=self.g) * 2.0)[:, :k]

    @staticmethod
    def y(m: int, n: int, pad: int = 3) -> torch.Tensor:
        return torch.full((max(m, 1), n + pad), float("nan"))

    def _int_layers(self) -> None:
        # (n, k, g): per channel with a K tail past the multiples of 8, groups of 32, 64, K
        for n, k, g in [(37, 100, 100), (37, 256, 32), (29, 192, 64), (13, 576, 576), (11, 64, 8)]:
            q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=self.g)
            s = torch.rand(n, k // g, generator=self.g) * 0.01 + 0.001
            for m in ROWS:
                x = self.x(m, k)
                for t in THREADS:
                    def int8(lib, x=x, q=q, s=s, n=n, k=k, g=g, m=m, t=t):
                        y = self.y(m, n)
                        rc = lib.llmd_int8_matmul(f32(x), x.stride(0), q.data_ptr(), f32(s), f32(y), y.stride(0), m,
                                                  n, k, g, t)
                        return rc, y
                    self.add(f"int8 n{n} k{k} g{g} m{m} t{t}", int8)
                    if k % 32 or g % 32:
                        continue

                    def int8_q8(lib, x=x, q=q, s=s, n=n, k=k, g=g, m=m, t=t):
                        y = self.y(m, n)
                        work = torch.empty(max(lib.llmd_q8_work_bytes(m, k, g), 1), dtype=torch.uint8)
                        rc = lib.llmd_int8_matmul_q8(f32(x), x.stride(0), q.data_ptr(), f32(s), f32(y), y.stride(0),
                                                     m, n, k, g, work.data_ptr(), t)
                        return rc, y
                    self.add(f"int8_q8 n{n} k{k} g{g} m{m} t{t}", int8_q8)
        # int4: groups of 16 to 128, K past the multiples of 64
        for n, k, g in [(37, 96, 32), (29, 256, 16), (21, 576, 64), (13, 128, 128), (9, 80, 16)]:
            q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=self.g)
            s = torch.rand(n, k // g, generator=self.g) * 0.05 + 0.01
            z = torch.randn(n, k // g, generator=self.g) * 0.05
            for m in ROWS:
                x = self.x(m, k)
                for t in THREADS:
                    def int4(lib, x=x, q=q, s=s, z=z, n=n, k=k, g=g, m=m, t=t):
                        y = self.y(m, n)
                        rc = lib.llmd_int4_matmul(f32(x), x.stride(0), q.data_ptr(), f32(s), f32(z), f32(y),
                                                  y.stride(0), m, n, k, g, t)
                        return rc, y
                    self.add(f"int4 n{n} k{k} g{g} m{m} t{t}", int4)
                    if k % 32 or g % 32:
                        continue

                    def int4_q8(lib, x=x, q=q, s=s, z=z, n=n, k=k, g=g, m=m, t=t):
                        y = self.y(m, n)
                        work = torch.empty(max(lib.llmd_q8_work_bytes(m, k, g), 1), dtype=torch.uint8)
                        rc = lib.llmd_int4_matmul_q8(f32(x), x.stride(0), q.data_ptr(), f32(s), f32(z), f32(y),
                                                     y.stride(0), m, n, k, g, work.data_ptr(), t)
                        return rc, y
                    self.add(f"int4_q8 n{n} k{k} g{g} m{m} t{t}", int4_q8)

    def _gguf(self) -> None:
        acts = {"fp32": "", "int8": "_q8", "int16": "_q16"}
        for type_name in gb.PACKED_TYPES:
            elems = gb.BLOCKS[type_name][0]
            tid = cpu_gemm.GGUF_TYPE_IDS[type_name]
            ks = [256, 512, 768] if elems == 256 else [96, 256, 320, 544]
            for k in ks:
                n = 29
                q = torch.from_numpy(random_blocks(type_name, n, k, seed=k, scale=0.002))

                def dequant(lib, q=q, k=k, n=n, tid=tid):
                    w = torch.full((n, k + 3), float("nan"))
                    return lib.llmd_gguf_dequant(tid, q.data_ptr(), q.shape[1], n, k, f32(w), w.stride(0)), w
                self.add(f"dequant {type_name} k{k}", dequant)
                for m in ROWS:
                    x = self.x(m, k)
                    for t in THREADS:
                        for act, suffix in acts.items():
                            def one(lib, x=x, q=q, k=k, n=n, m=m, t=t, tid=tid, suffix=suffix):
                                y = self.y(m, n)
                                fn = getattr(lib, f"llmd_gguf_matmul{suffix}")
                                return fn(tid, f32(x), x.stride(0), q.data_ptr(), f32(y), y.stride(0), m, n, k, t), y
                            self.add(f"gguf {type_name} {act} k{k} m{m} t{t}", one)
        # parts side by side: mixed types, a type twice (the int paths prepare the rows once)
        for k, types in [(256, ["Q4_K", "Q6_K", "Q8_0"]), (256, ["Q6_K", "Q8_0", "Q6_K"]),
                         (512, ["Q5_0", "IQ4_XS", "Q4_0", "Q2_K"]), (256, ["MXFP4", "Q3_K", "Q5_K", "IQ4_NL", "Q4_1"])]:
            blocks = [torch.from_numpy(random_blocks(t, 13 + 4 * i, k, seed=i, scale=0.002))
                      for i, t in enumerate(types)]
            parts = (cpu_gemm.GGUFPart * len(types))()
            for p, b, t in zip(parts, blocks, types, strict=True):
                p.type, p.n, p.q = cpu_gemm.GGUF_TYPE_IDS[t], b.shape[0], b.data_ptr()
            n = sum(b.shape[0] for b in blocks)
            for m in ROWS:
                x = self.x(m, k)
                for t in THREADS:
                    for act, suffix in acts.items():
                        def multi(lib, x=x, k=k, n=n, m=m, t=t, suffix=suffix, parts=parts, blocks=blocks):
                            y = self.y(m, n)
                            fn = getattr(lib, f"llmd_gguf_parts_matmul{suffix}")
                            return fn(ctypes.addressof(parts), len(parts), f32(x), x.stride(0), f32(y), y.stride(0), m,
                                      k, t), y
                        self.add(f"parts {'/'.join(types)} {act} m{m} t{t}", multi)

    def _moe(self) -> None:
        experts, hidden, inter = 6, 256, 256
        for gate, up, down in [("Q4_K", "Q4_K", "Q6_K"), ("Q8_0", "Q8_0", "Q8_0"), ("MXFP4", "MXFP4", "MXFP4"),
                               ("Q4_0", "Q6_K", "Q5_1")]:
            def blocks(type_name: str, n: int, k: int, seed: int) -> torch.Tensor:
                raw = random_blocks(type_name, experts * n, k, seed=seed, scale=0.002)
                return torch.from_numpy(np.ascontiguousarray(raw)).view(experts, n, -1)
            gate_up = [(blocks(gate, inter, hidden, 1), gate), (blocks(up, inter, hidden, 2), up)]
            downs = [(blocks(down, hidden, inter, 3), down)]
            for tokens in (1, 3, 17):
                x = self.x(tokens, hidden)
                top = torch.stack([torch.randperm(experts, generator=self.g)[:2] for _ in range(tokens)])
                weights = torch.softmax(torch.randn(tokens, 2, generator=self.g), -1)
                for t in THREADS:
                    for act in ("fp32", "int8", "int16"):
                        def moe(lib, x=x, top=top, weights=weights, t=t, act=act, gate_up=gate_up, downs=downs,
                                tokens=tokens):
                            kernel = cpu_moe.MoEKernel(lib, gate_up, downs, act)
                            out = self.y(tokens, hidden)
                            hits = torch.zeros(experts, dtype=torch.int64)
                            rc = lib.llmd_moe_experts(ctypes.byref(kernel.moe), f32(x), x.stride(0), tokens, 2,
                                                      top.data_ptr(), f32(weights), f32(out), out.stride(0),
                                                      hits.data_ptr(), t)
                            return rc, torch.cat([out.flatten(), hits.float()])
                        self.add(f"moe {gate}/{up}/{down} {act} T{tokens} t{t}", moe)

    def _misc(self) -> None:
        def scalars(lib):
            values = [lib.llmd_cpu_gemm_simd()] + [lib.llmd_gguf_q16_type(i) for i in range(-1, 42)]
            values += [lib.llmd_q8_work_bytes(m, k, g) for m, k, g in
                       [(0, 32, 32), (3, 256, 64), (5, 96, 32), (1, 100, 100), (2, 64, 48), (-1, 32, 32)]]
            return 0, torch.tensor(values, dtype=torch.float32)
        self.add("scalars", scalars)
        x, y = torch.randn(2, 64), torch.zeros(2, 8)
        q8, s = torch.zeros(8, 64, dtype=torch.int8), torch.ones(8, 8)
        blocks = torch.zeros(8, 34 * 2, dtype=torch.uint8)

        def refused(lib):  # bad arguments: the same return codes, nothing written
            rcs = [lib.llmd_int8_matmul(f32(x), 64, q8.data_ptr(), f32(s), f32(y), 8, 2, 8, 64, 12, 1),
                   lib.llmd_int4_matmul(f32(x), 64, q8.data_ptr(), f32(s), f32(s), f32(y), 8, 2, 8, 64, 8, 1),
                   lib.llmd_int8_matmul_q8(f32(x), 64, q8.data_ptr(), f32(s), f32(y), 8, 2, 8, 64, 16, None, 1),
                   lib.llmd_gguf_matmul(99, f32(x), 64, blocks.data_ptr(), f32(y), 8, 2, 8, 64, 1),
                   lib.llmd_gguf_matmul(8, f32(x), 64, blocks.data_ptr(), f32(y), 8, 2, 8, 48, 1),
                   lib.llmd_gguf_matmul_q16(2, f32(x), 64, blocks.data_ptr(), f32(y), 8, 2, 8, 64, 1),
                   lib.llmd_gguf_dequant(12, blocks.data_ptr(), 68, 8, 64, f32(y), 8)]
            return 0, torch.tensor(rcs, dtype=torch.float32)
        self.add("refused", refused)


def same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("baseline", type=Path, help="a folder of the other tree's kernel sources")
    parser.add_argument("--variants", default="vnni,avx512,avx2,portable,serial")
    args = parser.parse_args(argv)
    baseline = sorted(args.baseline.glob("*.c"))
    if not baseline:
        parser.error(f"no .c files in {args.baseline}")
    cases = Cases()
    print(f"{len(cases.cases)} calls per build; this tree: {' '.join(p.name for p in cpu_gemm.SOURCES)}; "
          f"baseline: {' '.join(p.name for p in baseline)}", flush=True)
    failed = 0
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        for name in args.variants.split(","):
            flags = variants()[name]
            if flags is None:
                print(f"{name}: skipped (this CPU lacks its SIMD flags)")
                continue
            new = build(list(cpu_gemm.SOURCES), flags, Path(tmp) / f"new-{name}.so")
            old = build(baseline, flags, Path(tmp) / f"old-{name}.so")
            diffs = []
            for case, fn in cases.cases:
                (rc_new, y_new), (rc_old, y_old) = fn(new), fn(old)
                if rc_new != rc_old or not same(y_new, y_old):
                    diffs.append(f"  {case}: rc {rc_new} vs {rc_old}")
            failed += len(diffs)
            print(f"{name} ({' '.join(flags) or 'no flags'}): {len(cases.cases) - len(diffs)}/{len(cases.cases)} "
                  f"calls the same bits", flush=True)
            print("\n".join(diffs[:20]) + (f"\n  ... {len(diffs) - 20} more" if len(diffs) > 20 else ""), end="")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
