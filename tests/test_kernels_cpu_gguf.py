"""The compiled CPU matmul straight from GGUF blocks (llmd.kernels.cpu_gemm.gguf_matmul, GGUFKernel): it multiplies
the blocks' integer codes and applies each sub-block's scale and offset once, yet one-hot activations still pick out
the reference's weights (llmd.kernels.gguf_blocks, itself gguf's) bit for bit, on every path (one row, row tiles, rows
in vector lanes); the C dequantize is the reference's in the portable build too; its products match the torch
reference; a row's output is bitwise the same whatever the batch, its position and the thread count. The integer path
(GGUFKernel(act="int8"), LLMD_CPU_GEMM_ACT=int8: activations quantized to int8 per block of 32) matches its torch
reference (gguf_matmul_q8_ref) for every type, and is bitwise the same whatever the batch, row, threads and parts;
the interleaved Q4_K, Q6_K and IQ4_XS (test_kernels_cpu_interleaved.py) give the same bits in every build.
The output head's path (act="int16": int16 activations, Q8_0 and Q6_K) matches gguf_matmul_q16_ref, is far closer
to fp32 activations than int8 is, and gives the same bits in every build and batch.

Where no C compiler exists the functions return None; the tests then check that branch instead of skipping."""

from __future__ import annotations

import pytest
import torch
from test_gguf_blocks import random_blocks

from llmd.kernels import cpu_gemm
from llmd.kernels import gguf_blocks as gb

HAVE_KERNEL = cpu_gemm.available()
TYPES = list(gb.BLOCKS)
ROWS = [1, 2, 3, 4, 5, 8, 9, 16, 17, 33, 70]


def _weights(type_name: str, n: int = 29, k: int | None = None, seed: int = 0) -> tuple[torch.Tensor, int]:
    elems = gb.BLOCKS[type_name][0]
    k = k or (2 * elems if elems == 256 else 6 * elems)
    return torch.from_numpy(random_blocks(type_name, n, k, seed=seed, scale=0.002)), k


def _x(m: int, k: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return (t + 0.0).view(torch.int32)  # + 0.0: -0 and +0 are one value of a product sum


def _rows_independent_of_the_batch(mm, x: torch.Tensor) -> torch.Tensor:
    """mm(x), after checking that each row's result is the same alone, in batches of every size the kernels tile
    differently, at any position and in any order."""
    full, n = mm(x), x.shape[0]
    for i in (0, 5, n - 1):
        assert torch.equal(mm(x[i:i + 1]), full[i:i + 1])
    for m in (2, 3, 4, 5, 9, 16, 17, 64):
        assert torch.equal(mm(x[n - m:]), full[n - m:])
    picked = [3, 40, 7, n - 4, 12]
    assert torch.equal(mm(x[picked]), full[picked])
    return full


@pytest.mark.parametrize("type_name", TYPES)
def test_c_dequantize_is_the_reference_bit_for_bit(type_name):
    q, k = _weights(type_name)
    got = cpu_gemm.gguf_dequantize(q, type_name)
    if not HAVE_KERNEL:
        assert got is None
        return
    assert torch.equal(got.view(torch.int32), gb.dequantize_blocks(q, type_name).view(torch.int32))


@pytest.mark.parametrize("type_name", TYPES)
def test_weights_inside_the_matmul_are_the_reference_values(type_name):
    """One-hot activations pick single weights out of the matmul: y[m, n] = w[n, k_m] exactly, on each path."""
    q, k = _weights(type_name, n=21)
    ref = gb.dequantize_blocks(q, type_name)
    picks = torch.randperm(k, generator=torch.Generator().manual_seed(2))
    for m in (1, 4, k):  # one row, row tiles, rows in vector lanes
        cols = picks[:m] if m < k else torch.arange(k)
        x = torch.zeros(m, k)
        x[torch.arange(m), cols] = 1.0
        y = cpu_gemm.gguf_matmul(x, q, type_name)
        if not HAVE_KERNEL:
            assert y is None
            return
        assert torch.equal(_bits(y), _bits(ref[:, cols].t().contiguous()))


@pytest.mark.parametrize("type_name", TYPES)
def test_matches_reference(type_name):
    q, k = _weights(type_name, n=37)
    w = gb.dequantize_blocks(q, type_name)
    for m in ROWS:
        x = _x(m, k, seed=m)
        y = cpu_gemm.gguf_matmul(x, q, type_name)
        if not HAVE_KERNEL:
            assert y is None
            return
        torch.testing.assert_close(y, x @ w.t(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q5_0", "Q8_0", "Q5_K", "Q4_0", "IQ4_XS", "Q2_K", "MXFP4"])
def test_row_results_do_not_depend_on_the_batch(type_name):
    if not HAVE_KERNEL:
        return
    q, k = _weights(type_name, n=45)

    def mm(x, threads=None):
        return cpu_gemm.gguf_matmul(x, q, type_name, threads=threads)

    x = _x(70, k)
    full = _rows_independent_of_the_batch(mm, x)
    assert torch.equal(mm(x, threads=1), full) and torch.equal(mm(x, threads=3), full)
    assert torch.equal(mm(x[:1], threads=3), full[:1]) and torch.equal(mm(x[:7], threads=2), full[:7])


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "IQ4_NL", "MXFP4"])
def test_rows_of_an_odd_number_of_blocks(type_name):
    """K = 7 blocks of 32: a last chunk of fewer than 8 blocks, and for Q4_0 / Q4_1 (two blocks per unit) a block
    that pairs with zero codes."""
    if not HAVE_KERNEL:
        return
    q, k = _weights(type_name, n=23, k=7 * 32)
    w = gb.dequantize_blocks(q, type_name)
    x = _x(40, k)
    full = cpu_gemm.gguf_matmul(x, q, type_name)
    torch.testing.assert_close(full, x @ w.t(), rtol=1e-4, atol=1e-4)
    for m in (1, 3, 16):
        assert torch.equal(cpu_gemm.gguf_matmul(x[:m], q, type_name), full[:m])
    one_hot = torch.eye(k)[[0, 100, 223]]
    assert torch.equal(_bits(cpu_gemm.gguf_matmul(one_hot, q, type_name)), _bits(w[:, [0, 100, 223]].t().contiguous()))


def test_mxfp4_scales_at_every_exponent_on_both_paths():
    """Column n's blocks all have E8M0 byte n (0..160: ggml's subnormal scales at 0 and 1, then the powers of two),
    decoded as the reference does by the scalar and the vector code of every path (rows 1-3 in tiles, 5 in block
    pairs, 20 in lanes); activations of ~2^20 keep the products in fp32's normal range."""
    if not HAVE_KERNEL:
        return
    q, k = _weights("MXFP4", n=161, k=7 * 32)
    q.view(161, 7, 17)[:, :, 0] = torch.arange(161, dtype=torch.uint8)[:, None]
    w = gb.dequantize_blocks(q, "MXFP4")
    assert torch.equal(cpu_gemm.gguf_dequantize(q, "MXFP4").view(torch.int32), w.view(torch.int32))
    for m in (1, 3, 5, 20):
        x = _x(m, k, seed=m) * 2.0 ** 20
        for act, ref in (("fp32", x @ w.t()), ("int8", cpu_gemm.gguf_matmul_q8_ref(x, q, "MXFP4"))):
            y = cpu_gemm.gguf_matmul(x, q, "MXFP4", act=act)
            bound = 1e-5 * (x.abs() @ w.abs().t())  # fp32 rounding of the sums of products (2^n apart by column)
            assert (bound > 0).all() and ((y - ref).abs() <= bound).all(), (m, act)


def test_layer_kernel_is_prepared_once_and_dropped_by_a_fill():
    if not HAVE_KERNEL:
        return
    from llmd.model.quant import GGUFLinear

    q, k = _weights("Q4_K")
    layer = GGUFLinear(k, q.shape[0], "Q4_K")
    layer.fill(q, "w", "test")
    kernel = layer.prepare(torch.device("cpu"), torch.float32)
    assert isinstance(kernel, cpu_gemm.GGUFKernel)
    x = torch.randn(2, k)
    before = layer(x)
    assert torch.equal(before, kernel(x)) and layer.kernel is kernel
    layer.fill(q.flip(0).contiguous(), "w", "test")
    assert layer.kernel is None and torch.equal(layer(x), before.flip(-1))


def test_bad_shapes_raise():
    if not HAVE_KERNEL:
        return
    q, k = _weights("Q6_K")
    with pytest.raises(ValueError, match=r"\[M, 512\]"):
        cpu_gemm.gguf_matmul(_x(2, 256), q, "Q6_K")
    with pytest.raises(ValueError, match="do not hold"):
        cpu_gemm.GGUFKernel(cpu_gemm.load(), [(q[:, :-1], "Q6_K")], k)
    with pytest.raises(ValueError, match="'int4' is not fp32, int8 or int16"):
        cpu_gemm.GGUFKernel(cpu_gemm.load(), [(q, "Q6_K")], k, act="int4")


HEAD_TYPES = ["Q8_0", "Q6_K", "Q4_1"]  # the int16 path (output heads; Q4_1 layers)


@pytest.mark.parametrize("act,type_name", [("int8", t) for t in TYPES] + [("int16", t) for t in HEAD_TYPES])
def test_quantized_activation_paths_match_reference(act, type_name):
    """Every type on the integer path, Q8_0 and Q6_K on the head's int16 one; K of several chunks (and 7 blocks of 32
    for the small types: a last chunk of fewer units), every row count."""
    elems = gb.BLOCKS[type_name][0]
    reference = cpu_gemm.gguf_matmul_q8_ref if act == "int8" else cpu_gemm.gguf_matmul_q16_ref
    for k in ([3 * elems] if elems == 256 else [6 * elems, 7 * elems]):
        q, _ = _weights(type_name, n=37, k=k, seed=k)
        for m in ROWS:
            x = _x(m, k, seed=m)
            y = cpu_gemm.gguf_matmul(x, q, type_name, act=act)
            if not HAVE_KERNEL:
                assert y is None
                return
            ref = reference(x, q, type_name)
            # the same products in another order: fp32 rounding only (the outputs are up to a few hundred)
            scale = (2e-5 if act == "int8" else 2e-6) * ref.abs().max().item()
            torch.testing.assert_close(y, ref, rtol=1e-5, atol=scale)


def test_activation_quantization_is_the_kernels_bit_for_bit():
    """An activation that lands exactly on .5 (x * (127 / amax) = -117.5 with a correctly rounded division, -117.49999
    with 127 * (1 / amax), which is what torch makes of `127.0 / amax`): the reference rounds it as the kernel does.
    Q8_0 weights with one code 1 per column (d = 1) pick each quantized activation d_b * q out of the matmul."""
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 20] = -1.8828774690628052, 2.0351102352142334  # the value, and the block's amax
    amax = x.abs().amax()
    assert (x[0, 0] * (torch.full_like(amax, 127.0) / amax)).item() == -117.5
    ref = cpu_gemm.quantize_activations_ref(x)
    assert ref[0, 0] == -118 * (amax / 127.0)  # ties to even
    blocks = torch.zeros(32, 34, dtype=torch.uint8)
    blocks[:, 0:2] = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)
    blocks[torch.arange(32), 2 + torch.arange(32)] = 1
    y = cpu_gemm.gguf_matmul(x, blocks, "Q8_0", act="int8")
    if not HAVE_KERNEL:
        assert y is None
        return
    assert torch.equal(y, ref)


def test_integer_path_differs_from_fp32_activations_only_by_the_quantization():
    """The reference is not vacuous: fp32 activations give other values, int8-quantized ones give the kernel's."""
    if not HAVE_KERNEL:
        return
    q, k = _weights("Q4_K", n=16)
    x = _x(3, k)
    y, fp = cpu_gemm.gguf_matmul(x, q, "Q4_K", act="int8"), cpu_gemm.gguf_matmul(x, q, "Q4_K")
    ref = cpu_gemm.gguf_matmul_q8_ref(x, q, "Q4_K")
    assert (y - fp).abs().max() > 100 * (y - ref).abs().max()


@pytest.mark.parametrize("type_name", TYPES)
def test_integer_path_rows_do_not_depend_on_batch_threads_or_parts(type_name):
    if not HAVE_KERNEL:
        return
    q, k = _weights(type_name, n=45, k=512)
    other_type = "Q6_K" if type_name != "Q6_K" else "Q8_0"  # fused with parts of another type on either side
    other, _ = _weights(other_type, n=11, k=k, seed=3)
    lib = cpu_gemm.load()
    kernel = cpu_gemm.GGUFKernel(lib, [(q, type_name)], k, act="int8")
    fused = cpu_gemm.GGUFKernel(lib, [(other, other_type), (q, type_name), (other, other_type)], k, act="int8")
    assert kernel.act == fused.act == "int8"
    x = _x(70, k)
    full = _rows_independent_of_the_batch(kernel, x)
    for threads in (1, 2, 3):
        assert torch.equal(kernel(x, threads), full) and torch.equal(kernel(x[:7], threads), full[:7])
    both = fused(x, 2)  # a part's columns are its own matmul's, bit for bit
    assert torch.equal(both[:, 11:56], full)
    assert torch.equal(both[:, :11], both[:, 56:])
    assert torch.equal(fused(x[:1], 1), both[:1])


def test_integer_path_is_chosen_by_the_environment(monkeypatch):
    if not HAVE_KERNEL:
        return
    q, k = _weights("Q5_0")
    monkeypatch.setenv("LLMD_CPU_GEMM_ACT", "fp32")
    assert cpu_gemm.gguf_kernel([(q, "Q5_0")], k).act == "fp32"
    monkeypatch.delenv("LLMD_CPU_GEMM_ACT", raising=False)
    kernel = cpu_gemm.gguf_kernel([(q, "Q5_0")], k)
    assert kernel.act == "int8"  # the integer path by default, as llama.cpp computes GGUF blocks
    x = _x(4, k)
    assert torch.equal(kernel(x), cpu_gemm.gguf_matmul(x, q, "Q5_0", act="int8"))
    assert kernel(x[:0]).shape == (0, q.shape[0])
    assert cpu_gemm.GGUFKernel(cpu_gemm.load(), [(q, "Q5_0")], k, act="fp32").act == "fp32"


@pytest.mark.parametrize("type_name", HEAD_TYPES)
def test_head_path_is_256_times_closer_to_fp32_than_int8(type_name):
    """Why the head takes int16: its error from fp32 activations is that of int16 rounding, far below int8's."""
    if not HAVE_KERNEL:
        return
    q, k = _weights(type_name, n=64, k=512)
    x = _x(8, k)
    exact = x.double() @ gb.dequantize_blocks(q, type_name).double().t()
    err16 = (cpu_gemm.gguf_matmul(x, q, type_name, act="int16").double() - exact).abs().max().item()
    err8 = (cpu_gemm.gguf_matmul(x, q, type_name, act="int8").double() - exact).abs().max().item()
    assert 0 < err16 < err8 / 50


@pytest.mark.parametrize("type_name", HEAD_TYPES)
def test_head_path_rows_do_not_depend_on_batch_or_threads(type_name):
    if not HAVE_KERNEL:
        return
    q, k = _weights(type_name, n=45, k=512)
    kernel = cpu_gemm.GGUFKernel(cpu_gemm.load(), [(q, type_name)], k, act="int16")
    assert kernel.act == "int16"
    x = _x(70, k)
    full = _rows_independent_of_the_batch(kernel, x)
    for threads in (1, 2, 3):
        assert torch.equal(kernel(x, threads), full) and torch.equal(kernel(x[:7], threads), full[:7])


def test_int16_path_is_chosen_for_q8_0_and_q6_k_heads_and_q4_1_layers(monkeypatch):
    """By default a Q8_0, Q6_K or Q4_1 head takes int16 activations and any other head fp32; Q4_1 layers take int16
    too, other layers int8; LLMD_CPU_GEMM_ACT=fp32 or int8 chooses that path for the heads too."""
    if not HAVE_KERNEL:
        return
    monkeypatch.delenv("LLMD_CPU_GEMM_ACT", raising=False)
    for type_name in TYPES:
        q, k = _weights(type_name, n=8, k=512)
        want = "int16" if type_name in HEAD_TYPES else "fp32"
        assert cpu_gemm.gguf_kernel([(q, type_name)], k, head=True).act == want, type_name
        assert cpu_gemm.gguf_kernel([(q, type_name)], k).act == ("int16" if type_name == "Q4_1" else "int8")
        assert cpu_gemm.GGUFKernel(cpu_gemm.load(), [(q, type_name)], k, act="int16").act == want
    q, k = _weights("Q8_0", n=8, k=512)
    for mode in ("fp32", "int8"):
        monkeypatch.setenv("LLMD_CPU_GEMM_ACT", mode)
        assert cpu_gemm.gguf_kernel([(q, "Q8_0")], k, head=True).act == mode


def test_portable_build_computes_the_same_values(tmp_path, monkeypatch):
    """The scalar code (built without SIMD flags): the same dequantized values, products close to the reference and
    rows independent of the batch."""
    if not HAVE_KERNEL:
        return
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    lib = cpu_gemm._bind(cpu_gemm._build(cpu_gemm._compiler(), cpu_gemm._BASE_FLAGS + ["-fopenmp"]))
    assert lib.llmd_cpu_gemm_simd() == 0
    for type_name in TYPES:
        q, k = _weights(type_name, n=19)
        w = gb.dequantize_blocks(q, type_name)
        assert torch.equal(cpu_gemm._gguf_dequant(lib, q, type_name, k).view(torch.int32), w.view(torch.int32))
        kernel = cpu_gemm.GGUFKernel(lib, [(q, type_name)], k, act="fp32")
        x = _x(20, k)
        full = kernel(x, 2)
        torch.testing.assert_close(full, x @ w.t(), rtol=1e-4, atol=1e-4)
        assert torch.equal(kernel(x[3:4], 1), full[3:4])
        integer = cpu_gemm.GGUFKernel(lib, [(q, type_name)], k, act="int8")
        full = integer(x, 2)
        ref = cpu_gemm.gguf_matmul_q8_ref(x, q, type_name)
        torch.testing.assert_close(full, ref, rtol=1e-5, atol=2e-5 * ref.abs().max().item())
        assert torch.equal(integer(x[3:4], 1), full[3:4])
        if type_name in ("Q8_0", "IQ4_NL", "MXFP4"):  # the signed blocks' order in plain C: the vector build's bits
            vector = cpu_gemm.GGUFKernel(cpu_gemm.load(), [(q, type_name)], k, act="int8")
            assert torch.equal(_bits(full), _bits(vector(x, 2)))
        if type_name in HEAD_TYPES:  # the head path's lanes in plain C: the vector build's very bits
            head = cpu_gemm.GGUFKernel(lib, [(q, type_name)], k, act="int16")
            vector = cpu_gemm.GGUFKernel(cpu_gemm.load(), [(q, type_name)], k, act="int16")
            assert torch.equal(_bits(head(x, 2)), _bits(vector(x, 2)))
    for layout in gb.X8_OF:  # the interleaved layouts in plain C: the vector build's very bits
        q, k = _weights(gb.X8_OF[layout], n=16)
        packed, x = gb.x8_pack(q, layout), _x(5, k)
        plain = cpu_gemm.GGUFKernel(lib, [(packed, layout)], k, act="int8")(x, 2)
        assert torch.equal(_bits(plain), _bits(cpu_gemm.GGUFKernel(cpu_gemm.load(), [(packed, layout)], k)(x, 2)))
        if lib.llmd_gguf_q16_type(cpu_gemm.GGUF_TYPE_IDS[layout]):  # and on the int16 path (heads, Q4_1 layers)
            plain, vector = (cpu_gemm.GGUFKernel(b, [(packed, layout)], k, act="int16")(x, 2)
                             for b in (lib, cpu_gemm.load()))
            assert torch.equal(_bits(plain), _bits(vector))


def test_avx2_build_equals_the_default_build_bit_for_bit(tmp_path, monkeypatch):
    """Built with AVX2/FMA/F16C only (maddubs + madd, 16 vector registers), every type on both paths gives the very
    bits of the default build (on a CPU with AVX-512 and VNNI: vpdpbusd and 32 registers)."""
    if not HAVE_KERNEL or not cpu_gemm.simd_flags():
        return
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    avx2 = cpu_gemm._bind(cpu_gemm._build(cpu_gemm._compiler(), cpu_gemm._BASE_FLAGS + cpu_gemm.simd_flags()[:3]
                                          + ["-fopenmp"]))
    assert avx2.llmd_cpu_gemm_simd() == 1
    x = _x(21, 512)
    for type_name in TYPES:
        q, k = _weights(type_name, n=19, k=512)
        for act in ("fp32", "int8", "int16"):
            mine = cpu_gemm.GGUFKernel(avx2, [(q, type_name)], k, act=act)
            full = cpu_gemm.GGUFKernel(cpu_gemm.load(), [(q, type_name)], k, act=act)(x, 2)
            assert torch.equal(_bits(mine(x, 2)), _bits(full))
            for m in (1, 2, 3, 5, 9, 15):  # the row counts each build routes through other paths
                assert torch.equal(_bits(mine(x[:m], 1)), _bits(full[:m]))
    for layout in gb.X8_OF:
        q, k = _weights(gb.X8_OF[layout], n=32, k=512)
        packed = gb.x8_pack(q, layout)
        int16 = avx2.llmd_gguf_q16_type(cpu_gemm.GGUF_TYPE_IDS[layout])  # heads, Q4_1 layers
        for act in ("int8", "int16") if int16 else ("int8",):
            mine, full = (cpu_gemm.GGUFKernel(lib, [(packed, layout)], k, act=act) for lib in (avx2, cpu_gemm.load()))
            ours = _bits(mine(x, 2))
            for threads in (1, 2):  # 21 rows of 4 column groups: AVX-512's two-group tiles where it has them
                assert torch.equal(ours, _bits(full(x, threads)))
            for m in (1, 2, 3, 5):
                assert torch.equal(_bits(mine(x[:m], 1)), _bits(full(x[:m], 2)))
