"""Fused dequant-matmul kernels (llmd.kernels.quant_matmul) against their torch references.

Without CUDA these run under the Triton interpreter on tiny shapes (see tests/kernel_testing.py)."""

from __future__ import annotations

import pytest
import torch

from kernel_testing import DEVICE, HAS_CUDA, load_kernel_module

qm = load_kernel_module("quant_matmul")
DTYPES = [torch.float32, torch.float16]


def _int4_weights(n: int, k: int, group: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    s = torch.rand(n, k // group, generator=g) * 0.05 + 0.01
    z = torch.randn(n, k // group, generator=g) * 0.05
    return q.to(DEVICE), s.to(DEVICE), z.to(DEVICE)


def _int8_weights(n: int, k: int, group: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    s = torch.rand(n, k // group, generator=g) * 0.01 + 0.001
    return q.to(DEVICE), s.to(DEVICE)


def _close(out, ref, dtype):
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    scale = ref.float().abs().max().clamp_min(1.0)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert ((out.float() - ref.float()).abs().max() / scale) < tol


def test_pack_roundtrip():
    values = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    packed = qm.pack_int4(values)
    assert packed.shape == (5, 32)
    assert torch.equal(qm.unpack_int4(packed), values)
    assert int(packed[0, 0]) == int(values[0, 0]) | (int(values[0, 1]) << 4)  # low nibble = even k


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,group", [(1, 48, 96, 32), (5, 40, 128, 64), (20, 33, 256, 128), (3, 64, 64, 64)])
def test_int4_matmul_matches_reference(dtype, m, n, k, group):
    q, s, z = _int4_weights(n, k, group)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    _close(qm.int4_matmul(x, q, s.to(dtype), z.to(dtype), group), qm.int4_matmul_ref(x, q, s.to(dtype), z.to(dtype), group),
           dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,group", [(1, 48, 96, 96), (7, 40, 128, 128), (2, 48, 96, 32), (17, 20, 64, 32)])
def test_int8_matmul_matches_reference(dtype, m, n, k, group):
    """group == k is per-channel (scale applied after the dot); group 32 is GGUF Q8_0."""
    q, s = _int8_weights(n, k, group)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    _close(qm.int8_matmul(x, q, s.to(dtype), group), qm.int8_matmul_ref(x, q, s.to(dtype), group), dtype)


@pytest.mark.parametrize("cfg", [
    dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, SPLIT_K=1),  # K=192 ends in a partial K tile
    dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=64, SPLIT_K=3),  # split-K with an uneven share of tiles
    dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, SPLIT_K=1),  # GEMM-style tile, M and N partial
])
def test_explicit_tilings_partial_tiles(cfg):
    m, n, k, group = 19, 40, 192, 32
    x = torch.randn(m, k, device=DEVICE)
    q, s, z = _int4_weights(n, k, group, seed=1)
    extra = dict(NG=k // group, const=dict(GROUP=group))
    out = qm._run(qm._int4_mm_kernel, (x, q, s, z), x, n, extra, cfg, {})
    _close(out, qm.int4_matmul_ref(x, q, s, z, group), torch.float32)
    q8, s8 = _int8_weights(n, k, group, seed=2)
    extra = dict(NG=k // group, const=dict(GROUP=group, PER_CHANNEL=False))
    out = qm._run(qm._int8_mm_kernel, (x, q8, s8), x, n, extra, cfg, {})
    _close(out, qm.int8_matmul_ref(x, q8, s8, group), torch.float32)


def test_rejects_wrong_input_width():
    q, s, z = _int4_weights(16, 64, 32)
    with pytest.raises(ValueError, match=r"\[M, 64\]"):
        qm.int4_matmul(torch.randn(2, 32, device=DEVICE), q, s, z, 32)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [4, 200])
def test_every_autotune_candidate_computes_the_matmul_on_gpu(m):
    """Autotuning keeps the fastest tiling without looking at its output, so each candidate must be right (a shape
    of test_real_shapes_on_gpu: the same compiled kernels)."""
    n = k = 4096
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    q, s, z = _int4_weights(n, k, 128)
    s, z = s.to(torch.bfloat16), z.to(torch.bfloat16)
    ref = qm.int4_matmul_ref(x, q, s, z, 128).float()
    extra = dict(NG=k // 128, const=dict(GROUP=128))
    tried = 0
    for cfg, launch in qm.candidates(m, k, 128, False):
        try:
            out = qm._run(qm._int4_mm_kernel, (x, q, s, z), x, n, extra, cfg, launch)
        except Exception:  # a tiling this device cannot run is skipped by autotuning too
            continue
        tried += 1
        assert ((out.float() - ref).abs().max() / ref.abs().max()) < 2e-2, cfg
    assert tried > 0


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 16, 32, 200])
@pytest.mark.parametrize("n,k", [(4096, 4096), (14336, 4096), (4096, 14336), (18944, 3584)])
def test_real_shapes_on_gpu(m, n, k):
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    q, s, z = _int4_weights(n, k, 128)
    s, z = s.to(torch.bfloat16), z.to(torch.bfloat16)
    ref = qm.int4_matmul_ref(x, q, s, z, 128)
    out = qm.int4_matmul(x, q, s, z, 128)
    assert ((out.float() - ref.float()).abs().max() / ref.float().abs().max()) < 2e-2
    q8, s8 = _int8_weights(n, k, k)
    ref = qm.int8_matmul_ref(x, q8, s8.to(torch.bfloat16), k)
    out = qm.int8_matmul(x, q8, s8.to(torch.bfloat16), k)
    assert ((out.float() - ref.float()).abs().max() / ref.float().abs().max()) < 2e-2
