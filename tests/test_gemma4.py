"""Gemma 4 text against transformers on CPU fp32, from HF folders, in three variants: E-like (per-layer embeddings,
the last layers sharing K/V, double-wide MLPs there), 31B-like (global layers with V from K and one KV head, logit
soft-cap) and 26B-A4B-like (an MoE block beside every MLP); prompts past the sliding window. Then the engine's
invariants with KV-shared layers and two KV groups of different head shapes: batched == alone, prefix hit == miss,
preempted == not, speculation on == off; the cache holds no K/V for a shared layer; bad configs refused by name.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from engine_testing import make_engine, no_leaked_blocks  # noqa: F401  (autouse leak check)
from llmd.engine import SamplingParams, generate
from llmd.engine.runner import kv_bytes_per_block
from llmd.errors import ModelFileError
from llmd.model.host_table import HostEmbedding, host_weight_bytes
from llmd.model.loader import load_model
from test_engine import GREEDY, random_prompts, run_alone, run_staggered
from test_families import TOLERANCE, prompt_ids, reference_logits
from test_hybrid import chunked_logits
from tiny_models import GEMMA4_VARIANTS, write_tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")
# bf16 against fp32 logits of a tiny random model, |got - want| / |want|: 6e-2 with bf16 on the CPU (rounding compounds
# through the layers); a wrong row or layout gives errors of order 1
BF16_LOGITS = 0.15


@pytest.fixture(scope="module")
def gemma4_models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("gemma4_models")
    return {kind: write_tiny_model(root / kind, kind) for kind in GEMMA4_VARIANTS}


@pytest.fixture(scope="module")
def gemma4_e(gemma4_models):
    return load_model(gemma4_models["gemma4_e"], dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("kind", list(GEMMA4_VARIANTS))
def test_hf_folder_matches_transformers(kind, gemma4_models):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(gemma4_models[kind], dtype=torch.float32).eval()
    lm = load_model(gemma4_models[kind], dtype=torch.float32, device="cpu")
    prompt, decode = prompt_ids(40), prompt_ids(24, seed=1)  # the window is 8 tokens
    expected = reference_logits(ref, prompt, decode)
    got = chunked_logits(lm, prompt, decode, (11,))
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() < TOLERANCE


def test_shared_layers_hold_no_kv(gemma4_e):
    """Layers 4 and 5 read layers 2's and 3's K/V: the pools hold the other four layers only, each in its shape."""
    c = gemma4_e.config
    assert c.kv_layers == [0, 1, 2, 3] and c.kv_source(4) == 2 and c.kv_source(5) == 3
    engine = make_engine(gemma4_e, kv_cache_dtype="fp32")
    runner = engine.runner
    assert runner.kv_caches[4] is runner.kv_caches[2] and runner.kv_caches[5] is runner.kv_caches[3]
    assert runner.kv_caches[3][0].shape[-2:] == (2, 32) and runner.kv_caches[0][0].shape[-2:] == (2, 16)
    per_token = kv_bytes_per_block(c, 1, torch.float32, "fp32")
    assert per_token == 2 * 4 * (3 * 2 * 16 + 2 * 32)  # K and V, fp32: three sliding layers and one global
    kv = engine.stats().kv
    assert kv.bytes_per_token == per_token
    assert kv.bytes_per_token_unshared == per_token + 2 * 4 * (2 * 16 + 2 * 32)  # layers 4 and 5 if they stored theirs


@pytest.mark.parametrize("kind", ["gemma4_e", "gemma4_moe"])
def test_engine_batched_and_prefix_hits_equal_alone(kind, gemma4_models):
    lm = load_model(gemma4_models[kind], dtype=torch.float32, device="cpu")
    shared = prompt_ids(40, seed=9)
    prompts = [shared + p for p in random_prompts(6, 2, 30, 570, seed=10)]
    params = SamplingParams(max_tokens=12, **GREEDY)
    alone = run_alone(lm, prompts, params)
    engine = make_engine(lm, max_num_batched_tokens=24)  # prompts are chunked too
    batched = run_staggered(engine, prompts, params)
    assert [batched[str(i)] for i in range(len(prompts))] == alone
    assert engine.stats().kv.prefix_hits_tokens > 0


def test_preempted_and_speculating_equal_plain(gemma4_e):
    prompts = random_prompts(6, 10, 40, 570, seed=2)
    params = SamplingParams(max_tokens=24, **GREEDY)
    ample = [r.token_ids for r in generate(make_engine(gemma4_e), prompts, params)]
    engine = make_engine(gemma4_e, num_kv_blocks=10)
    assert [r.token_ids for r in generate(engine, prompts, params)] == ample
    assert engine.stats().num_preemptions > 0
    spec = make_engine(gemma4_e, speculative_mode="draft", draft_model="self:3", num_speculative_tokens=3)
    assert [r.token_ids for r in generate(spec, prompts, params)] == ample
    assert spec.stats().spec.accepted_total > 0


def _with_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_bad_files_name_the_problem(gemma4_models, tmp_path):
    src = gemma4_models["gemma4_e"]
    with pytest.raises(ModelFileError, match="num_kv_shared_layers"):
        load_model(_with_config(src, tmp_path / "shared", num_kv_shared_layers=6), dtype=torch.float32, device="cpu")
    with pytest.raises(ModelFileError, match="embed_tokens_per_layer"):  # the table no longer fits the layers
        load_model(_with_config(src, tmp_path / "ple", hidden_size_per_layer_input=4), dtype=torch.float32,
                   device="cpu")


def test_hub_checkpoints_unread_kv_of_sharing_layers_load(gemma4_models, tmp_path):
    """Hub E-model checkpoints keep k/v weights for the layers that share K/V; nothing reads them."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "hub"
    shutil.copytree(gemma4_models["gemma4_e"], folder)
    tensors = load_file(folder / "model.safetensors")
    shared = [i for i in range(6) if f"model.layers.{i}.self_attn.k_proj.weight" not in tensors]
    assert shared  # the variant has sharing layers
    for i in shared:
        tensors[f"model.layers.{i}.self_attn.k_proj.weight"] = torch.zeros(2 * 16, 64)
    save_file(tensors, folder / "model.safetensors")
    plain = load_model(gemma4_models["gemma4_e"], dtype=torch.float32, device="cpu")
    hub = load_model(folder, dtype=torch.float32, device="cpu")
    prompt = prompt_ids(12)
    assert torch.equal(chunked_logits(hub, prompt, [5], ()), chunked_logits(plain, prompt, [5], ()))


def test_per_layer_table_is_held_on_the_host(gemma4_e):
    """The per-layer table is a HostEmbedding (llmd.model.host_table): nn.Embedding's lookup, a dtype change keeps
    it in host memory with the values rounded, and on the CPU no weight is counted apart (all of them are host's)."""
    table = gemma4_e.model.model.embed_tokens_per_layer
    assert isinstance(table, HostEmbedding) and table.weight.device.type == "cpu"
    ids = torch.tensor([[0, 7, 7], [3, table.num_embeddings - 1, 1]])
    assert torch.equal(table(ids), F.embedding(ids, table.weight))
    half = HostEmbedding(table.num_embeddings, table.embedding_dim, device="meta").to_empty(device="cpu")
    half.weight.data.copy_(table.weight)
    half = half.to(torch.bfloat16)
    assert half.weight.device.type == "cpu" and torch.equal(half(ids), table(ids).bfloat16())
    assert gemma4_e.report.host_bytes == 0 == host_weight_bytes(gemma4_e.model)


@pytest.mark.gpu
def test_gpu_per_layer_table_stays_on_the_host(gemma4_models, gemma4_e):
    """On CUDA (bf16) the per-layer table stays in host memory, every other weight is on the GPU, the loader reports
    the table's bytes apart, and the logits are the CPU fp32 model's within bf16 rounding."""
    lm = load_model(gemma4_models["gemma4_e"], dtype=torch.bfloat16, device="cuda")
    table = lm.model.model.embed_tokens_per_layer
    assert table.weight.device.type == "cpu" and table.weight.dtype == torch.bfloat16
    assert all(p.is_cuda for n, p in lm.model.named_parameters() if not n.startswith("model.embed_tokens_per_layer"))
    assert lm.report.host_bytes == table.weight.numel() * 2 == host_weight_bytes(lm.model)
    prompt, decode = prompt_ids(40), prompt_ids(8, seed=1)
    got = chunked_logits(lm, prompt, decode, (11,)).cpu()
    want = chunked_logits(gemma4_e, prompt, decode, (11,))
    assert ((got - want).norm() / want.norm()).item() < BF16_LOGITS
