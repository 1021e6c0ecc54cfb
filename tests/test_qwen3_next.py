"""Qwen3-Next (Qwen3NextForCausalLM) from an HF folder: Qwen3.5's hybrid layers read from fused linear-attention
projections (llmd.model.qwen3_next). A tiny random-weight model written by transformers (MoE layers with a gated
shared expert, one dense layer) against transformers on CPU fp32, prompts fed whole and in chunks; then the engine's
invariants on it (batched == alone, prefix hit == miss) and a tensor of the wrong shape refused by name.
"""

from __future__ import annotations

import pytest
import torch
from engine_testing import make_engine, no_leaked_blocks  # noqa: F401  (autouse leak check)
from llmd.engine import SamplingParams, generate
from llmd.errors import ModelFileError
from llmd.model.loader import load_model
from test_engine import GREEDY, random_prompts, run_alone, run_staggered
from test_families import TOLERANCE, prompt_ids, reference_logits
from test_hybrid import chunked_logits
from tiny_models import write_tiny_model

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
