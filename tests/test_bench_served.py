"""tests/benchmarks: real_shapes.py's Qwen3.5 source files (written at a tiny size with the real shapes' code path)
load in llmd and run, and bench_served.py's batch-1 decode accounting (bytes moved per token) equals llmd's own
figures for the same file: K/V of a hybrid's attention layers only, the recurrent state of its other layers read
and written back (Qwen3.5's Gated DeltaNet, Granite 4.0-H's Mamba2), every tensor's bytes (the output matrix once,
the top-k share of the experts); for a plain model (the bundled SmolLM2) K/V of every layer and no state."""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "benchmarks"))
import bench_served  # noqa: E402
import real_shapes  # noqa: E402
from llmd.model.gguf import gguf_config  # noqa: E402
from llmd.model.loader import load_model  # noqa: E402
from llmd.model.recurrent import state_bytes_per_sequence  # noqa: E402
from simple_driver import greedy_generate  # noqa: E402
from tiny_models import write_tiny_gguf, write_tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Qwen3.5's layouts at a tiny size: 8 layers (two of them attention), 2 key heads serving 4 value heads, untied; the
# MoE's MLPs 8 experts (top 2) and a shared expert
_TINY = dict(hidden_size=128, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
             tie_word_embeddings=False)
TINY = {"qwen35": real_shapes.HYBRID_SHAPES["qwen35-9b"] | _TINY | dict(intermediate_size=256),
        "qwen35moe": real_shapes.HYBRID_SHAPES["qwen35-35b-a3b"] | _TINY | dict(
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=128)}


@pytest.fixture(scope="module", params=list(TINY))
def hybrid_file(request, tmp_path_factory, smollm2_gguf) -> Path:
    path = tmp_path_factory.mktemp("real-shapes") / f"{request.param}-tiny.gguf"
    real_shapes.HYBRID_SHAPES["tiny"] = TINY[request.param]
    try:
        real_shapes.write_source("tiny", path, smollm2_gguf, via="Q8_0")
    finally:
        del real_shapes.HYBRID_SHAPES["tiny"]
    return path


def test_real_shapes_qwen35_files_load_and_run_in_llmd(hybrid_file):
    config = gguf_config(hybrid_file)
    assert [config.is_recurrent(i) for i in range(8)] == [True, True, True, False] * 2
    assert (config.hidden_size, config.recurrent.state_shape) == (128, (4, 32, 32))
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(hybrid_file).tensors}
    assert types["blk.0.attn_qkv.weight"] == "Q8_0" and types["blk.0.ssm_conv1d.weight"] == "F32"
    loaded = load_model(hybrid_file)
    assert len(greedy_generate(loaded, [1, 504, 3458, 282], 3)) == 3


def test_decode_bytes_of_a_hybrid_are_llmds(hybrid_file):
    reader = gguf.GGUFReader(hybrid_file)
    arch = reader.fields["general.architecture"].contents()
    weights, kv, state = bench_served.decode_bytes(reader, arch)
    config = gguf_config(hybrid_file)
    assert config.num_kv_layers == 2
    assert kv == config.kv_bytes_per_token * 2  # f16 K/V
    assert state == 2 * state_bytes_per_sequence(config, torch.float32) > 0
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    experts = sum(n for name, n in sizes.items() if "_exps." in name)
    assert (arch == "qwen35moe") == (experts > 0)
    assert weights == sum(sizes.values()) - sizes["token_embd.weight"] - experts + experts * 2 // 8  # top 2 of 8


@pytest.mark.parametrize("kind", ["granite_hybrid", "granite_hybrid_dense"])
def test_decode_bytes_of_a_mamba2_hybrid_are_llmds(kind, tmp_path):
    """Granite 4.0-H as llama.cpp's converter writes it: K/V heads given per layer (0 on its Mamba2 layers)."""
    path = write_tiny_gguf(write_tiny_model(tmp_path / kind, kind), tmp_path / f"{kind}.gguf", "Q8_0")
    _, kv, state = bench_served.decode_bytes(gguf.GGUFReader(path), "granitehybrid")
    config = gguf_config(path)
    assert config.num_kv_layers == 1 and config.num_hidden_layers == 3
    assert kv == config.kv_bytes_per_token * 2
    assert state == 2 * state_bytes_per_sequence(config, torch.float32) > 0


def test_decode_bytes_of_a_plain_model_are_llmds(smollm2_gguf):
    reader = gguf.GGUFReader(smollm2_gguf)
    weights, kv, state = bench_served.decode_bytes(reader, "llama")
    assert kv == gguf_config(smollm2_gguf).kv_bytes_per_token * 2 > 0
    assert state == 0
    assert weights == sum(int(t.n_bytes) for t in reader.tensors)  # tied: the embedding table is the output matrix
