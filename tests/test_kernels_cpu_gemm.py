"""The compiled CPU int8/int4 matmul (llmd.kernels.cpu_gemm) against the torch dequantize references, its
batch invariance, the quantized modules' use of it, and the torch fallback when it is off or cannot be built.

Where no C compiler exists the kernel functions return None; the tests then check that branch (the module falls back
to torch) instead of skipping."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch

from llmd.kernels import cpu_gemm
from llmd.kernels import quant_matmul as qmm
from llmd.model.quant import Int4Linear, Int8Linear, QuantSpec, fill_from_weight

HAVE_KERNEL = cpu_gemm.available()
ROWS = [1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33, 64, 70]


def _int8(n: int, k: int, group: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    s = torch.rand(n, k // group, generator=g) * 0.01 + 0.001
    return q, s


def _int4(n: int, k: int, group: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    s = torch.rand(n, k // group, generator=g) * 0.05 + 0.01
    z = torch.randn(n, k // group, generator=g) * 0.05
    return q, s, z


def _x(m: int, k: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed))


def _check_close(out, ref):
    assert out is not None and out.shape == ref.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_kernel_builds_here():
    # The test machines have a C compiler; where one is missing this documents the fallback instead.
    if HAVE_KERNEL:
        assert cpu_gemm.load() is not None
    else:
        assert cpu_gemm.int8_matmul(_x(1, 64), *_int8(8, 64, 64), 64) is None


@pytest.mark.parametrize("n,k,group", [(37, 96, 96), (13, 100, 100), (40, 128, 32), (33, 192, 64)])
def test_int8_matches_reference(n, k, group):
    q, s = _int8(n, k, group)
    for m in ROWS:
        x = _x(m, k, seed=m)
        out = cpu_gemm.int8_matmul(x, q, s, group)
        if not HAVE_KERNEL:
            assert out is None
            continue
        _check_close(out, qmm.int8_matmul_ref(x, q, s, group))


# K is taken in chunks of 64: (80, 16), (240, 48) and (23, 96, 32) end in a partial chunk, and groups of 48 straddle
# chunks; group 32 has a path of its own for whole chunks
@pytest.mark.parametrize("n,k,group", [(37, 128, 32), (13, 192, 64), (41, 256, 128), (8, 64, 32), (11, 80, 16),
                                       (19, 240, 48), (23, 96, 32)])
def test_int4_matches_reference(n, k, group):
    q, s, z = _int4(n, k, group)
    for m in ROWS:
        x = _x(m, k, seed=m)
        out = cpu_gemm.int4_matmul(x, q, s, z, group)
        if not HAVE_KERNEL:
            assert out is None
            continue
        _check_close(out, qmm.int4_matmul_ref(x, q, s, z, group))


def test_non_contiguous_inputs():
    q, s, z = _int4(19, 128, 32)
    q8, s8 = _int8(19, 128, 128)
    wide = _x(6, 300)
    sliced = wide[:, 100:228]  # row stride 300
    transposed = _x(128, 6).t()  # column stride != 1
    for x in (sliced, transposed):
        assert not x.is_contiguous()
        out4, out8 = cpu_gemm.int4_matmul(x, q, s, z, 32), cpu_gemm.int8_matmul(x, q8, s8, 128)
        if HAVE_KERNEL:
            _check_close(out4, qmm.int4_matmul_ref(x, q, s, z, 32))
            _check_close(out8, qmm.int8_matmul_ref(x, q8, s8, 128))
    # a non-contiguous weight view is taken too
    if HAVE_KERNEL:
        big = torch.cat([q, q], dim=1)[:, :64]
        _check_close(cpu_gemm.int4_matmul(sliced, big, s, z, 32), qmm.int4_matmul_ref(sliced, big.contiguous(), s, z, 32))


def test_bad_shapes_raise():
    q, s, z = _int4(8, 64, 32)
    if not HAVE_KERNEL:
        return
    with pytest.raises(ValueError, match="shape"):
        cpu_gemm.int4_matmul(_x(2, 32), q, s, z, 32)
    with pytest.raises(ValueError, match="fp32"):
        cpu_gemm.int4_matmul(_x(2, 64).to(torch.bfloat16), q, s, z, 32)
    # group sizes the vector code does not take are declined (None), not computed wrongly
    q8, s8 = _int8(8, 64, 4)
    assert cpu_gemm.int8_matmul(_x(2, 64), q8, s8, 4) is None


@pytest.mark.parametrize("kind", ["int8", "int8-g32", "int8-k100", "int4", "int4-g48", "int4-g32"])
def test_row_results_do_not_depend_on_the_batch(kind):
    """A row's output is bitwise the same whatever M is, whichever rows share the call, and for any thread count
    (int8 takes three paths by M: one row, row tiles, and widened panels from 8 rows)."""
    if not HAVE_KERNEL:
        return
    n, k = 45, 192
    if kind.startswith("int4"):
        group = {"int4-g48": 48, "int4-g32": 32}.get(kind, 64)
        k = {"int4-g48": 240, "int4-g32": 224}.get(kind, k)  # a partial last chunk of 64
        q, s, z = _int4(n, k, group)

        def mm(x, threads=None):
            return cpu_gemm.int4_matmul(x, q, s, z, group, threads=threads)
    else:
        k = 100 if kind == "int8-k100" else k  # per channel, K not a multiple of 8: a scalar tail
        group = 32 if kind == "int8-g32" else k
        q, s = _int8(n, k, group)

        def mm(x, threads=None):
            return cpu_gemm.int8_matmul(x, q, s, group, threads=threads)

    x = _x(70, k)
    full = mm(x)
    for i in (0, 5, 69):
        assert torch.equal(mm(x[i:i + 1]), full[i:i + 1])
    for m in (2, 3, 4, 5, 9, 17, 64):
        start = 70 - m
        assert torch.equal(mm(x[start:]), full[start:])
    picked = [3, 40, 7, 66, 12]
    assert torch.equal(mm(x[picked]), full[picked])
    assert torch.equal(mm(x, threads=1), full) and torch.equal(mm(x, threads=3), full)


def _modules():
    torch.manual_seed(0)
    w = torch.randn(70, 256) * 0.05
    i8 = Int8Linear(256, 70)
    fill_from_weight(i8, w, QuantSpec("int8"))
    i4 = Int4Linear(256, 70, group_size=32)
    fill_from_weight(i4, w, QuantSpec("int4", 32))
    return i8, i4


def test_modules_use_the_integer_kernel_when_asked(monkeypatch):
    monkeypatch.setenv("LLMD_CPU_GEMM_ACT", "int8")  # read when a layer's kernel is prepared
    i8, i4 = _modules()
    x = torch.randn(3, 5, 256)
    with torch.inference_mode():
        y8, y4 = i8(x), i4(x)
        # the module's result is the integer path's, bit for bit (so the kernel is what ran)
        k8 = cpu_gemm.int8_matmul_q8(x.reshape(-1, 256), i8.qweight, i8.scales, i8.group_size)
        k4 = cpu_gemm.int4_matmul_q8(x.reshape(-1, 256), i4.qweight, i4.scales, i4.zeros, i4.group_size)
        if HAVE_KERNEL:
            assert torch.equal(y8, k8.view(3, 5, 70)) and torch.equal(y4, k4.view(3, 5, 70))
        # and it is the quantized layer's function on int8-quantized activations
        x2 = x.reshape(-1, 256)
        torch.testing.assert_close(y8.reshape(-1, 70), cpu_gemm.int8_matmul_q8_ref(x2, i8.qweight, i8.scales, 256),
                                   rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(y4.reshape(-1, 70),
                                   cpu_gemm.int4_matmul_q8_ref(x2, i4.qweight, i4.scales, i4.zeros, 32),
                                   rtol=1e-4, atol=1e-4)


def test_fp32_activations_by_default_or_when_k_is_not_a_multiple_of_32(monkeypatch):
    monkeypatch.delenv("LLMD_CPU_GEMM_ACT", raising=False)
    i8, i4 = _modules()
    x = torch.randn(4, 256)
    with torch.inference_mode():
        y8, y4 = i8(x), i4(x)
        if HAVE_KERNEL:
            assert torch.equal(y8, cpu_gemm.int8_matmul(x, i8.qweight, i8.scales, 256))
            assert torch.equal(y4, cpu_gemm.int4_matmul(x, i4.qweight, i4.scales, i4.zeros, 32))
        monkeypatch.setenv("LLMD_CPU_GEMM_ACT", "int8")
        odd = Int8Linear(100, 13)
        fill_from_weight(odd, torch.randn(13, 100), QuantSpec("int8"))
        x100 = torch.randn(3, 100)
        assert cpu_gemm.int8_matmul_q8(x100, odd.qweight, odd.scales, 100) is None
        torch.testing.assert_close(odd(x100), x100 @ odd.dequantized_weight().t(), rtol=1e-4, atol=1e-4)


def test_a_replaced_weight_is_not_served_from_the_old_kernel():
    """prepare() fixes a layer's kernel; filling the layer again (fill_from_weight, fill_int4, a GGUF fill, a quant
    cache read) drops it, and the next call prepares one for the new weights."""
    i8, i4 = _modules()
    x = torch.randn(3, 256)
    w = torch.randn(70, 256) * 0.05
    with torch.inference_mode():
        for layer, spec in ((i8, QuantSpec("int8")), (i4, QuantSpec("int4", 32))):
            kernel = layer.prepare(torch.device("cpu"), torch.float32)
            assert layer.kernel is kernel and isinstance(kernel, cpu_gemm.LayerKernel) == (cpu_gemm.load() is not None)
            layer(x)
            assert layer.kernel is kernel  # kept across calls
            fill_from_weight(layer, w, spec)
            assert layer.kernel is None
            torch.testing.assert_close(layer(x), x @ layer.dequantized_weight().t(), rtol=1e-4, atol=1e-4)
            fill_from_weight(layer, w[:10].flip(1), spec, slice(0, 10))  # some rows only
            torch.testing.assert_close(layer(x), x @ layer.dequantized_weight().t(), rtol=1e-4, atol=1e-4)


def test_fallback_when_turned_off(monkeypatch):
    i8, i4 = _modules()
    x = torch.randn(4, 256)
    with torch.inference_mode():
        fast8, fast4 = i8(x), i4(x)
        monkeypatch.setenv("LLMD_CPU_GEMM", "0")
        assert cpu_gemm.int4_matmul(x, i4.qweight, i4.scales, i4.zeros, 32) is None
        i8, i4 = _modules()  # a layer reads the switch when it first runs
        slow8, slow4 = i8(x), i4(x)
        assert torch.equal(slow4, torch.nn.functional.linear(x, i4.dequantized_weight()))  # torch's path
    # the torch fallback has fp32 activations: the kernel's differ by at most its activation rounding (bounded in
    # test_q8_error_is_within_the_activation_rounding_bound); here a plain relative check
    torch.testing.assert_close(slow8, fast8, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(slow4, fast4, rtol=2e-2, atol=2e-2)


def test_turned_off_by_env(monkeypatch):
    q, s, z = _int4(8, 64, 32)
    monkeypatch.setenv("LLMD_CPU_GEMM", "0")
    assert cpu_gemm.load() is None and cpu_gemm.int4_matmul(_x(1, 64), q, s, z, 32) is None


def test_a_failing_build_logs_one_line_and_returns_none(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="llmd.kernels.cpu_gemm"):
        assert cpu_gemm.build_and_load() is None
    assert len(caplog.records) == 1 and "unavailable" in caplog.records[0].getMessage()
    assert not list(tmp_path.rglob("*.so"))  # no half-written library left behind


def test_a_compiler_without_the_avx512_flags_still_builds_the_avx2_kernels(monkeypatch, tmp_path):
    """An older compiler that refuses -mavx512* / -mavxvnni: the AVX2 build, not the torch fallback."""
    if not HAVE_KERNEL or not cpu_gemm.simd_flags():
        return
    real = cpu_gemm._compiler()
    cc = tmp_path / "old-cc"
    cc.write_text(f'#!/bin/sh\nfor a in "$@"; do case "$a" in -mavx512*|-mavxvnni) exit 1;; esac; done\n'
                  f'exec "{real}" "$@"\n')
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    lib = cpu_gemm.build_and_load()
    assert lib is not None and lib.llmd_cpu_gemm_simd() == 1


def test_build_goes_to_the_user_cache(monkeypatch, tmp_path):
    if not HAVE_KERNEL:
        return
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    lib = cpu_gemm.build_and_load()
    assert lib is not None
    built = list((tmp_path / "llmd" / "kernels").glob("cpu_gemm-*.so"))
    assert len(built) == 1 and not [p for p in built[0].parent.iterdir() if p not in built]
    # a second load finds the file instead of compiling again
    mtime = built[0].stat().st_mtime_ns
    assert cpu_gemm.build_and_load() is not None and built[0].stat().st_mtime_ns == mtime


def test_every_kernel_file_is_built_and_keys_the_cached_build(monkeypatch, tmp_path):
    """The library is compiled from SOURCES and cached under a hash of SOURCES and HEADERS: every C file beside the
    binding is a source, every header one includes is listed, and a change to any one file names another build."""
    folder = Path(cpu_gemm.__file__).parent
    assert set(cpu_gemm.SOURCES) == set(folder.glob("*.c")) and set(cpu_gemm.HEADERS) == set(folder.glob("*.h"))
    files = cpu_gemm.SOURCES + cpu_gemm.HEADERS
    included = {name for path in files for name in re.findall(r'^#include "(.+)"', path.read_text(), re.M)}
    assert included == {path.name for path in cpu_gemm.HEADERS}
    copies = [tmp_path / path.name for path in files]
    for path, copy in zip(files, copies, strict=True):
        copy.write_bytes(path.read_bytes())
    monkeypatch.setattr(cpu_gemm, "SOURCES", copies[:len(cpu_gemm.SOURCES)])
    monkeypatch.setattr(cpu_gemm, "HEADERS", copies[len(cpu_gemm.SOURCES):])
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    flags = cpu_gemm._BASE_FLAGS + ["-fopenmp"]
    names = {cpu_gemm.library_path("cc", flags)}
    for copy in copies:
        text = copy.read_bytes()
        copy.write_bytes(text + b"\n")
        names.add(cpu_gemm.library_path("cc", flags))
        copy.write_bytes(text)
    assert len(names) == len(copies) + 1 and cpu_gemm.library_path("cc", flags) in names
    assert cpu_gemm.library_path("cc", flags[:-1]) not in names  # the flags too


def test_simd_flags_follow_the_cpu(monkeypatch, caplog):
    assert cpu_gemm.simd_flags({"avx2", "fma", "f16c", "sse4_2"}) == ["-mavx2", "-mfma", "-mf16c"]
    assert cpu_gemm.simd_flags({"avx2", "sse4_2"}) == []  # no FMA: the portable code
    avx512 = {"avx2", "fma", "f16c", "avx512f", "avx512vl", "avx512bw", "avx512_vnni", "avx_vnni"}
    assert cpu_gemm.simd_flags(avx512) == ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512vl", "-mavx512bw",
                                           "-mavx512vnni", "-mavxvnni", "-mprefer-vector-width=256"]
    assert "-mavx512vnni" not in cpu_gemm.simd_flags(avx512 - {"avx512bw"})  # VNNI on ymm needs AVX-512 VL/BW
    assert cpu_gemm.simd_flags(avx512, isa="avx2") == ["-mavx2", "-mfma", "-mf16c"]
    monkeypatch.setenv("LLMD_CPU_ISA", "avx2")
    assert cpu_gemm.simd_flags(avx512) == ["-mavx2", "-mfma", "-mf16c"]
    monkeypatch.setenv("LLMD_CPU_ISA", "avx9000")
    with caplog.at_level(logging.WARNING, logger="llmd.kernels.cpu_gemm"):
        assert "-mavx512vnni" in cpu_gemm.simd_flags(avx512)
    assert "LLMD_CPU_ISA='avx9000' is not auto or avx2" in caplog.text
    assert "-march=native" not in cpu_gemm.simd_flags()


# ---- the integer path (activations quantized to int8 per block of 32) ----------------------------------------------

Q8_CASES = [("int4", 37, 128, 32), ("int4", 13, 192, 64), ("int4", 41, 256, 128), ("int4", 9, 96, 96),
            ("int8", 37, 96, 96), ("int8", 40, 128, 32), ("int8", 33, 192, 64), ("int8", 19, 256, 128)]


def _q8_case(kind, n, k, group):
    if kind == "int4":
        q, s, z = _int4(n, k, group)
        return (lambda x, **kw: cpu_gemm.int4_matmul_q8(x, q, s, z, group, **kw),
                lambda x: cpu_gemm.int4_matmul_q8_ref(x, q, s, z, group), qmm.dequantize_int4(q, s, z, group))
    q, s = _int8(n, k, group)
    q[0, :5] = -128  # the most negative code survives the sign transfer
    return (lambda x, **kw: cpu_gemm.int8_matmul_q8(x, q, s, group, **kw),
            lambda x: cpu_gemm.int8_matmul_q8_ref(x, q, s, group), qmm.dequantize_int8(q, s, group))


def test_activation_quantization_reference():
    x = _x(3, 64)
    x[1, :32] = 0.0  # an all-zero block stays zero
    xq = cpu_gemm.quantize_activations_ref(x)
    assert torch.equal(xq[1, :32], torch.zeros(32))
    blocks, deq = x.view(3, 2, 32), xq.view(3, 2, 32)
    step = blocks.abs().amax(-1, keepdim=True) / 127
    assert ((deq - blocks).abs() <= step / 2 * (1 + 1e-6)).all()
    codes = torch.where(step > 0, deq / step, torch.zeros_like(deq))
    torch.testing.assert_close(codes, codes.round(), rtol=0, atol=1e-4)  # on the grid, within [-127, 127]
    assert codes.abs().max() <= 127 + 1e-4


@pytest.mark.parametrize("kind,n,k,group", Q8_CASES)
def test_q8_matches_its_reference(kind, n, k, group):
    mm, ref, _ = _q8_case(kind, n, k, group)
    for m in ROWS:
        x = _x(m, k, seed=m)
        out = mm(x)
        if not HAVE_KERNEL:
            assert out is None
            continue
        # same quantized activations, exact integer block sums: only fp32 rounding of the scale products differs
        _check_close(out, ref(x))


@pytest.mark.parametrize("kind,n,k,group", Q8_CASES[:4] + Q8_CASES[5:6])
def test_q8_error_is_within_the_activation_rounding_bound(kind, n, k, group):
    """Against fp32 activations: each activation moves by at most half its block's step d / 2 = amax / 254, so
    |y_q8 - y_fp32| <= sum_k (d_k / 2) |w_k| (plus fp32 rounding); and it is much smaller on average."""
    if not HAVE_KERNEL:
        return
    mm, _, w = _q8_case(kind, n, k, group)
    x = _x(64, k, seed=3)
    err = (mm(x) - x @ w.t()).abs()
    half_step = (x.view(64, k // 32, 32).abs().amax(-1, keepdim=True) / 254).expand(64, k // 32, 32).reshape(64, k)
    bound = half_step @ w.abs().t()
    assert (err <= bound * 1.001 + 1e-4).all()
    assert err.mean() < 0.1 * bound.mean()  # rounding errors mostly cancel


@pytest.mark.parametrize("kind,n,k,group", [("int4", 45, 192, 64), ("int4", 45, 192, 32), ("int8", 45, 192, 192),
                                            ("int8", 45, 192, 32)])
def test_q8_row_results_do_not_depend_on_the_batch(kind, n, k, group):
    """A row's quantization and its sums are the same whatever M, tile, remainder or thread count: bitwise."""
    if not HAVE_KERNEL:
        return
    mm, _, _ = _q8_case(kind, n, k, group)
    x = _x(70, k)
    full = mm(x)
    for i in (0, 5, 69):
        assert torch.equal(mm(x[i:i + 1]), full[i:i + 1])
    for m in (2, 3, 4, 5, 9, 17, 64):
        assert torch.equal(mm(x[70 - m:]), full[70 - m:])
    picked = [3, 40, 7, 66, 12]
    assert torch.equal(mm(x[picked]), full[picked])
    assert torch.equal(mm(x, threads=1), full) and torch.equal(mm(x, threads=3), full)


def test_q8_scalar_build_computes_the_same_math(tmp_path, monkeypatch):
    """The portable code (built without SIMD flags) gives the integer path's results too."""
    if not HAVE_KERNEL:
        return
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    lib = cpu_gemm._bind(cpu_gemm._build(cpu_gemm._compiler(), cpu_gemm._BASE_FLAGS))
    assert lib.llmd_cpu_gemm_simd() == 0
    q4, s4, z4 = _int4(21, 192, 64)
    q8, s8 = _int8(21, 192, 32)
    x = _x(6, 192)
    _check_close(cpu_gemm._int4_q8(lib, x, q4, s4, z4, 64, 2), cpu_gemm.int4_matmul_q8_ref(x, q4, s4, z4, 64))
    _check_close(cpu_gemm._int8_q8(lib, x, q8, s8, 32, 2), cpu_gemm.int8_matmul_q8_ref(x, q8, s8, 32))
    assert torch.equal(cpu_gemm._int4_q8(lib, x[2:3], q4, s4, z4, 64, 1),
                       cpu_gemm._int4_q8(lib, x, q4, s4, z4, 64, 2)[2:3])


def test_avx2_build_equals_the_default_build_bit_for_bit(tmp_path, monkeypatch):
    """Built with AVX2/FMA/F16C only, the int8/int4 kernels on both paths give the default build's bits (which, on a
    CPU with AVX-512 and VNNI, uses vpdpbusd and 32 vector registers)."""
    if not HAVE_KERNEL or not cpu_gemm.simd_flags():
        return
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    avx2 = cpu_gemm._bind(cpu_gemm._build(cpu_gemm._compiler(), cpu_gemm._BASE_FLAGS + cpu_gemm.simd_flags()[:3]
                                          + ["-fopenmp"]))
    default = cpu_gemm.load()
    q4, s4, z4 = _int4(37, 256, 64)
    q8, s8 = _int8(37, 256, 32)
    x = _x(19, 256)
    for q8_act in (False, True):
        assert torch.equal(cpu_gemm._int4(avx2, x, q4, s4, z4, 64, 2, q8_act),
                           cpu_gemm._int4(default, x, q4, s4, z4, 64, 2, q8_act))
        assert torch.equal(cpu_gemm._int8(avx2, x, q8, s8, 32, 2, q8_act), cpu_gemm._int8(default, x, q8, s8, 32, 2, q8_act))


def test_q8_rejects_bad_shapes():
    q, s, z = _int4(8, 64, 32)
    assert not cpu_gemm.supports_q8(100, 100) and not cpu_gemm.supports_q8(64, 16) and cpu_gemm.supports_q8(96, 96)
    if not HAVE_KERNEL:
        return
    with pytest.raises(ValueError, match="shape"):
        cpu_gemm.int4_matmul_q8(_x(2, 32), q, s, z, 32)
    assert cpu_gemm.int4_matmul_q8(_x(2, 64), q, s, z, 16) is None  # groups of 16: not this path
    assert cpu_gemm.int4_matmul_q8(_x(0, 64), q, s, z, 32).shape == (0, 8)


KINDS = ("int8", "int4", "gguf", "gguf_head")


def test_activation_mode_per_kind_and_forced(monkeypatch, caplog):
    """Unset or auto: GGUF blocks take the integer path (llama.cpp's numerics), a GGUF output head int16 activations
    and llmd's int8/int4 fp32 ones; fp32 / int8 force one path for every kind; anything else warns and means auto."""
    cpu_gemm._activation_mode.cache_clear()  # it warns once per value
    for value in (None, "auto", "int4"):
        if value is None:
            monkeypatch.delenv("LLMD_CPU_GEMM_ACT", raising=False)
        else:
            monkeypatch.setenv("LLMD_CPU_GEMM_ACT", value)
        with caplog.at_level("WARNING", logger="llmd.kernels.cpu_gemm"):
            assert [cpu_gemm.activations(k) for k in KINDS] == ["fp32", "fp32", "int8", "int16"]
    assert "LLMD_CPU_GEMM_ACT='int4' is not auto, fp32 or int8" in caplog.text
    for value in ("fp32", "int8"):
        monkeypatch.setenv("LLMD_CPU_GEMM_ACT", value)
        assert [cpu_gemm.activations(k) for k in KINDS] == [value] * 4
