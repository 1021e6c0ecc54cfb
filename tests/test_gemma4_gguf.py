"""Gemma 4 text from gemma4 GGUF files written as llama.cpp's converter writes them (tests/tiny_models.py
write_gemma4_gguf), in the three variants of tests/test_gemma4.py: the config the metadata and tensors describe equals
the HF folder's; F32 and Q8_0 files compute what transformers computes on the file's weights (fp32, prompts past the
window); llama.cpp's own loader reads the same files (where llama-cpp-python is installed); their "gemma4"
vocabulary tokenizes as transformers and llama.cpp do; Q8_0 stays packed
(projections, both token tables, the fused gate/up experts) and runs the engine as alone; bad files are refused naming
the file and the tensor or key.
"""

from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest
import torch
from engine_testing import make_engine, no_leaked_blocks  # noqa: F401  (autouse leak check)
from llmd.engine import SamplingParams
from llmd.errors import ModelFileError
from llmd.model.config import ModelConfig
from llmd.model.gguf import gguf_config
from llmd.model.host_table import HostEmbedding
from llmd.model.loader import load_model
from llmd.model.quant.gguf_experts import GGUFExpertLinear
from llmd.model.quant.gguf_layers import GGUFEmbedding, GGUFLinear, HostGGUFEmbedding
from test_engine import GREEDY, random_prompts, run_alone, run_staggered
from test_families import TOLERANCE, _rewrite, our_logits, prompt_ids, reference_logits
from test_moe import assert_compiled_experts
from tiny_models import GEMMA4_VARIANTS, gemma4_gguf_name, write_tiny_gguf, write_tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")
TYPES = ("F32", "Q8_0")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("gemma4_gguf_models")
    return {kind: write_tiny_model(root / kind, kind) for kind in GEMMA4_VARIANTS}


@pytest.fixture(scope="module")
def ggufs(models, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("gemma4_ggufs")
    return {(kind, t): write_tiny_gguf(models[kind], root / f"{kind}-{t}.gguf", t)
            for kind in GEMMA4_VARIANTS for t in TYPES}


def _file_weights_folder(folder, path, dst):
    """A copy of HF folder `folder` holding the GGUF file's weights (dequantized by the gguf package)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, dst)
    state = load_file(folder / "model.safetensors")
    by_gguf = {gemma4_gguf_name(name): name for name in state}
    for t in gguf.GGUFReader(path).tensors:
        if t.name in by_gguf:
            name = by_gguf[t.name]
            values = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
            state[name] = torch.from_numpy(np.array(values, np.float32)).reshape(state[name].shape)
    save_file(state, dst / "model.safetensors")
    return dst


@pytest.fixture(scope="module")
def expected(models, ggufs, tmp_path_factory) -> dict:
    """transformers' logits on each file's weights, for one prompt past the window (8) and its decode."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("gemma4_file_weights")
    prompt, decode = prompt_ids(40), prompt_ids(24, seed=1)
    out = {}
    for (kind, t), path in ggufs.items():
        folder = models[kind] if t == "F32" else _file_weights_folder(models[kind], path, root / f"{kind}-{t}")
        ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        out[kind, t] = reference_logits(ref, prompt, decode)
    return out


@pytest.mark.parametrize("kind", list(GEMMA4_VARIANTS))
def test_config_from_the_file_is_the_folders(kind, models, ggufs):
    """Layer kinds, per-layer head shapes, KV sources, per-layer inputs, V from K, RoPE, experts: as config.json."""
    ours, theirs = gguf_config(ggufs[kind, "F32"]), ModelConfig.from_hf_folder(models[kind])
    for field in ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta", "rope_local_theta",
                  "tie_word_embeddings", "sliding_window", "layer_types", "layer_head_dims", "layer_kv_heads",
                  "kv_sources", "gemma4", "moe", "final_logit_softcapping"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps)  # (a float32 in the file)
    assert ours.kv_bytes_per_token == theirs.kv_bytes_per_token
    if kind == "gemma4_e":  # the file holds the KV-sharing layers' unused k/v (as hub checkpoints do): left unread
        names = {t.name for t in gguf.GGUFReader(ggufs[kind, "F32"]).tensors}
        assert {"blk.4.attn_k.weight", "blk.5.attn_v.weight", "blk.5.attn_k_norm.weight"} <= names


@pytest.mark.parametrize("quant", ["none", "gguf"])
@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("kind", list(GEMMA4_VARIANTS))
def test_gguf_matches_transformers(kind, t, quant, ggufs, expected, monkeypatch):
    """Packed Q8_0 layers on their exact-weights activation path (fp32), so the file's weights are all that differ
    from the fp32 reference."""
    monkeypatch.setenv("LLMD_CPU_GEMM_ACT", "fp32")
    lm = load_model(ggufs[kind, t], dtype=torch.float32, device="cpu", quant=quant)
    diff = (our_logits(lm, prompt_ids(40), prompt_ids(24, seed=1)) - expected[kind, t]).abs().max().item()
    assert diff < TOLERANCE, f"{kind} {t} ({quant}): max |logit difference| {diff:.2e}"


@pytest.mark.anchor  # llama-cpp-python from `make bench-anchor`: `pytest -m anchor`
@pytest.mark.parametrize("kind", list(GEMMA4_VARIANTS))
def test_llama_cpp_reads_the_files_as_llmd_does(kind, ggufs):
    """llama.cpp's own loader takes the writer's files (names, shapes, metadata) and computes the same logits
    within its own rounding (its CPU GELU reads an fp16 table: about 1e-2 here), the same greedy token everywhere."""
    import llama_cpp
    prompt = prompt_ids(40)
    llm = llama_cpp.Llama(str(ggufs[kind, "F32"]), n_ctx=64, logits_all=True, verbose=False, n_threads=1,
                          type_k=0, type_v=0)  # an F32 cache
    llm.eval(prompt)
    theirs = torch.from_numpy(np.array(llm.scores[: len(prompt)]))
    ours = our_logits(load_model(ggufs[kind, "F32"], dtype=torch.float32, device="cpu"), prompt, [])
    assert (theirs - ours).abs().max().item() < 0.05
    assert torch.equal(theirs.argmax(-1), ours.argmax(-1))


TEXTS = ["Hello, world! How are you today?", "  two  spaces\n\n\tand tabs\n",
         "Caf\u00e9 \u65e5\u672c\u8a9e \U0001F600 zq", "def f(n):\n    return n", " lead",
         "<|turn>user\nWhat is the capital of France?<turn|>\n<|turn>model\n"]


def test_gemma4_vocabulary_tokenizes_as_transformers_and_llama_cpp(models, ggufs):
    """The file's "gemma4" vocabulary (characters, '▁' for spaces, <0xNN> for the bytes of what no token spells, runs
    of newlines apart) splits every text as transformers splits it with the folder's tokenizer, and as llama.cpp
    does where it is installed; decoding gives the text back; <bos> is added, <turn|> ends a turn."""
    from llmd.model.gguf import load_gguf
    from transformers import AutoTokenizer

    ours, theirs = load_gguf(ggufs["gemma4_e", "Q8_0"]).tokenizer, AutoTokenizer.from_pretrained(models["gemma4_e"])
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False), text
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.encode("Hi", add_special_tokens=True) == theirs.encode("Hi")
    assert theirs.convert_tokens_to_ids("<turn|>") in ours.eos_token_ids
    try:
        import llama_cpp
    except ImportError:
        return
    llm = llama_cpp.Llama(str(ggufs["gemma4_e", "Q8_0"]), vocab_only=True, verbose=False)
    assert all(llm.tokenize(t.encode(), add_bos=False, special=True) == ours.encode(t) for t in TEXTS)


@pytest.fixture(scope="module")
def packed_e(ggufs):
    """The E-model's Q8_0 file as a user runs it (packed, integer activations)."""
    return load_model(ggufs["gemma4_e", "Q8_0"], dtype=torch.float32, device="cpu")


def test_q8_0_stays_packed(packed_e, ggufs):
    """Projections, the token table and the per-layer table (most of an E-model) keep the file's blocks; the MoE's
    experts keep gate and up as the one fused tensor of the file, run as one C call per layer where it builds."""
    m = packed_e.model.model
    assert isinstance(m.embed_tokens, GGUFEmbedding) and isinstance(m.embed_tokens_per_layer, GGUFEmbedding)
    assert m.embed_tokens_per_layer.type_name == "Q8_0"
    layer = m.layers[0]
    assert all(isinstance(p, GGUFLinear) and p.file_type == "Q8_0" for p in
               (layer.self_attn.q_proj, layer.mlp.gate_proj, layer.per_layer_input_gate, m.per_layer_model_projection))
    fp = load_model(ggufs["gemma4_e", "Q8_0"], dtype=torch.float32, device="cpu", quant="none").model.model
    table = fp.embed_tokens_per_layer.weight
    assert torch.equal(m.embed_tokens_per_layer(torch.arange(table.shape[0])), table)
    # both kept in host memory on a GPU (llmd.model.host_table); the packed one dequantizes its rows on the CPU
    assert isinstance(m.embed_tokens_per_layer, HostGGUFEmbedding) and isinstance(fp.embed_tokens_per_layer,
                                                                                     HostEmbedding)
    assert not isinstance(m.embed_tokens, HostGGUFEmbedding)  # the token table is the tied head: on the device

    moe = load_model(ggufs["gemma4_moe", "Q8_0"], dtype=torch.float32, device="cpu")
    experts = moe.model.model.layers[1].experts
    assert isinstance(experts.gate_up_proj, GGUFExpertLinear)
    assert [(p.out_features, p.type_name) for p in experts.gate_up_proj.parts] == [(64, "Q8_0")]
    fp_experts = load_model(ggufs["gemma4_moe", "Q8_0"], dtype=torch.float32, device="cpu",
                            quant="none").model.model.layers[1].experts
    assert torch.equal(experts.gate_up_proj.dequantized_weight(), fp_experts.gate_up_proj.weight)
    assert_compiled_experts(moe)


def test_packed_engine_batched_and_prefix_hits_equal_alone(packed_e):
    shared = prompt_ids(24, seed=9)
    prompts = [shared + p for p in random_prompts(3, 2, 20, 570, seed=10)]
    params = SamplingParams(max_tokens=8, **GREEDY)
    alone = run_alone(packed_e, prompts, params)
    engine = make_engine(packed_e, max_num_batched_tokens=24)
    batched = run_staggered(engine, prompts, params)
    assert [batched[str(i)] for i in range(len(prompts))] == alone
    assert engine.stats().kv.prefix_hits_tokens > 0


# ---- bad files: refused before any weight is read, naming the file and the tensor or key


def _refusal(path) -> str:
    with pytest.raises(ModelFileError) as info:
        load_model(path, dtype=torch.float32, device="cpu")
    message = str(info.value)
    assert str(path) in message
    return message


def test_per_layer_table_that_does_not_fit_the_layers(ggufs, tmp_path):
    path = _rewrite(ggufs["gemma4_e", "F32"], tmp_path / "ple.gguf",
                    meta={"gemma4.embedding_length_per_layer_input": 8})
    message = _refusal(path)
    assert "'per_layer_token_embd.weight' has shape [640, 96], expected [640, 48]" in message
    assert "6 layers of 8 per-layer inputs" in message


def test_shared_layer_count_out_of_range(ggufs, tmp_path):
    path = _rewrite(ggufs["gemma4_e", "F32"], tmp_path / "shared.gguf", meta={"gemma4.attention.shared_kv_layers": 6})
    assert "gemma4.attention.shared_kv_layers 6" in _refusal(path)


@pytest.mark.parametrize("kind,tensor", [("gemma4_e", "blk.2.inp_gate.weight"), ("gemma4_e", "rope_freqs.weight"),
                                         ("gemma4_moe", "blk.3.ffn_down_exps.scale"),
                                         ("gemma4_dense", "blk.3.layer_output_scale.weight")])
def test_missing_tensor_is_named(kind, tensor, ggufs, tmp_path):
    path = _rewrite(ggufs[kind, "F32"], tmp_path / "missing.gguf", drop=(tensor,))
    assert f"lacks tensor {tensor!r}" in _refusal(path)


def test_experts_of_the_wrong_shape(ggufs, tmp_path):
    path = _rewrite(ggufs["gemma4_moe", "F32"], tmp_path / "experts.gguf",
                    change={"blk.0.ffn_gate_up_exps.weight": np.zeros((8, 32, 64), np.float32)})
    assert "'blk.0.ffn_gate_up_exps.weight' has shape [8, 32, 64], expected [8, 64, 64]" in _refusal(path)


@pytest.mark.gpu
def test_gpu_packed_per_layer_table_stays_on_the_host(ggufs):
    """The Q8_0 file on CUDA: the packed per-layer table stays in host memory (its rows dequantized there), the other
    packed weights go to the GPU; logits within bf16 rounding of the file's weights run in fp32 on the CPU."""
    lm = load_model(ggufs["gemma4_e", "Q8_0"], dtype=torch.bfloat16, device="cuda")
    m = lm.model.model
    assert isinstance(m.embed_tokens_per_layer, HostGGUFEmbedding) and m.embed_tokens_per_layer.qweight.is_cpu
    assert m.embed_tokens.qweight.is_cuda and m.layers[0].self_attn.q_proj.qweight.is_cuda
    assert lm.report.host_bytes == m.embed_tokens_per_layer.qweight.numel()
    ref = load_model(ggufs["gemma4_e", "Q8_0"], dtype=torch.float32, device="cpu", quant="none")
    prompt, decode = prompt_ids(40), prompt_ids(8, seed=1)
    got, want = (our_logits(x, prompt, decode) for x in (lm, ref))
    assert ((got.cpu() - want).norm() / want.norm()).item() < 0.15  # as test_gemma4.BF16_LOGITS
