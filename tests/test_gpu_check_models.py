"""The GPU script's encoder, hybrid / moe model and ple checks (tests/gpu/check_models.py) run on the CPU at their tiny
scale, the CPU standing in for CUDA: every tower and model builds, runs in bf16 and fp32, and agrees with its fp32
run within the tolerances the GPU stage applies; the per-layer table stays on the host. Without CUDA the default
run says so and skips. At full scale the towers have the real checkpoints' shapes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
import check_models  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_tiny_scale_on_the_cpu(tmp_path):
    assert check_models.main(["--out", str(tmp_path), "--device", "cpu", "--scale", "tiny"]) == 0
    results = json.loads((tmp_path / "check_models.json").read_text())
    towers = {r["tower"]: r for r in results["encoders"]}
    assert set(towers) == set(check_models.TOWERS)
    for row in towers.values():
        assert row["rel_err_float32"] < check_models.FP32_TOL and 0 < row["rel_err_bfloat16"] < check_models.BF16_TOL
        assert row["encode_ms_bfloat16"] > 0 and row["encode_ms_float32"] > 0 and row["layers"] == 3
    assert towers["qwen3-vl-8b"]["shape"] == [16, 48 * 3]  # the tokens' embeddings, then two DeepStack features
    models = [r["model"] for r in results["hybrid"] + results["moe"] + results["ple"]]
    assert models == ["qwen3-next", "nemotron-h-moe", "gemma4-e4b-6l"]
    ple = results["ple"][0]
    assert ple["table_device"] == "cpu" and 0 < ple["rel_err"] < check_models.LOGITS_BF16_TOL


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_without_cuda_it_says_so_and_skips(tmp_path, capsys):
    assert check_models.main(["--out", str(tmp_path)]) == 0
    assert "no CUDA device here" in capsys.readouterr().out and not (tmp_path / "check_models.json").exists()


def test_full_scale_towers_have_the_real_shapes():
    """Built on the meta device (no memory): Gemma 3 4B's SigLIP (~417M parameters with its projector), Qwen3-VL-8B's
    tower with three DeepStack mergers, Mistral Small 3.1's Pixtral tower and projector."""
    counts = {}
    for name, make in check_models.TOWERS.items():
        build, pixels = make("full", None)
        tower = build(lambda n, s: torch.empty(s, device="meta"), torch.bfloat16, "meta")
        counts[name] = (sum(p.numel() for p in tower.parameters()), tower.config.num_layers, tuple(pixels.shape))
    assert counts["gemma3-4b-siglip"][1:] == (27, (3, 896, 896)) and 4.1e8 < counts["gemma3-4b-siglip"][0] < 4.2e8
    assert counts["qwen3-vl-8b"][1:] == (27, (3, 768, 768))
    assert counts["mistral-small-3.1-pixtral"][1:] == (24, (3, 1008, 1008))


def test_full_scale_ple_model_is_e4b_with_six_layers():
    """E4B's widths and vocabulary, its per-layer table [262144, 6 x 256], the last two layers reading layers 2 and
    3's K/V (built on the meta device)."""
    from llmd.model.config import ModelConfig
    from llmd.model.registry import build_model

    config = ModelConfig.from_hf_config(check_models.gemma4_e4b_config("full"))
    assert (config.hidden_size, config.vocab_size, config.num_hidden_layers) == (2560, 262144, 6)
    assert [config.kv_source(i) for i in range(6)] == [0, 1, 2, 3, 2, 3]
    with torch.device("meta"):
        model = build_model(config)
    assert tuple(model.model.embed_tokens_per_layer.weight.shape) == (262144, 6 * 256)
