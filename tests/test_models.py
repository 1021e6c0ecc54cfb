"""Our model code against Hugging Face transformers (the reference) on tiny random-weight models, CPU fp32.

Tolerance: max |logit difference| < 1e-4 (observed ~3e-6; logits are O(1)). Greedy continuations must be identical.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from llmd.errors import ModelFileError, UnsupportedArchitecture
from llmd.model.attention import AttentionMetadata, allocate_kv_cache
from llmd.model.config import SUPPORTED_ARCHITECTURES, ModelConfig
from llmd.model.linear import TransposedLinear
from llmd.model.loader import load_model
from simple_driver import SingleSequence, greedy_generate

TOLERANCE = 1e-4
KINDS = ["llama", "llama3_rope", "qwen2", "qwen3", "mistral", "phi3"]


def prompt_ids(n: int = 40, seed: int = 0, high: int = 570) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, high, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def loaded(tiny_models):
    return {kind: load_model(tiny_models[kind], dtype=torch.float32, device="cpu") for kind in KINDS}


@pytest.fixture(scope="module")
def references(tiny_models):
    from transformers import AutoModelForCausalLM

    return {kind: AutoModelForCausalLM.from_pretrained(tiny_models[kind], dtype=torch.float32).eval() for kind in KINDS}


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers_chunked_prefill_and_decode(kind, loaded, references):
    lm, ref = loaded[kind], references[kind]
    ids = prompt_ids(40)
    decode = prompt_ids(4, seed=1)
    with torch.no_grad():
        expected = ref(torch.tensor([ids + decode])).logits[0].float()

    seq = SingleSequence(lm, max_tokens=64)
    # A prefix chunk, then the rest of the prompt attending to the cached prefix, then one token per step.
    got = [seq.feed(ids[:13]), seq.feed(ids[13:])] + [seq.feed([t]) for t in decode]
    got = torch.cat(got)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() < TOLERANCE


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_continuation_matches_transformers_generate(kind, loaded, references):
    ref = references[kind]
    ids = prompt_ids(24, seed=2)
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, len(ids):].tolist()
    eos = ref.generation_config.eos_token_id
    stop = eos if isinstance(eos, list) else [eos]
    ours = greedy_generate(loaded[kind], ids, 32, chunk_sizes=[10], stop_ids=stop)
    assert ours == out
    assert len(ours) >= 8  # a meaningful continuation, not an immediate EOS


def test_mixed_batch_equals_sequences_run_alone(loaded):
    """One flattened forward with a prefill chunk and a decode of two different sequences gives the same logits as
    running each alone (the engine's batching relies on this)."""
    lm = loaded["qwen2"]
    model, cfg = lm.model, lm.config
    a, b = prompt_ids(20, seed=3), prompt_ids(9, seed=4)

    alone_a = SingleSequence(lm, 32).feed(a)[-1]
    sb = SingleSequence(lm, 32)
    sb.feed(b[:-1])
    alone_b = sb.feed(b[-1:])[-1]

    # Shared pool of 6 blocks of 8: sequence a gets blocks [5, 1, 3], sequence b [0, 4].
    caches = allocate_kv_cache(cfg.num_hidden_layers, 6, 8, cfg.num_key_value_heads, cfg.head_dim, torch.float32)
    tables = [[5, 1, 3], [0, 4]]
    with torch.inference_mode():
        # step 1: a's first 12 tokens and all of b but its last token
        meta = AttentionMetadata.build([12, 8], [12, 8], tables, 8)
        model(torch.tensor(a[:12] + b[:8]), torch.tensor(list(range(12)) + list(range(8))), caches, meta)
        # step 2: the rest of a's prompt (chunked prefill) mixed with b's decode
        meta = AttentionMetadata.build([8, 1], [20, 9], tables, 8)
        hidden = model(torch.tensor(a[12:] + b[8:]), torch.tensor(list(range(12, 20)) + [8]), caches, meta)
        logits = model.compute_logits(hidden[[7, 8]])
    assert (logits[0] - alone_a).abs().max().item() < 1e-5
    assert (logits[1] - alone_b).abs().max().item() < 1e-5


@pytest.mark.parametrize("kind", KINDS)
def test_cpu_weights_are_transposed_and_a_tied_head_is_stored_once(kind, loaded, references):
    """On CPU every fp projection is stored [in, out] (the faster layout for decode); the parity tests above run on
    that layout. A tied head and the embeddings must share one matrix, as in the checkpoint."""
    lm = loaded[kind].model
    projections = [m for name, m in lm.named_modules() if name.endswith("_proj") or name == "lm_head"]
    assert projections and all(isinstance(m, TransposedLinear) for m in projections)
    assert not any(type(m) is torch.nn.Linear for m in lm.modules())
    ours = sum(p.numel() for p in lm.parameters())
    theirs = sum(p.numel() for p in references[kind].parameters())  # counts a tied matrix once
    assert ours == theirs
    if references[kind].config.tie_word_embeddings:
        ids = torch.tensor(prompt_ids(8, seed=3))
        assert torch.equal(lm.model.embed_tokens(ids), lm.lm_head.weight_t.t()[ids])


def test_loaded_model_fields_and_bf16_flag(tiny_llama):
    lm = load_model(tiny_llama, dtype=torch.bfloat16, device="cpu")
    assert lm.dtype == torch.bfloat16 and lm.device.type == "cpu"
    assert all(p.dtype == torch.bfloat16 for p in lm.model.parameters())
    assert lm.model.model.rotary_emb.inv_freq.dtype == torch.float32  # RoPE frequencies stay fp32
    assert lm.name == tiny_llama.name and lm.load_seconds > 0 and lm.report.weight_bytes > 0
    assert lm.tokenizer is not None and lm.config.architecture == "LlamaForCausalLM"
    fp32 = load_model(tiny_llama, device="cpu")
    assert fp32.dtype == torch.float32  # default on CPU
    ids = prompt_ids(16, seed=5)
    low = SingleSequence(lm, 16).feed(ids)
    full = SingleSequence(fp32, 16).feed(ids)
    assert low.dtype == torch.float32  # compute_logits always returns fp32
    assert (low - full).abs().max().item() < 0.25  # bf16 is close, not exact


def test_config_reads_classic_rope_fields():
    cfg = ModelConfig.from_hf_config({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "eos_token_id": [7, 8], "bos_token_id": 6, "tie_word_embeddings": True,
    }, {"eos_token_id": [8, 9]})
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling["factor"] == 32.0
    assert cfg.head_dim == 16 and cfg.eos_token_ids == [7, 8, 9] and cfg.tie_word_embeddings


def _copy_with_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_unsupported_architecture_is_named(tiny_llama, tmp_path):
    folder = _copy_with_config(tiny_llama, tmp_path / "gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedArchitecture) as err:
        load_model(folder, device="cpu")
    assert "GPT2LMHeadModel" in str(err.value)
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in str(err.value)


def test_unsupported_rope_scaling_is_refused(tiny_llama, tmp_path):
    folder = _copy_with_config(tiny_llama, tmp_path / "dynamic", rope_parameters={
        "rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0})
    with pytest.raises(UnsupportedArchitecture, match="dynamic"):
        load_model(folder, device="cpu")


def test_missing_config_names_the_file(tiny_llama, tmp_path):
    folder = tmp_path / "noconfig"
    shutil.copytree(tiny_llama, folder)
    (folder / "config.json").unlink()
    with pytest.raises(ModelFileError) as err:
        load_model(folder, device="cpu")
    assert "config.json" in str(err.value) and "not found" in str(err.value)


def test_checkpoint_not_matching_config_names_the_tensor(tiny_llama, tmp_path):
    folder = _copy_with_config(tiny_llama, tmp_path / "wide", intermediate_size=96)
    with pytest.raises(ModelFileError, match=r"mlp\.(gate|up|down)_proj\.weight.*has shape"):
        load_model(folder, device="cpu")


def test_corrupt_safetensors_is_a_clear_error(tiny_llama, tmp_path):
    folder = tmp_path / "corrupt"
    shutil.copytree(tiny_llama, folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelFileError, match=r"model\.safetensors: tensor .* beyond the end of the file"):
        load_model(folder, device="cpu")
    weights.write_bytes(b"\xff" * 64)  # garbage: an absurd header length
    with pytest.raises(ModelFileError, match=r"model\.safetensors: safetensors header length"):
        load_model(folder, device="cpu")


def test_fp32_rmsnorm_matches_transformers():
    """fp32 RMSNorm is one C call on the CPU (llmd.kernels.cpu_ops), equal to transformers' up to the order of the
    sum of squares; without the compiled ops it is torch's fused op, equal bit for bit."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from llmd.model.llama import RMSNorm
    from llmd.model.ops import CPU_OPS, TORCH_OPS

    torch.manual_seed(0)
    ours, theirs = RMSNorm(576, 1e-5), LlamaRMSNorm(576, eps=1e-5)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(576))
        theirs.weight.copy_(ours.weight)
        for ops in (CPU_OPS, TORCH_OPS):  # as a model prepared for the CPU binds them, and the torch table
            ours.ops = ops
            for rows in (1, 7, 300):
                x = torch.randn(rows, 576) * 4
                torch.testing.assert_close(ours(x), theirs(x), rtol=2e-6, atol=1e-6)
                assert torch.equal(F.rms_norm(x, (576,), ours.weight, 1e-5), theirs(x))  # the fallback
                assert torch.equal(ours(x[3 % rows :][:1]), ours(x)[3 % rows :][:1])  # a row alone or among others
        assert torch.equal(TORCH_OPS.rms_norm(x, ours.weight, 1e-5), theirs(x))


@pytest.mark.parametrize("quant", [None, "int8", "int4-g32"])
def test_checkpoint_with_fused_projections_loads_directly(tiny_qwen2, tmp_path, monkeypatch, quant):
    """A checkpoint that stores qkv_proj (with its bias) and gate_up_proj as such (Phi-3 does) loads by name into
    the fused layers, to the very weights of the same checkpoint stored as q/k/v_proj and gate/up_proj."""
    from safetensors.torch import load_file, save_file

    monkeypatch.setenv("LLMD_QUANT_CACHE_DIR", str(tmp_path / "qcache"))
    folder = tmp_path / "fused"
    shutil.copytree(tiny_qwen2, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    for i in range(2):
        pre = f"model.layers.{i}."
        for fused, parts, leaves in (("self_attn.qkv_proj", ("q", "k", "v"), ("weight", "bias")),
                                     ("mlp.gate_up_proj", ("gate", "up"), ("weight",))):
            module = fused.split(".")[0]
            for leaf in leaves:
                tensors[f"{pre}{fused}.{leaf}"] = torch.cat(
                    [tensors.pop(f"{pre}{module}.{p}_proj.{leaf}") for p in parts])
    save_file(tensors, str(folder / "model.safetensors"))
    want = load_model(tiny_qwen2, device="cpu", quant=quant).model.state_dict()
    got = load_model(folder, device="cpu", quant=quant).model.state_dict()
    assert got.keys() == want.keys() and any("qkv_proj" in k for k in got)
    for name, tensor in got.items():
        assert torch.equal(tensor, want[name]), name
