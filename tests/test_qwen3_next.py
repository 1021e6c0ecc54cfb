"""Qwen3-Next (Qwen3NextForCausalLM) from an HF folder: Qwen3.5's hybrid layers read from fused linear-attention
projections (llmd.model.qwen3_next). A tiny random-weight model written by transformers (MoE layers with a gated
shared expert, one dense layer) against transformers on CPU fp32, prompts fed whole and in chunks; then the engine's
invariants on it (batched == alone, prefix hit == miss) and a tensor of the wrong shape refused by name; the 80B's
config.json; llama.cpp's qwen3next GGUF file of an all-MoE twin, F32 and Q8_0.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_testing import make_engine, no_leaked_blocks  # noqa: F401  (autouse leak check)
from llmd.engine import SamplingParams, generate
from llmd.errors import ModelFileError
from llmd.model.loader import load_model
from llmd.model.quant.gguf_layers import GGUFLinear
from test_engine import GREEDY, random_prompts, run_alone, run_staggered
from test_families import TOLERANCE, _refusal, _rewrite, prompt_ids, reference_logits
from test_hybrid import chunked_logits
from tiny_models import round_to_gguf, write_tiny_gguf, write_tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("qwen3_next") / "qwen3_next", "qwen3_next")


@pytest.fixture(scope="module")
def qwen3_next(folder):
    return load_model(folder, dtype=torch.float32, device="cpu")


def test_matches_transformers(folder, qwen3_next):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    cfg = qwen3_next.config
    assert cfg.moe is not None and cfg.moe.dense_layers == (1,) and cfg.mrope_section is None
    prompt, decode = prompt_ids(70), prompt_ids(24, seed=1)  # past transformers' chunk of 64 and ours
    expected = reference_logits(ref, prompt, decode)
    for chunks in [(), (11, 30)]:  # the prompt whole, and in three chunks carrying the state across
        got = chunked_logits(qwen3_next, prompt, decode, chunks)
        assert got.shape == expected.shape
        assert (got - expected).abs().max().item() < TOLERANCE


def test_engine_batched_and_chunked_equal_alone(qwen3_next):
    prompts = random_prompts(6, 5, 60, 570, seed=3)
    params = SamplingParams(max_tokens=8, **GREEDY)
    alone = run_alone(qwen3_next, prompts, params)
    engine = make_engine(qwen3_next, max_num_batched_tokens=24)  # prompts are chunked, decodes ride along
    batched = run_staggered(engine, prompts, params)
    assert [batched[str(i)] for i in range(len(prompts))] == alone


def test_prefix_hit_equals_a_miss(qwen3_next):
    shared = prompt_ids(40, seed=9)  # the state checkpoint sits at the last block boundary, 32
    prompts = [shared + p for p in random_prompts(3, 3, 20, 570, seed=10)]
    params = SamplingParams(max_tokens=8, **GREEDY)
    alone = run_alone(qwen3_next, prompts, params)
    engine = make_engine(qwen3_next)
    first = generate(engine, prompts[:1], params)[0].token_ids
    rest = [r.token_ids for r in generate(engine, prompts[1:], params)]
    assert [first] + rest == alone
    stats = engine.stats()
    assert stats.kv.prefix_hits_tokens >= 2 * 32 and stats.kv.state_checkpoint_hits >= 2


@pytest.mark.parametrize("tensor", ["model.layers.0.linear_attn.in_proj_qkvz.weight",  # split at load
                                    "model.layers.2.linear_attn.in_proj_ba.weight",
                                    "model.layers.0.linear_attn.conv1d.weight"])  # loaded as it is
def test_tensor_of_the_wrong_shape_is_refused_by_name(folder, tmp_path, tensor):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    bad.mkdir()
    for f in folder.iterdir():
        if f.suffix != ".safetensors":
            (bad / f.name).write_bytes(f.read_bytes())
    tensors = load_file(folder / "model.safetensors")
    tensors[tensor] = tensors[tensor][:-2].clone()  # two rows short
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(ModelFileError) as info:
        load_model(bad, dtype=torch.float32, device="cpu")
    assert str(bad) in str(info.value) and f"{tensor!r} has shape" in str(info.value)


def test_config_of_the_80b_checkpoint():
    """Qwen3-Next-80B-A3B's config.json (its values, the older keys: full_attention_interval, a top-level
    partial_rotary_factor): 3 Gated DeltaNet layers to 1 attention layer, every MLP sparse; decoder_sparse_step and
    mlp_only_layers make some dense, as transformers builds them."""
    from llmd.model.config import ModelConfig

    cfg = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "vocab_size": 151936,
           "hidden_size": 2048, "intermediate_size": 5120, "num_hidden_layers": 48, "num_attention_heads": 16,
           "num_key_value_heads": 2, "head_dim": 256, "rope_theta": 10000000, "partial_rotary_factor": 0.25,
           "max_position_embeddings": 262144, "full_attention_interval": 4, "linear_conv_kernel_dim": 4,
           "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
           "linear_num_value_heads": 32, "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
           "shared_expert_intermediate_size": 512, "decoder_sparse_step": 1, "mlp_only_layers": [],
           "norm_topk_prob": True, "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
    config = ModelConfig.from_hf_config(cfg)
    assert config.kv_layers == list(range(3, 48, 4)) and config.rotary_dim == 64 and config.mrope_section is None
    assert config.recurrent is not None and config.recurrent.state_shape == (32, 128, 128)
    assert config.moe is not None and config.moe.dense_layers == () and config.moe.top_k == 10
    assert config.moe.shared_gate and config.moe.shared_intermediate_size == 512 and config.intermediate_size == 5120
    sparse_every_other = ModelConfig.from_hf_config({**cfg, "decoder_sparse_step": 2, "mlp_only_layers": [1]})
    assert sparse_every_other.moe is not None and sparse_every_other.moe.dense_layers[:4] == (0, 1, 2, 4)
    assert ModelConfig.from_hf_config({**cfg, "num_experts": 0}).moe is None


@pytest.fixture(scope="module")
def sparse_folder(tmp_path_factory):
    """Every MLP the MoE block, as llama.cpp's qwen3next knows it."""
    return write_tiny_model(tmp_path_factory.mktemp("qwen3_next_sparse") / "m", "qwen3_next_sparse")


@pytest.mark.parametrize("t, quant", [("F32", "none"), ("Q8_0", "gguf")])
def test_gguf_matches_transformers(sparse_folder, tmp_path, t, quant, monkeypatch):
    """llama.cpp's qwen3next file (tests/tiny_models.py writes it as its converter does: attn_qkv and attn_gate from
    in_proj_qkvz, ssm_ba fused, value heads in HF order, norms + 1), dequantized or its blocks kept (ssm_ba's packed
    rows split), against transformers on the values the file holds (round_to_gguf)."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("LLMD_CPU_GEMM_ACT", "fp32")
    path = write_tiny_gguf(sparse_folder, tmp_path / f"qwen3next-{t}.gguf", t)
    rounded = sparse_folder if t == "F32" else round_to_gguf(sparse_folder, tmp_path / "rounded", t)
    ref = AutoModelForCausalLM.from_pretrained(rounded, dtype=torch.float32).eval()
    lm = load_model(path, dtype=torch.float32, device="cpu", quant=quant)
    config = lm.config
    assert config.architecture == "Qwen3NextForCausalLM" and config.mrope_section is None
    assert config.recurrent is not None and not config.recurrent.tiled_value_heads
    assert config.moe is not None and config.moe.dense_layers == ()
    if quant == "gguf":
        assert isinstance(lm.model.model.layers[0].linear_attn.in_proj_qkv, GGUFLinear)
    prompt, decode = prompt_ids(40), prompt_ids(12, seed=1)
    expected = reference_logits(ref, prompt, decode)
    assert (chunked_logits(lm, prompt, decode, (17,)) - expected).abs().max().item() < TOLERANCE


def test_gguf_ba_of_the_wrong_shape_is_refused_by_name(sparse_folder, tmp_path):
    path = write_tiny_gguf(sparse_folder, tmp_path / "qwen3next.gguf")
    bad = _rewrite(path, tmp_path / "bad.gguf", change={"blk.0.ssm_ba.weight": np.zeros((6, 64), np.float32)})
    message = _refusal(bad)
    assert str(bad) in message and "'blk.0.ssm_ba.weight' has shape [6, 64], expected [8, 64]" in message
