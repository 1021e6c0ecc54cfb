"""Qwen3.5 and Qwen3.5-MoE from llama.cpp GGUF files (llmd.model.gguf_hybrid) against transformers on CPU fp32
through the single-sequence driver (a prompt of 40 tokens fed as two chunks, then 24 decode steps); from their HF
folders they are tests/test_hybrid.py's (tiny_models.HYBRID_KINDS). The files are written as llama.cpp's converter
writes them (tests/tiny_models.py: value heads tiled, A = -exp(A_log), the conv squeezed, norms + 1, experts
stacked); Q8_0 files are compared with transformers on the very values they hold (round_to_gguf), dequantized and
packed (on the exact-weights activation path). Then the bad files: each is refused before any weight is read (a
decay that is not negative: as it is read) by a ModelFileError naming the file and the tensor.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from llmd.model.loader import load_model
from llmd.model.moe import Experts
from llmd.model.quant.gguf_experts import GGUFExpertLinear
from llmd.model.quant.gguf_layers import GGUFLinear
from test_families import TOLERANCE, _refusal, _rewrite, our_logits, prompt_ids, reference_logits
from tiny_models import round_to_gguf, write_tiny_gguf, write_tiny_model

KINDS = ("qwen3_5", "qwen3_5_moe")
TYPES = ("F32", "Q8_0")
ARCHITECTURE = {"qwen3_5": "Qwen3_5ForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hybrid_models")
    return {kind: write_tiny_model(root / kind, kind) for kind in KINDS}


@pytest.fixture(scope="module")
def ggufs(folders, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hybrid_ggufs")
    return {(kind, t): write_tiny_gguf(folders[kind], root / f"{kind}-{t}.gguf", t) for kind in KINDS for t in TYPES}


@pytest.fixture(scope="module")
def expected(folders, tmp_path_factory) -> dict:
    """transformers' logits per (kind, type): on the folder (F32), on its copy rounded to what the file holds."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("hybrid_rounded")
    out = {}
    for (kind, t) in [(kind, t) for kind in KINDS for t in TYPES]:
        folder = folders[kind] if t == "F32" else round_to_gguf(folders[kind], root / f"{kind}-{t}", t)
        ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        out[kind, t] = reference_logits(ref, prompt_ids(40), prompt_ids(24, seed=1))
    return out


def logits_of(lm) -> torch.Tensor:
    return our_logits(lm, prompt_ids(40), prompt_ids(24, seed=1))


@pytest.mark.parametrize("quant", ["none", "gguf"])
@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_gguf_matches_transformers(kind, t, quant, ggufs, expected, monkeypatch):
    """quant none: every tensor dequantized; gguf: the file's blocks kept (the Gated DeltaNet's projections and the
    experts too), computed with fp32 activations."""
    monkeypatch.setenv("LLMD_CPU_GEMM_ACT", "fp32")
    lm = load_model(ggufs[kind, t], dtype=torch.float32, device="cpu", quant=quant)
    config = lm.config
    assert config.architecture == ARCHITECTURE[kind]
    assert config.recurrent is not None and config.recurrent.tiled_value_heads
    assert config.layer_types == ["linear_attention"] * 3 + ["full_attention"] and config.rotary_dim == 4
    layers = lm.model.model.layers
    if t == "Q8_0" and quant == "gguf":
        deltanet = layers[0].linear_attn
        assert all(isinstance(p, GGUFLinear) and p.file_type == "Q8_0"
                   for p in (deltanet.in_proj_qkv, deltanet.in_proj_z, deltanet.in_proj_b, deltanet.out_proj))
        if kind == "qwen3_5_moe":
            assert isinstance(layers[0].mlp.experts.gate_up_proj, GGUFExpertLinear)
    if kind == "qwen3_5_moe":
        assert all(isinstance(layer.mlp.experts, Experts) for layer in layers)
    diff = (logits_of(lm) - expected[kind, t]).abs().max().item()
    assert diff < TOLERANCE, f"{kind} {t} ({quant}): max |logit difference| {diff:.2e}"


def test_multi_token_prediction_block_is_left_unread(ggufs, expected, tmp_path):
    """A file with the MTP block after the decoder (nextn_predict_layers, counted in block_count) runs the decoder."""
    path = _rewrite(ggufs["qwen3_5", "F32"], tmp_path / "mtp.gguf",
                    meta={"qwen35.block_count": 5, "qwen35.nextn_predict_layers": 1},
                    extra={"blk.4.attn_norm.weight": np.ones(64, np.float32),
                           "blk.4.nextn.eh_proj.weight": np.zeros((64, 128), np.float32)})
    lm = load_model(path, dtype=torch.float32, device="cpu")
    assert lm.config.num_hidden_layers == 4
    assert (logits_of(lm) - expected["qwen3_5", "F32"]).abs().max().item() < TOLERANCE


@pytest.mark.parametrize("case,tensor,problem", [
    ("kernel", "blk.0.ssm_conv1d.weight", "has shape [64, 4], expected [64, 3]"),
    ("decay shape", "blk.1.ssm_a", "has shape [3], expected [4]"),
    ("no conv", "blk.1.ssm_conv1d.weight", "is missing: layer 1 is a Gated DeltaNet layer"),
    ("no decay", "blk.2.ssm_a", "is missing: layer 2 is a Gated DeltaNet layer"),
    ("pattern", "blk.1.attn_qkv.weight", "does not belong where it is: layer 1 is a full-attention layer by "
                                         "full_attention_interval 2"),
    ("positive decay", "blk.0.ssm_a", "holds a decay A that is not a negative finite number"),
])
def test_bad_qwen35_files_are_refused_naming_the_tensor(case, tensor, problem, ggufs, tmp_path):
    src = ggufs["qwen3_5", "F32"]
    path = tmp_path / "bad.gguf"
    if case == "kernel":
        _rewrite(src, path, meta={"qwen35.ssm.conv_kernel": 3})
    elif case == "decay shape":
        _rewrite(src, path, change={tensor: -np.ones(3, np.float32)})
    elif case in ("no conv", "no decay"):
        _rewrite(src, path, drop=(tensor,))
    elif case == "pattern":
        _rewrite(src, path, meta={"qwen35.full_attention_interval": 2})
    else:
        _rewrite(src, path, change={tensor: np.array([-1.0, 0.5, -2.0, -3.0], np.float32)})
    message = _refusal(path)
    assert f"tensor {tensor!r}" in message and problem in message, message


def test_qwen35moe_layer_without_router_is_refused(ggufs, tmp_path):
    path = _rewrite(ggufs["qwen3_5_moe", "F32"], tmp_path / "router.gguf", drop=("blk.2.ffn_gate_inp.weight",))
    message = _refusal(path)
    assert "'blk.2.ffn_gate_inp.weight' is missing" in message, message
