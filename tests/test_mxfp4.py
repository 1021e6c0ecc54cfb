"""gpt-oss's Hugging Face MXFP4 tensors (`*_blocks`, `*_scales`) rearranged into GGUF MXFP4 block rows
(llmd.model.quant.mxfp4): gguf's dequantization of the rows is transformers' dequantization of the checkpoint's
tensors bit for bit, at every valid exponent; a GGUFLinear filled with one expert's rows computes with that expert's
weight; a scale of 255 (E8M0's NaN) and misshapen tensors are refused naming the tensor."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from llmd.errors import ModelFileError
from llmd.kernels import gguf_blocks as gb
from llmd.model.quant import GGUFLinear, mxfp4_blocks_from_hf

SOURCE = "gpt-oss/model-00001-of-00002.safetensors"
NAME = "model.layers.0.mlp.experts.gate_up_proj"


def hf_tensors(experts: int, out: int, k: int, seed: int = 0, low: int = 118, high: int = 124):
    """Random `_blocks` uint8 [E, out, k/32, 16] and `_scales` [E, out, k/32] (exponents low..high-1, bias 127)."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (experts, out, k // 32, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(low, high, (experts, out, k // 32), dtype=torch.uint8, generator=g)
    return blocks, scales


def transformers_weight(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """transformers' dequantization, fp32, back in [E, out, in] (it returns the experts' weights as [E, in, out])."""
    return convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)


def _bits(t) -> np.ndarray:
    return (np.asarray(t, dtype=np.float32) + np.float32(0.0)).view(np.uint32)  # -0 (code 8) and +0 alike


def test_rows_dequantize_to_transformers_values_at_every_exponent():
    blocks, scales = hf_tensors(3, 40, 256)
    scales.view(-1)[:255] = torch.arange(255, dtype=torch.uint8)  # every valid E8M0 byte, 0 and 254 included
    rows = mxfp4_blocks_from_hf(blocks, scales, NAME, SOURCE)
    assert rows.dtype == torch.uint8 and rows.shape == (3, 40, gb.row_bytes("MXFP4", 256))
    want = transformers_weight(blocks, scales)
    with np.errstate(over="ignore"):  # 6 * 2^127 is inf on both sides
        got = gguf_dequantize(rows.reshape(120, -1).numpy(), gguf.GGMLQuantizationType.MXFP4).reshape(3, 40, 256)
    assert np.array_equal(_bits(got), _bits(want.numpy()))
    assert np.isinf(got).any() and (got != 0).any()  # the range's ends were there
    # llmd's own reference reads the same values
    assert np.array_equal(_bits(gb.dequantize_blocks(rows.reshape(120, -1), "MXFP4").reshape(3, 40, 256)), _bits(got))


def test_a_weight_without_the_expert_dimension():
    blocks, scales = hf_tensors(1, 24, 96, seed=1)
    rows = mxfp4_blocks_from_hf(blocks[0], scales[0], NAME, SOURCE, shape=(24, 96))
    assert rows.shape == (24, 3 * 17)
    assert torch.equal(rows, mxfp4_blocks_from_hf(blocks, scales, NAME, SOURCE)[0])


def test_an_experts_rows_fill_a_gguf_layer_that_computes_with_its_weight(monkeypatch):
    """The HF form and a GGUF file share one layer: one expert's rows in a GGUFLinear give x @ W_e.T (fp32
    activations: the exact weights; the default int8 path adds its activation rounding only)."""
    monkeypatch.setenv("LLMD_CPU_GEMM_ACT", "fp32")
    blocks, scales = hf_tensors(4, 48, 192, seed=2)
    rows = mxfp4_blocks_from_hf(blocks, scales, NAME, SOURCE, shape=(4, 48, 192))
    weight = transformers_weight(blocks, scales)
    x = torch.randn(5, 192, generator=torch.Generator().manual_seed(3))
    for e in (0, 3):
        layer = GGUFLinear(192, 48, "MXFP4")
        layer.fill(rows[e], f"{NAME}[{e}]", SOURCE)
        torch.testing.assert_close(layer(x), x @ weight[e].t(), rtol=1e-4, atol=1e-4)


def _refused(blocks, scales, **kw) -> str:
    with pytest.raises(ModelFileError) as info:
        mxfp4_blocks_from_hf(blocks, scales, NAME, SOURCE, **kw)
    message = str(info.value)
    assert message.startswith(SOURCE)
    return message


def test_the_e8m0_nan_is_refused_naming_the_tensor_and_the_block():
    blocks, scales = hf_tensors(2, 8, 64)
    scales[1, 5, 1] = 255
    scales[0, 0, 0] = 255
    message = _refused(blocks, scales)
    assert f"'{NAME}_scales'" in message and "255" in message and "[0, 0, 0]" in message and "1 more" in message


def test_misshapen_tensors_are_refused_naming_the_tensor():
    blocks, scales = hf_tensors(2, 8, 64)
    message = _refused(blocks[..., :15], scales)
    assert f"'{NAME}_blocks'" in message and "[2, 8, 2, 15]" in message
    message = _refused(blocks, scales[:, :7])
    assert f"'{NAME}_scales'" in message and "[2, 7, 2]" in message and "[2, 8, 2]" in message
    message = _refused(blocks[0, 0], scales[0, 0])  # [2, 16]: no rows
    assert f"'{NAME}_blocks'" in message
    message = _refused(blocks.view(torch.int8), scales)
    assert f"'{NAME}_blocks'" in message and "torch.int8" in message
    message = _refused(blocks, scales.float())
    assert f"'{NAME}_scales'" in message and "torch.float32" in message
    message = _refused(blocks, scales, shape=(2, 8, 96))  # the layer expects another in_features
    assert f"'{NAME}_blocks'" in message and "[2, 8, 64]" in message and "[2, 8, 96]" in message
