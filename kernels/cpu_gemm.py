"""Weight-only int8/int4 matmul for fp32 activations on the CPU, compiled from cpu_gemm.c (and the other C files of
SOURCES: the GGUF block types' matmuls, cpu_gguf.c) on first use.

torch's CPU int8/int4 weight kernels are only fast with AVX-512; on AVX2 machines they are many times slower than
fp32, and decoding with dequantized fp32 weights is bound by streaming 4 bytes per weight. This kernel reads the
packed weights of llmd.kernels.quant_matmul in place (no repacking), widens them in registers and uses AVX2/FMA.

The shared library is built with the system C compiler into <cache>/llmd/kernels/<hash of sources + flags>.so
($XDG_CACHE_HOME or ~/.cache): each file compiled by a compiler process of its own, linked under a temporary name
and renamed, one process at a time (a lock on the folder: the others wait and load its build). SIMD
flags are used only for features /proc/cpuinfo lists (never -march=native: some VMs advertise features that fault).
Without a compiler, or when the build or a self-check against the torch reference fails, `load()` logs one line and
returns None, and `int8_matmul` / `int4_matmul` return None: callers keep their torch path. LLMD_CPU_GEMM=0 turns the
kernel off (read by each function call, and by a quantized layer when it first runs).

Numerics paths: `int8_matmul` / `int4_matmul` / `gguf_matmul` keep fp32 activations; `int8_matmul_q8` /
`int4_matmul_q8` / `gguf_matmul(act="int8")` quantize each activation row to int8 per block of 32 and use integer dot
products (2-3x the multiply-adds per second; each has a torch reference, `*_q8_ref`); `gguf_matmul(act="int16")`
quantizes to int16 per block of 32 (Q8_0 and Q6_K blocks, the output heads; `gguf_matmul_q16_ref`). The quantized
layers use `layer_kernel` and `gguf_kernel`, which fix one path per layer for every M (LLMD_CPU_GEMM_ACT, see
ACTIVATIONS): a quantized one, where chosen, wherever K and the group are multiples of 32 (every GGUF block type).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from . import gguf_blocks as gb
from . import quant_matmul as qmm

log = logging.getLogger("llmd.kernels.cpu_gemm")

# one library: the matmuls (llmd's int8 / int4 layers, the GGUF block types, their activation rows: cpu_tiles.h lists
# the files), a mixture-of-experts layer's experts (llmd.kernels.cpu_moe), the fp32 glue ops of a decoder layer (bound
# by llmd.kernels.cpu_ops), a whole stack of layers built from them (llmd.kernels.cpu_stack) and the recurrent layers
# of hybrid models (llmd.kernels.cpu_recurrent); the headers declare what they share. Every file is in the build's
# cache key.
SOURCES = [Path(__file__).with_name(name) for name in (
    "cpu_gemm.c", "cpu_act.c", "cpu_blocks32.c", "cpu_kquants.c", "cpu_head.c", "cpu_gguf.c", "cpu_moe.c", "cpu_ops.c",
    "cpu_stack.c", "cpu_recurrent.c", "cpu_interleaved.c")]
HEADERS = [Path(__file__).with_name(name) for name in ("cpu_kernels.h", "cpu_gguf.h", "cpu_tiles.h", "cpu_vec.h")]
_BASE_FLAGS = ["-O3", "-std=gnu11", "-shared", "-fPIC", "-ffp-contract=off"]

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


# optional on top of AVX2: AVX-512 VL/BW give the 256-bit code 32 vector registers (the tiles' accumulators and decoded
# blocks stop spilling), VNNI fuses the u8 x s8 dot product (vpdpbusd); the kernels stay 256 bits wide either way
_EXTRA_FLAGS = (({"avx512f", "avx512vl", "avx512bw"}, ["-mavx512f", "-mavx512vl", "-mavx512bw"]),
                ({"avx512f", "avx512vl", "avx512bw", "avx512_vnni"}, ["-mavx512vnni"]),
                ({"avx_vnni"}, ["-mavxvnni"]))


@functools.lru_cache(maxsize=None)  # one warning per value
def _isa(value: str) -> str:
    if value not in ("auto", "avx2"):
        log.warning("LLMD_CPU_ISA=%r is not auto or avx2; using auto", value)
        return "auto"
    return value


def simd_flags(cpu_flags: set[str] | None = None, isa: str | None = None) -> list[str]:
    """-mavx2 -mfma -mf16c when the CPU lists all of AVX2, FMA and F16C, plus AVX-512 VL/BW and VNNI where it lists
    them unless LLMD_CPU_ISA=avx2 (`isa`: for a VM that lists them but faults, or a like-for-like comparison with an
    AVX2 build); else none (the portable scalar code)."""
    flags = _cpu_flags() if cpu_flags is None else cpu_flags
    if not {"avx2", "fma", "f16c"} <= flags:
        return []
    out = ["-mavx2", "-mfma", "-mf16c"]
    if (isa or _isa(os.environ.get("LLMD_CPU_ISA", "auto"))) == "avx2":
        return out
    for needs, extra in _EXTRA_FLAGS:
        if needs <= flags:
            out += extra
    return out + ["-mprefer-vector-width=256"] if len(out) > 3 else out


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "llmd" / "kernels"


def library_path(cc: str, flags: list[str]) -> Path:
    """Where the build with this compiler and these flags is cached: named by a hash of every source and header and
    of the command, so a change to any of them builds anew."""
    source = b"\0".join(path.read_bytes() for path in SOURCES + HEADERS)
    digest = hashlib.sha256(source + "\0".join([cc, *flags]).encode()).hexdigest()[:16]
    return cache_dir() / f"cpu_gemm-{digest}.so"


def _build(cc: str, flags: list[str]) -> Path:
    out = library_path(cc, flags)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with _folder_lock(out.parent):  # processes starting together (test workers, several daemons) compile once
        if out.exists():
            return out
        log.info("compiling the CPU kernels once (a minute on 2 cores) into %s", out)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            compile_flags = [f for f in flags if f != "-shared"]

            def compile_one(source: Path) -> str:
                obj = os.path.join(tmp, source.stem + ".o")
                _run([cc, *compile_flags, "-c", str(source), "-o", obj])
                return obj

            with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # one compiler process per file
                objects = list(pool.map(compile_one, SOURCES))
            library = os.path.join(tmp, "library.so")
            _run([cc, *flags, *objects, "-o", library, "-lm"])
            os.replace(library, out)  # atomic: another process sees either no file or a whole one
    return out


def _run(command: list[str]) -> None:
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{Path(command[0]).name} failed: {proc.stderr.strip()[-500:]}")


@contextlib.contextmanager
def _folder_lock(folder: Path) -> Iterator[None]:
    """An exclusive lock on the cache folder itself (no lock file left behind); the kernel drops it if the process
    dies while it holds it."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _bind(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))  # CDLL calls release the GIL
    i64, ptr, cint = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.llmd_int8_matmul.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, cint]
    lib.llmd_int4_matmul.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, cint]
    lib.llmd_int8_matmul.restype = lib.llmd_int4_matmul.restype = cint
    lib.llmd_int8_matmul_q8.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, ptr, cint]
    lib.llmd_int4_matmul_q8.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, ptr, cint]
    lib.llmd_int8_matmul_q8.restype = lib.llmd_int4_matmul_q8.restype = cint
    lib.llmd_q8_work_bytes.argtypes = [i64, i64, i64]
    lib.llmd_q8_work_bytes.restype = i64
    lib.llmd_cpu_gemm_simd.restype = cint
    lib.llmd_gguf_matmul.argtypes = [cint, ptr, i64, ptr, ptr, i64, i64, i64, i64, cint]
    lib.llmd_gguf_dequant.argtypes = [cint, ptr, i64, i64, i64, ptr, i64]
    lib.llmd_gguf_parts_matmul.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, i64, cint]
    lib.llmd_gguf_matmul.restype = lib.llmd_gguf_dequant.restype = lib.llmd_gguf_parts_matmul.restype = cint
    lib.llmd_gguf_matmul_q8.argtypes = lib.llmd_gguf_matmul.argtypes
    lib.llmd_x8_pack.argtypes = [cint, ptr, i64, i64]
    lib.llmd_x8_pack.restype = cint
    lib.llmd_x8_rows.argtypes = [cint, ptr, i64, i64, ptr, i64, ptr]
    lib.llmd_x8_rows.restype = cint
    lib.llmd_gguf_parts_matmul_q8.argtypes = lib.llmd_gguf_parts_matmul.argtypes
    lib.llmd_gguf_matmul_q8.restype = lib.llmd_gguf_parts_matmul_q8.restype = cint
    lib.llmd_gguf_matmul_q16.argtypes = lib.llmd_gguf_matmul.argtypes
    lib.llmd_gguf_parts_matmul_q16.argtypes = lib.llmd_gguf_parts_matmul.argtypes
    lib.llmd_gguf_q16_type.argtypes = [cint]
    lib.llmd_gguf_matmul_q16.restype = lib.llmd_gguf_parts_matmul_q16.restype = lib.llmd_gguf_q16_type.restype = cint
    return lib


def _self_check(lib: ctypes.CDLL) -> None:
    """Compare against the torch reference on a small problem with remainders in rows and columns."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=g)
    q8 = torch.randint(-127, 128, (13, 64), dtype=torch.int8, generator=g)
    s8 = torch.rand(13, 2, generator=g) * 0.01 + 0.001
    q4 = torch.randint(0, 256, (13, 32), dtype=torch.uint8, generator=g)
    s4, z4 = torch.rand(13, 2, generator=g) * 0.05 + 0.01, torch.randn(13, 2, generator=g) * 0.05
    for got, ref in ((_int8(lib, x, q8, s8, 32, 1), qmm.int8_matmul_ref(x, q8, s8, 32)),
                     (_int4(lib, x, q4, s4, z4, 32, 1), qmm.int4_matmul_ref(x, q4, s4, z4, 32)),
                     (_int8_q8(lib, x, q8, s8, 32, 1), int8_matmul_q8_ref(x, q8, s8, 32)),
                     (_int4_q8(lib, x, q4, s4, z4, 32, 1), int4_matmul_q8_ref(x, q4, s4, z4, 32))):
        if not torch.allclose(got, ref, rtol=1e-4, atol=1e-4):
            raise RuntimeError(f"self-check failed (max diff {(got - ref).abs().max().item():.3g})")
    blocks = torch.randint(0, 256, (3, 144), dtype=torch.uint8, generator=g)  # Q4_K, finite fp16 scales
    blocks[:, 0:4] = torch.tensor([0.01, 0.002], dtype=torch.float16).view(torch.uint8)
    if not torch.equal(_gguf_dequant(lib, blocks, "Q4_K", 256), gb.dequantize_blocks(blocks, "Q4_K")):
        raise RuntimeError("self-check failed: GGUF Q4_K blocks dequantize to other values than the reference")
    x = torch.randn(2, 256, generator=g)
    got = GGUFKernel(lib, [(blocks, "Q4_K")], 256, act="int8")(x, 1)
    if not torch.allclose(got, gguf_matmul_q8_ref(x, blocks, "Q4_K"), rtol=1e-4, atol=1e-4):
        raise RuntimeError("self-check failed: the GGUF Q4_K integer path differs from its reference")
    blocks = torch.randint(-128, 128, (3, 8, 34), dtype=torch.int8, generator=g).view(torch.uint8)  # Q8_0
    blocks[:, :, 0:2] = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
    blocks = blocks.reshape(3, 272)
    got = GGUFKernel(lib, [(blocks, "Q8_0")], 256, act="int16")(x, 1)
    if not torch.allclose(got, gguf_matmul_q16_ref(x, blocks, "Q8_0"), rtol=1e-5, atol=1e-5):
        raise RuntimeError("self-check failed: the GGUF Q8_0 head path differs from its reference")


def _build_any(cc: str, simd_choices: list[list[str]]) -> Path:
    """The first build that compiles: each SIMD choice (an older compiler may not know the AVX-512/VNNI flags), with
    OpenMP, then without (a compiler without it: single-threaded)."""
    error: RuntimeError | None = None
    for simd in dict.fromkeys(map(tuple, simd_choices)):
        for openmp in (["-fopenmp"], []):
            try:
                return _build(cc, _BASE_FLAGS + list(simd) + openmp)
            except RuntimeError as exc:
                error = exc
    raise error or RuntimeError("no build")


def build_and_load() -> ctypes.CDLL | None:
    """Build (or find in the cache), load and self-check the library; None, logged in one line, on any failure."""
    try:
        cc = _compiler()
        if cc is None:
            raise RuntimeError("no C compiler (cc, gcc, clang) on PATH")
        path = _build_any(cc, [simd_flags(), simd_flags(isa="avx2")])
        lib = _bind(path)
        _self_check(lib)
        return lib
    except Exception as exc:  # any failure keeps the torch path
        log.warning("CPU quantized matmul kernel unavailable, using torch: %s", exc)
        return None


def enabled() -> bool:
    return os.environ.get("LLMD_CPU_GEMM", "1") != "0"


def load() -> ctypes.CDLL | None:
    """The compiled kernel library, built on first use; None where it cannot be used or LLMD_CPU_GEMM=0."""
    global _lib, _tried
    if not enabled():
        return None
    if not _tried:
        with _lock:
            if not _tried:
                _lib = build_and_load()
                _tried = True
    return _lib


def available() -> bool:
    return load() is not None


def _prepare_x(x: torch.Tensor, k: int) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"expected x of shape [M, {k}], got {tuple(x.shape)}")
    if x.dtype is not torch.float32 or not x.is_cpu:
        raise ValueError(f"expected fp32 CPU activations, got {x.dtype} on {x.device}")
    return x if (x.is_contiguous() or x.stride(1) == 1) and x.shape[0] > 0 else x.contiguous()


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32).contiguous()


def _int8(lib, x, qweight, scales, group_size, threads, q8: bool = False):
    return LayerKernel(lib, "int8", qweight, scales, None, group_size, q8)(x, threads)


def _int4(lib, x, qweight, scales, zeros, group_size, threads, q8: bool = False):
    return LayerKernel(lib, "int4", qweight, scales, zeros, group_size, q8)(x, threads)


def supports_int8(k: int, group_size: int) -> bool:
    return k % group_size == 0 and (group_size == k or group_size % 8 == 0)


def supports_int4(k: int, group_size: int) -> bool:
    return k % group_size == 0 and group_size % 16 == 0


def int8_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group_size: int,
                threads: int | None = None) -> torch.Tensor | None:
    """fp32 x [M, K] @ dequant(int8 qweight [N, K], scales [N, K/group]).T -> fp32 [M, N]; None when the kernel is
    unavailable or does not take this group size (then use the torch path). threads: default torch's count."""
    lib = load()
    if lib is None or not supports_int8(qweight.shape[1], group_size):
        return None
    return _int8(lib, x, qweight, scales, group_size, threads)


def int4_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                threads: int | None = None) -> torch.Tensor | None:
    """fp32 x [M, K] @ dequant(packed int4 qweight [N, K/2], scales/zeros [N, K/group]).T -> fp32 [M, N]; None when
    the kernel is unavailable or does not take this group size (then use the torch path)."""
    lib = load()
    if lib is None or not supports_int4(qweight.shape[1] * 2, group_size):
        return None
    return _int4(lib, x, qweight, scales, zeros, group_size, threads)


# ---- integer path: activations quantized to int8 per block of 32 (see cpu_gemm.c) ---------------------------------

Q8_BLOCK = 32
_work = threading.local()  # each calling thread reuses one growing buffer for the quantized activations


def supports_q8(k: int, group_size: int) -> bool:
    """The integer path takes K and weight groups that are multiples of 32 (per channel: group_size == K)."""
    return k % Q8_BLOCK == 0 and group_size % Q8_BLOCK == 0 and k % group_size == 0


def _work_buffer(nbytes: int) -> int:
    buf = getattr(_work, "buf", None)
    if buf is None or buf.numel() < nbytes:
        buf = _work.buf = torch.empty(max(nbytes, 1 << 16), dtype=torch.uint8)
    return buf.data_ptr()


def _int8_q8(lib, x, qweight, scales, group_size, threads):
    return _int8(lib, x, qweight, scales, group_size, threads, q8=True)


def _int4_q8(lib, x, qweight, scales, zeros, group_size, threads):
    return _int4(lib, x, qweight, scales, zeros, group_size, threads, q8=True)


def int8_matmul_q8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group_size: int,
                   threads: int | None = None) -> torch.Tensor | None:
    """int8_matmul with the activations quantized to int8 per block of 32 (quantize_activations_ref) and integer
    dot products; None when the kernel is unavailable or K / the group is not a multiple of 32."""
    lib = load()
    if lib is None or not supports_q8(qweight.shape[1], group_size):
        return None
    return _int8_q8(lib, x, qweight, scales, group_size, threads)


def int4_matmul_q8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                   threads: int | None = None) -> torch.Tensor | None:
    """int4_matmul with int8-quantized activations and integer dot products; None where not taken."""
    lib = load()
    if lib is None or not supports_q8(qweight.shape[1] * 2, group_size):
        return None
    return _int4_q8(lib, x, qweight, scales, zeros, group_size, threads)


def quantize_activations_ref(x: torch.Tensor, levels: int = 127) -> torch.Tensor:
    """The kernel's activation quantization in torch, dequantized: per block of 32, d = amax / levels and
    q = round(x * (levels / amax)) (ties to even; levels 127 for int8, 32767 for int16); returns d * q (the same fp32
    ops, so the same q and d bit for bit)."""
    m, k = x.shape
    xb = x.to(torch.float32).reshape(m, k // Q8_BLOCK, Q8_BLOCK)
    amax = xb.abs().amax(-1, keepdim=True)
    # a tensor divided by a tensor: `127.0 / amax` is computed as 127 * (1 / amax) in torch, off by an ulp at times,
    # which flips a rare activation that lands on .5 (the kernel divides once, correctly rounded)
    inv = torch.where(amax > 0, torch.full_like(amax, float(levels)) / amax, torch.zeros_like(amax))
    q = torch.round(xb * inv)
    return (q * (amax / float(levels))).reshape(m, k)


def int8_matmul_q8_ref(x, qweight, scales, group_size):
    return qmm.int8_matmul_ref(quantize_activations_ref(x), qweight, scales, group_size)


def int4_matmul_q8_ref(x, qweight, scales, zeros, group_size):
    return qmm.int4_matmul_ref(quantize_activations_ref(x), qweight, scales, zeros, group_size)


# ---- per-layer kernels: validated once, so a decode step's ~200 calls pay little Python per call -------------------

# Which activations each kind of layer takes when LLMD_CPU_GEMM_ACT is unset (or "auto"), read when a layer's kernel
# is prepared; "fp32" or "int8" choose one path for every kind.
# - int8 / int4 (llmd's own quantization of HF weights): fp32 activations, so the layer computes exactly its weights
#   (the dequantized model's logits up to summation order).
# - gguf_q4_1 (a file's Q4_1 blocks): int16 activations. On the int8 path SmolLM2's Q4_1 layers move its logits by
#   ~0.3 (perplexity +0.6 %), enough to flip near-ties: it then answers "What is the capital of France?" as llama.cpp
#   does ("L'Étoile, ..."); int16 is 256 times finer, twice the speed of fp32 activations at one row and as fast
#   from 8 rows on.
# - gguf (a file's K-quant, Q5_0/Q5_1, Q8_0 and IQ4 blocks kept packed): the integer path, activations quantized to
#   int8 per block of 32 as llama.cpp computes these files (LLMD_CPU_GEMM_ACT=fp32: the file's exact weights).
# - gguf_head (a packed output head, tied or not): int16 activations where the head is Q8_0, Q6_K (as nearly every
#   file's is) or Q4_1, else fp32. The head picks the token: on the int8 path SmolLM2's tied Q8_0 head alone turns "The
#   capital of France is Paris." into llama.cpp's "L'Étoile, ..."; int16 is 256 times finer, and a Q8_0 head then
#   runs as fast as on int8 (read at memory speed: Gemma 3's 178 MB table 4.7 ms instead of 8.7 ms with fp32).
ACTIVATIONS = {"int4": "fp32", "int8": "fp32", "gguf": "int8", "gguf_q4_1": "int16", "gguf_head": "int16"}


def activations(kind: str) -> str:
    """The activation path ("fp32", "int8" or "int16") that a layer of `kind` takes: ACTIVATIONS[kind] unless
    LLMD_CPU_GEMM_ACT says fp32 or int8 for every kind."""
    mode = _activation_mode(os.environ.get("LLMD_CPU_GEMM_ACT", "auto"))
    return ACTIVATIONS[kind] if mode == "auto" else mode


@functools.lru_cache(maxsize=None)  # one warning per value, not one per layer
def _activation_mode(value: str) -> str:
    if value not in ("auto", "fp32", "int8"):
        log.warning("LLMD_CPU_GEMM_ACT=%r is not auto, fp32 or int8; using auto", value)
        return "auto"
    return value


class LayerKernel:
    """One quantized layer's CPU matmul with its weight pointers and path fixed: the integer path for every M when
    K and the group take it (one numerics path per layer, so a row's result never depends on the batch)."""

    def __init__(self, lib, kind: str, qweight, scales, zeros, group_size: int, q8: bool | None = None):
        """q8: int8 activations (where K and the group allow); None: as LLMD_CPU_GEMM_ACT says for `kind`."""
        self.kind, self.group_size = kind, group_size
        self.n = qweight.shape[0]
        self.k = qweight.shape[1] * (2 if kind == "int4" else 1)
        # contiguous fp32 forms, kept alive with the layer: the pointers below stay valid
        self._keep = [qweight.contiguous(), _f32(scales)] + ([_f32(zeros)] if kind == "int4" else [])
        self.q8 = (activations(kind) == "int8" if q8 is None else q8) and supports_q8(self.k, group_size)
        if self.q8:
            self._fn = lib.llmd_int4_matmul_q8 if kind == "int4" else lib.llmd_int8_matmul_q8
            self._work_per_row = lib.llmd_q8_work_bytes(1, self.k, group_size)
        else:
            self._fn = lib.llmd_int4_matmul if kind == "int4" else lib.llmd_int8_matmul
        self.weight_pointers = tuple(t.data_ptr() for t in self._keep)  # (q, s) or (q, s, z)

    @property
    def act(self) -> str:
        return "int8" if self.q8 else "fp32"

    def __call__(self, x: torch.Tensor, threads: int | None = None) -> torch.Tensor:
        x = _prepare_x(x, self.k)
        m, n = x.shape[0], self.n
        y = torch.empty(m, n, dtype=torch.float32)
        tail = (_work_buffer(m * self._work_per_row), threads or torch.get_num_threads()) if self.q8 \
            else (threads or torch.get_num_threads(),)
        rc = self._fn(x.data_ptr(), x.stride(0), *self.weight_pointers, y.data_ptr(), n, m, n, self.k, self.group_size,
                      *tail)
        if rc == -2:
            raise MemoryError("CPU kernel could not allocate its activation buffer")
        if rc != 0:
            raise ValueError(f"{self.kind} kernel rejected N={n} K={self.k} group={self.group_size}")
        return y


def layer_kernel(kind: str, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                 group_size: int) -> LayerKernel | None:
    """The LayerKernel for these weights (the caller keeps it: llmd.model.quant's layers, from prepare); None when
    the kernel is off or unavailable or takes neither path for this shape (then use torch)."""
    lib = load()
    k = qweight.shape[1] * (2 if kind == "int4" else 1)
    ok = lib is not None and (supports_int4(k, group_size) if kind == "int4" else supports_int8(k, group_size))
    return LayerKernel(lib, kind, qweight, scales, zeros, group_size) if ok else None


# ---- GGUF blocks (llmd.kernels.gguf_blocks), read in place ---------------------------------------------------------

# GGML type ids (gguf.GGMLQuantizationType) of the types the C kernels take (cpu_gguf.c's type table)
GGUF_TYPE_IDS = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11, "Q4_K": 12,
                 "Q5_K": 13, "Q6_K": 14, "IQ4_NL": 20, "IQ4_XS": 23, "MXFP4": 39,
                 "Q4_0_X8": 1002, "Q4_1_X8": 1003, "Q5_0_X8": 1006, "Q5_1_X8": 1007, "Q8_0_X8": 1008,
                 "Q2_K_X8": 1010, "Q3_K_X8": 1011, "Q4_K_X8": 1012, "Q5_K_X8": 1013, "Q6_K_X8": 1014,
                 "IQ4_NL_X8": 1020, "IQ4_XS_X8": 1023}  # llmd's own: 8 columns interleaved
# (gguf_blocks.x8_pack)


def _gguf_dequant(lib, blocks: torch.Tensor, type_name: str, k: int) -> torch.Tensor:
    blocks = blocks.contiguous()
    out = torch.empty(blocks.shape[0], k, dtype=torch.float32)
    rc = lib.llmd_gguf_dequant(GGUF_TYPE_IDS[type_name], blocks.data_ptr(), blocks.shape[1], blocks.shape[0], k,
                               out.data_ptr(), k)
    if rc != 0:
        raise ValueError(f"{type_name} dequantize rejected K={k}")
    return out


def gguf_dequantize(blocks: torch.Tensor, type_name: str) -> torch.Tensor | None:
    """The C dequantize of GGUF block rows [N, row bytes] -> fp32 [N, K] (the reference's very values); None when
    the kernel library is unavailable or does not know the type."""
    lib = load()
    if lib is None or type_name not in GGUF_TYPE_IDS or blocks.device.type != "cpu":
        return None
    elems, nbytes = gb.block_shape(type_name)
    return _gguf_dequant(lib, blocks, type_name, blocks.shape[1] // nbytes * elems)


class GGUFPart(ctypes.Structure):
    """llmd_gguf_part: one projection's blocks [n, row bytes] of GGML type `type`."""
    _fields_ = [("type", ctypes.c_int64), ("n", ctypes.c_int64), ("q", ctypes.c_void_p)]


def gguf_act(lib, types: list[str], k: int, act: str | None = None) -> str:
    """The activation path a GGUF kernel over blocks of `types` takes for K: `act` (None: as LLMD_CPU_GEMM_ACT says for
    a packed layer), int16 only where every type takes it, a quantized one only where K is a multiple of 32; else
    fp32."""
    act = activations("gguf") if act is None else act
    if act not in ("fp32", "int8", "int16"):
        raise ValueError(f"activation path {act!r} is not fp32, int8 or int16")
    if act == "int16" and not all(lib.llmd_gguf_q16_type(GGUF_TYPE_IDS[t]) for t in types):
        act = "fp32"
    return act if k % Q8_BLOCK == 0 else "fp32"


class GGUFKernel:
    """A packed GGUF layer's CPU matmul: the kernel multiplies the blocks' integer codes with the activations per
    sub-block and applies each sub-block's scale and offset once (the int4 kernel's arithmetic), in one fixed
    operation order per output, so a row's result never depends on the batch. Several parts of different types (a
    fused q/k/v) fill their own columns side by side. act, the activation path for every M: "fp32"; "int8"
    (quantized per block of 32, integer dot products: gguf_matmul_q8_ref's values); "int16" (per block of 32 to
    int16, where every part is Q8_0, Q6_K or Q4_1, else fp32: gguf_matmul_q16_ref's values); None: as
    LLMD_CPU_GEMM_ACT says for a layer."""

    kind = "gguf"

    def __init__(self, lib, parts: list[tuple[torch.Tensor, str]], k: int, act: str | None = None):
        self.k = k
        self.act = gguf_act(lib, [t for _, t in parts], k, act)
        self._keep = []
        self.parts = (GGUFPart * len(parts))()
        for c_part, (qweight, type_name) in zip(self.parts, parts):
            if qweight.shape[1] != gb.row_bytes(type_name, k):
                raise ValueError(f"{type_name} rows of {qweight.shape[1]} bytes do not hold K={k}")
            q = qweight.contiguous()
            self._keep.append(q)  # the pointers below stay valid as long as the kernel lives
            c_part.type, c_part.n, c_part.q = GGUF_TYPE_IDS[type_name], q.shape[0], q.data_ptr()
        self.n = sum(p.n for p in self.parts)
        self.types = [t for _, t in parts]
        self._fn = {"fp32": lib.llmd_gguf_parts_matmul, "int8": lib.llmd_gguf_parts_matmul_q8,
                    "int16": lib.llmd_gguf_parts_matmul_q16}[self.act]
        self.parts_pointer = ctypes.addressof(self.parts)

    def __call__(self, x: torch.Tensor, threads: int | None = None) -> torch.Tensor:
        x = _prepare_x(x, self.k)
        y = torch.empty(x.shape[0], self.n, dtype=torch.float32)
        rc = self._fn(self.parts_pointer, len(self.parts), x.data_ptr(), x.stride(0), y.data_ptr(), self.n,
                      x.shape[0], self.k, threads or torch.get_num_threads())
        if rc == -2:
            raise MemoryError("CPU kernel could not allocate its weight panel or activations")
        if rc != 0:
            raise ValueError(f"{'/'.join(self.types)} kernel rejected N={self.n} K={self.k}")
        return y


def gguf_matmul(x: torch.Tensor, qweight: torch.Tensor, type_name: str, threads: int | None = None,
                act: str = "fp32") -> torch.Tensor | None:
    """fp32 x [M, K] @ dequantize_blocks(qweight [N, row bytes], type_name).T -> fp32 [M, N] (act "int8" or "int16":
    x quantized per block of 32, gguf_matmul_q8_ref's or gguf_matmul_q16_ref's values); None when the kernel is
    unavailable or does not know the type (then use the torch path)."""
    lib = load()
    if lib is None or type_name not in GGUF_TYPE_IDS:
        return None
    elems, nbytes = gb.block_shape(type_name)
    return GGUFKernel(lib, [(qweight, type_name)], qweight.shape[1] // nbytes * elems, act=act)(x, threads)


def gguf_matmul_q8_ref(x: torch.Tensor, qweight: torch.Tensor, type_name: str) -> torch.Tensor:
    """The integer path's values in torch: the activations quantized as the kernel does (quantize_activations_ref),
    times the blocks' reference weights (gguf's dequantize)."""
    return quantize_activations_ref(x) @ gb.dequantize_blocks(qweight, type_name).t()


def gguf_matmul_q16_ref(x: torch.Tensor, qweight: torch.Tensor, type_name: str) -> torch.Tensor:
    """The head path's values in torch: x quantized to int16 per block of 32 as the kernel does, times the blocks'
    reference weights, summed in float64."""
    xq = quantize_activations_ref(x, 32767).double()
    return (xq @ gb.dequantize_blocks(qweight, type_name).double().t()).float()


def interleaved_type(type_name: str, n: int, k: int, head: bool = False) -> str | None:
    """The interleaved layout (gguf_blocks.X8_OF) a GGUF weight of `type_name` [n, k] takes for this CPU's kernel (head:
    as the output head): where the kernel runs its integer path (int8; int16 for a head: Q6_K) on that layout and the
    columns come in whole groups of 8; else None (keep the file's)."""
    lib = load()
    layout = next((x8 for x8, t in gb.X8_OF.items() if t == type_name), None)
    if layout is None or lib is None or n % 8:
        return None
    act = activations(activation_kind([type_name], head))
    return layout if act != "fp32" and gguf_act(lib, [type_name, layout], k, act) == act else None


def x8_pack_(blocks: torch.Tensor, layout: str) -> None:
    """Rearrange the file's rows [N, row bytes] in place into the interleaved `layout` (gguf_blocks.x8_pack's bytes),
    in C where the library loads, else with the torch reference."""
    lib = load()
    if lib is None or not blocks.is_contiguous() or blocks.device.type != "cpu":
        blocks.copy_(gb.x8_pack(blocks, layout))
        return
    rc = lib.llmd_x8_pack(GGUF_TYPE_IDS[layout], blocks.data_ptr(), blocks.shape[0], blocks.shape[1])
    if rc == -2:
        raise MemoryError("no memory for a group of rows while interleaving")
    if rc != 0:
        raise ValueError(f"{layout} cannot hold rows of shape {tuple(blocks.shape)}")


def x8_rows(blocks: torch.Tensor, ids: torch.Tensor, layout: str) -> torch.Tensor:
    """Rows `ids` of an interleaved table [N, row bytes] in the file's layout (gguf_blocks.x8_rows' bytes), in C where
    the library loads and takes the layout."""
    lib = load()
    in_c = layout == "Q6_K_X8" or gb.BLOCKS[gb.X8_OF[layout]][0] == 32  # llmd_x8_rows' layouts
    if lib is None or not in_c or not blocks.is_contiguous() or blocks.device.type != "cpu":
        return gb.x8_rows(blocks, ids, layout)
    ids = ids.to(torch.int64).contiguous()
    out = torch.empty(ids.numel(), blocks.shape[1], dtype=torch.uint8)
    if lib.llmd_x8_rows(GGUF_TYPE_IDS[layout], blocks.data_ptr(), blocks.shape[0], blocks.shape[1], ids.data_ptr(),
                        ids.numel(), out.data_ptr()) != 0:
        raise IndexError(f"token ids outside the table's {blocks.shape[0]} rows")
    return out


def gguf_kernel(parts: list[tuple[torch.Tensor, str]], k: int, head: bool = False) -> GGUFKernel | None:
    """The GGUFKernel of one packed GGUF weight, or of several side by side (GGUFConcat), for the caller to keep;
    None where the kernel is off or unavailable or does not know a type (then the layer dequantizes in torch).
    head: the output head's (its activations chosen as ACTIVATIONS["gguf_head"] says)."""
    lib = load()
    ok = lib is not None and all(t in GGUF_TYPE_IDS for _, t in parts)
    return GGUFKernel(lib, parts, k, activations(activation_kind([t for _, t in parts], head))) if ok else None


def activation_kind(types: list[str], head: bool = False) -> str:
    """The ACTIVATIONS kind of a GGUF weight of `types` (file types or their interleaved layouts)."""
    return "gguf_head" if head else "gguf_q4_1" if "Q4_1" in (gb.X8_OF.get(t, t) for t in types) else "gguf"
