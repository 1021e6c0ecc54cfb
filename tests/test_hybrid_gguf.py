"""Qwen3.5-MoE from its HF folder (and Qwen3.5's) against transformers on CPU fp32 through the single-sequence driver
(a prompt of 40 tokens fed as two chunks, then 24 decode steps).
"""

from __future__ import annotations

import pytest
import torch
from llmd.model.loader import load_model
from test_families import TOLERANCE, our_logits, prompt_ids, reference_logits
from tiny_models import write_tiny_model

KINDS = ("qwen3_5", "qwen3_5_moe")
ARCHITECTURE = {"qwen3_5": "Qwen3_5ForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hybrid_models")
    return {kind: write_tiny_model(root / kind, kind) for kind in KINDS}


@pytest.fixture(scope="module")
def expected(folders) -> dict:
    from transformers import AutoModelForCausalLM

    out = {}
    for kind in KINDS:
        ref = AutoModelForCausalLM.from_pretrained(folders[kind], dtype=torch.float32).eval()
        out[kind, "F32"] = reference_logits(ref, prompt_ids(40), prompt_ids(24, seed=1))
    return out


def logits_of(lm) -> torch.Tensor:
    return our_logits(lm, prompt_ids(40), prompt_ids(24, seed=1))


@pytest.mark.parametrize("kind", KINDS)
def test_hf_folder_matches_transformers(kind, folders, expected):
    lm = load_model(folders[kind], dtype=torch.float32, device="cpu")
    assert lm.config.architecture == ARCHITECTURE[kind]
    assert (lm.config.moe is not None) == (kind == "qwen3_5_moe")
    diff = (logits_of(lm) - expected[kind, "F32"]).abs().max().item()
    assert diff < TOLERANCE, f"{kind}: max |logit difference| {diff:.2e}"

