"""The model families from GGUF files and HF folders against transformers (CPU fp32): Llama 2/3.x (llama3 RoPE as
GGUF's rope_freqs, tied embeddings), Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm), Phi-3/4 (fused qkv and gate_up,
longrope with partial rotary), and YaRN RoPE (Qwen2.5's long context, gpt-oss) on Qwen2 and Qwen3.

Each tiny random-weight HF folder (tests/tiny_models.py) is also written as a GGUF the way llama.cpp's converter
writes it. Our GGUF load is compared with transformers on the HF folder (transformers' own GGUF loader ignores
rope_freqs and the Phi-3 rope factors); transformers' GGUF loader, on the files without rope scaling, checks that the
converter writes what llama.cpp writes. Tolerance as tests/test_models.py: max |logit difference| < 1e-4.
"""

from __future__ import annotations

import math

import gguf
import numpy as np
import pytest
import torch
from engine_testing import make_engine, no_leaked_blocks  # noqa: F401  (autouse leak check)
from llmd.errors import ModelFileError, UnsupportedArchitecture
from llmd.kernels import cpu_gemm
from llmd.model.cpu_stack import CompiledCpuForward
from llmd.model.gguf import gguf_config
from llmd.model.llama import longrope_uses_long_factors
from llmd.model.loader import load_model
from simple_driver import SingleSequence, greedy_generate
from tiny_models import GGUF_ARCH, YARN_KINDS, write_tiny_gguf, write_tiny_model

TOLERANCE = 1e-4
GGUF_KINDS = ["llama", "llama3_rope", "mistral", "qwen2", "qwen3", "phi3", "phi3_longrope"]
ORIGINAL_CONTEXT = 32  # the phi3_longrope model's "pretraining" context: long factors from this position on


def prompt_ids(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 570, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def gguf_files(tiny_models, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("family_ggufs")
    return {kind: write_tiny_gguf(tiny_models[kind], root / f"{kind}.gguf") for kind in GGUF_KINDS}


@pytest.fixture(scope="module")
def references(tiny_models):
    from transformers import AutoModelForCausalLM

    return {kind: AutoModelForCausalLM.from_pretrained(tiny_models[kind], dtype=torch.float32).eval()
            for kind in GGUF_KINDS}


def reference_logits(ref, prompt: list[int], decode: list[int]) -> torch.Tensor:
    """transformers' logits for a prompt forward then one forward per decoded token on its cache (the way generate
    runs, and the way longrope's switch to its long factors applies in transformers)."""
    with torch.no_grad():
        out = ref(torch.tensor([prompt]), use_cache=True)
        rows, cache = [out.logits[0]], out.past_key_values
        for t in decode:
            out = ref(torch.tensor([[t]]), past_key_values=cache, use_cache=True)
            rows.append(out.logits[0])
            cache = out.past_key_values
    return torch.cat(rows).float()


def our_logits(lm, prompt: list[int], decode: list[int]) -> torch.Tensor:
    seq = SingleSequence(lm, max_tokens=len(prompt) + len(decode) + 8)
    # a prefix chunk, the rest of the prompt attending to it, then one token per step
    return torch.cat([seq.feed(prompt[:11]), seq.feed(prompt[11:])] + [seq.feed([t]) for t in decode])


@pytest.mark.parametrize("quant", ["none", "gguf"])
@pytest.mark.parametrize("kind", GGUF_KINDS)
def test_gguf_logits_match_transformers(kind, quant, gguf_files, references):
    """A prompt past phi3_longrope's original context (transformers then uses the long factors throughout, as we do
    for a model served past it: llmd.model.llama.longrope_uses_long_factors), and decode well beyond."""
    lm = load_model(gguf_files[kind], dtype=torch.float32, device="cpu", quant=quant)
    prompt, decode = prompt_ids(ORIGINAL_CONTEXT + 8), prompt_ids(2 * ORIGINAL_CONTEXT, seed=1)
    expected = reference_logits(references[kind], prompt, decode)
    got = our_logits(lm, prompt, decode)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() < TOLERANCE


@pytest.mark.parametrize("kind", ["phi3", "phi3_longrope"])
def test_phi3_hf_folder_matches_transformers(kind, tiny_models, references):
    lm = load_model(tiny_models[kind], dtype=torch.float32, device="cpu")
    assert lm.config.architecture == "Phi3ForCausalLM"
    prompt, decode = prompt_ids(ORIGINAL_CONTEXT + 1, seed=2), prompt_ids(2 * ORIGINAL_CONTEXT, seed=3)
    got, expected = our_logits(lm, prompt, decode), reference_logits(references[kind], prompt, decode)
    assert (got - expected).abs().max().item() < TOLERANCE


def test_phi3_hf_folder_quantized_to_int8(tiny_models, references):
    """The fused checkpoint tensors split before quantization: int8 per-row weights stay close to fp32 (a wrong
    split would scramble the logits, which are O(1))."""
    lm = load_model(tiny_models["phi3"], dtype=torch.float32, device="cpu", quant="int8")
    assert any(type(m).__name__ == "Int8Linear" for m in lm.model.modules())
    prompt = prompt_ids(24, seed=8)
    got, want = our_logits(lm, prompt, []), reference_logits(references["phi3"], prompt, [])
    assert (got - want).abs().max().item() < 0.25


@pytest.mark.parametrize("kind", ["phi3", "phi3_longrope", "llama3_rope"])
def test_greedy_continuation_matches_transformers_generate(kind, gguf_files, references):
    ref = references[kind]
    ids = prompt_ids(ORIGINAL_CONTEXT + 4, seed=4)
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(ids):].tolist()
    ours = greedy_generate(load_model(gguf_files[kind], dtype=torch.float32, device="cpu"), ids, 40,
                           chunk_sizes=[7], stop_ids=[])
    assert ours == out


@pytest.mark.parametrize("kind,matrix_type", [("phi3_longrope", "Q8_0"), ("phi3", "Q4_0"), ("qwen2", "Q8_0"),
                                              ("llama3_rope", "Q4_0"), ("qwen3", "Q8_0")])
def test_packed_gguf_matches_its_dequantized_weights(kind, matrix_type, tiny_models, tmp_path, monkeypatch):
    """A quantized file kept packed (--quant gguf: phi3's fused attn_qkv and ffn_up split as block rows) gives the
    logits of the same file dequantized to fp32 (with fp32 activations: the integer path is llama.cpp's numerics)."""
    monkeypatch.setenv("LLMD_CPU_GEMM_ACT", "fp32")
    path = write_tiny_gguf(tiny_models[kind], tmp_path / f"{kind}-{matrix_type}.gguf", matrix_type)
    prompt, decode = prompt_ids(ORIGINAL_CONTEXT + 8, seed=6), prompt_ids(8, seed=7)
    packed = load_model(path, dtype=torch.float32, device="cpu", quant="gguf")
    # on the CPU Q8_0 and Q4_0 stay GGUF blocks
    assert any(type(m).__name__ == "GGUFLinear" and m.file_type == matrix_type for m in packed.model.modules())
    dequantized = load_model(path, dtype=torch.float32, device="cpu", quant="none")
    got, want = our_logits(packed, prompt, decode), our_logits(dequantized, prompt, decode)
    assert (got - want).abs().max().item() < TOLERANCE


def test_configs_read_from_gguf(gguf_files):
    llama3 = gguf_config(gguf_files["llama3_rope"])
    assert llama3.tie_word_embeddings and llama3.rope_freq_factors is not None
    assert len(llama3.rope_freq_factors) == llama3.head_dim // 2 and max(llama3.rope_freq_factors) == 8.0
    qwen2, qwen3 = gguf_config(gguf_files["qwen2"]), gguf_config(gguf_files["qwen3"])
    assert qwen2.architecture == "Qwen2ForCausalLM" and qwen2.attention_bias and qwen2.tie_word_embeddings
    assert qwen3.architecture == "Qwen3ForCausalLM" and qwen3.qk_norm and not qwen3.tie_word_embeddings
    phi = gguf_config(gguf_files["phi3_longrope"])
    assert phi.architecture == "Phi3ForCausalLM" and phi.rotary_dim == 12 and phi.head_dim == 16
    assert phi.rope_scaling["rope_type"] == "longrope"
    assert phi.rope_scaling["original_max_position_embeddings"] == ORIGINAL_CONTEXT
    assert longrope_uses_long_factors(phi)  # served past its original context (512 > 32)


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3", "phi3"])
def test_transformers_reads_our_gguf_files_as_llama_cpp_files(kind, gguf_files, references):
    """transformers' GGUF loader (llama.cpp names, the llama q/k un-permutation) on our converter's files gives the
    HF folder's model: the files follow llama.cpp's conventions, not only our reader's."""
    from transformers import AutoModelForCausalLM

    path = gguf_files[kind]
    # transformers' GGUF reader leaves two keys at its config class defaults: qwen3's head_dim (it reads no
    # attention.key_length) and phi3's pad token (32000, past the tiny vocabulary)
    overrides = {"qwen3": {"head_dim": 16}, "phi3": {"pad_token_id": 0}}.get(kind, {})
    from_gguf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                     **overrides).eval()
    ids = torch.tensor([prompt_ids(24, seed=5)])
    with torch.no_grad():
        assert (from_gguf(ids).logits - references[kind](ids).logits).abs().max().item() < TOLERANCE


# ---- corrupt and unsupported files, one or more per architecture: each error names the file and the problem


def _rewrite(src, dst, arch: str | None = None, drop: tuple[str, ...] = (), change: dict | None = None,
             extra: dict | None = None, meta: dict | None = None):
    """A copy of GGUF `src` (F32 tensors) with another architecture name, tensors dropped, replaced or added, and
    metadata values changed or added (`meta`: key -> value; a key the file lacks is written as a string or float32)."""
    reader = gguf.GGUFReader(src)
    old_arch = reader.fields["general.architecture"].contents()
    arch = arch or old_arch
    w = gguf.GGUFWriter(str(dst), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        value = (meta or {}).get(key, field.contents())
        w.add_key_value(key.replace(f"{old_arch}.", f"{arch}.", 1), value, value_type, sub_type=sub_type)
    for key, value in (meta or {}).items():
        if key not in reader.fields:
            w.add_string(key, value) if isinstance(value, str) else w.add_float32(key, value)
    for t in reader.tensors:
        if t.name in drop:
            continue
        data = (change or {}).get(t.name, np.array(t.data).reshape(tuple(reversed([int(d) for d in t.shape]))))
        w.add_tensor(t.name, data)
    for name, data in (extra or {}).items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def _refusal(path, exc=ModelFileError) -> str:
    with pytest.raises(exc) as info:
        load_model(path, dtype=torch.float32, device="cpu")
    message = str(info.value)
    assert str(path) in message
    return message


@pytest.mark.parametrize("arch,kind", [("deepseek2", "mixture-of-experts"), ("mamba", "Mamba"), ("qwen2vl", "vision"), ("falcon", None)])
def test_other_architectures_are_refused_by_name(arch, kind, gguf_files, tmp_path):
    path = _rewrite(gguf_files["qwen3"], tmp_path / f"{arch}.gguf", arch=arch)
    message = _refusal(path, UnsupportedArchitecture)
    assert repr(arch) in message and "qwen3" in message and "phi3" in message
    if kind:
        assert kind in message


@pytest.mark.parametrize("arch", ["DeepseekV3ForCausalLM", "PhiMoEForCausalLM",
                                  "Phi3SmallForCausalLM", "MambaForCausalLM", "Qwen2VLForConditionalGeneration"])
def test_other_hf_architectures_are_refused_by_name(arch, tiny_models, tmp_path):
    import json
    import shutil

    folder = tmp_path / arch
    shutil.copytree(tiny_models["qwen3"], folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "architectures": [arch]}))
    message = _refusal(folder, UnsupportedArchitecture)
    assert repr(arch) in message and "config.json" in message and "Phi3ForCausalLM" in message


def test_llama_rope_freqs_of_the_wrong_length(gguf_files, tmp_path):
    path = _rewrite(gguf_files["llama3_rope"], tmp_path / "freqs.gguf",
                    change={"rope_freqs.weight": np.ones(5, np.float32)})
    message = _refusal(path)
    assert "rope_freqs.weight" in message and "5 values" in message


def test_qwen2_missing_a_bias(gguf_files, tmp_path):
    path = _rewrite(gguf_files["qwen2"], tmp_path / "nobias.gguf", drop=("blk.1.attn_k.bias",))
    assert "layers.1.self_attn.k_proj.bias" in _refusal(path)


def test_qwen3_missing_its_k_norm(gguf_files, tmp_path):
    path = _rewrite(gguf_files["qwen3"], tmp_path / "nonorm.gguf", drop=("blk.0.attn_k_norm.weight",))
    assert "layers.0.self_attn.k_norm.weight" in _refusal(path)


def test_a_tensor_the_architecture_has_no_place_for(gguf_files, tmp_path):
    """A q/k norm in a qwen2 file would be dropped silently and the model run without it."""
    path = _rewrite(gguf_files["qwen2"], tmp_path / "qnorm.gguf",
                    extra={"blk.0.attn_q_norm.weight": np.ones(16, np.float32)})
    message = _refusal(path)
    assert "blk.0.attn_q_norm.weight" in message and "'qwen2'" in message


def test_phi3_fused_qkv_of_the_wrong_size(gguf_files, tmp_path):
    path = _rewrite(gguf_files["phi3"], tmp_path / "qkv.gguf",
                    change={"blk.0.attn_qkv.weight": np.zeros((96, 64), np.float32)})
    message = _refusal(path)
    assert "layers.0.self_attn.qkv_proj.weight" in message and "(96, 64)" in message and "(128, 64)" in message


def test_phi3_with_one_longrope_factor_tensor(gguf_files, tmp_path):
    path = _rewrite(gguf_files["phi3_longrope"], tmp_path / "half.gguf", drop=("rope_factors_short.weight",))
    assert "rope_factors_long.weight" in _refusal(path)


def test_phi3_unimplemented_rope_type_is_refused_by_name(tiny_models, tmp_path):
    import json
    import shutil

    folder = tmp_path / "dynamic"
    shutil.copytree(tiny_models["phi3"], folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitecture, match="Phi3ForCausalLM with rope scaling type 'dynamic'"):
        load_model(folder, device="cpu")


def test_phi3_longrope_factors_of_the_wrong_length_name_the_config(tiny_models, tmp_path):
    import json
    import shutil

    folder = tmp_path / "factors"
    shutil.copytree(tiny_models["phi3_longrope"], folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rope_parameters"]["short_factor"] = [1.0, 2.0]
    (folder / "config.json").write_text(json.dumps(cfg))
    message = _refusal(folder)
    assert "config.json" in message and "short_factor" in message


def test_converter_covers_every_family():
    """Every GGUF architecture llmd runs has a test file writer (Gemma's: tests/tiny_gemma.py)."""
    from llmd.model.gguf import GGUF_ARCHITECTURES

    written = set(GGUF_ARCH.values()) | {"nemotron_h_moe"}  # Nemotron-H's writer names the MoE variant by its pattern
    assert written == set(GGUF_ARCHITECTURES) - {"gemma2", "gemma3"}


# ---- the engine's invariants hold for the new families (batched == alone, with chunked prefill and prefix hits)


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("kind,matrix_type,compiled", [("phi3", "Q8_0", True), ("phi3_longrope", "Q8_0", False),
                                                       ("qwen3", "F32", False)])
def test_engine_batched_equals_alone(kind, matrix_type, compiled, tiny_models, tmp_path):
    """Packed Phi-3 runs the compiled CPU forward (llmd.model.cpu_stack) where the C kernels build; partial rotary
    (phi3_longrope) and q/k norm (Qwen3) run the modules."""
    from llmd.engine import SamplingParams
    from test_engine import GREEDY, random_prompts, run_alone, run_staggered

    lm = load_model(write_tiny_gguf(tiny_models[kind], tmp_path / "m.gguf", matrix_type), dtype=torch.float32,
                    device="cpu")
    shared = prompt_ids(40, seed=9)  # a common prefix of whole blocks: later requests hit the prefix cache
    prompts = [shared + p for p in random_prompts(8, 2, 40, 570, seed=10)]
    params = SamplingParams(max_tokens=16, **GREEDY)
    alone = run_alone(lm, prompts, params)
    engine = make_engine(lm, max_num_batched_tokens=32)  # prompts are chunked too
    assert isinstance(engine.runner.forward, CompiledCpuForward) == (compiled and cpu_gemm.available())
    batched = run_staggered(engine, prompts, params)
    assert [batched[str(i)] for i in range(len(prompts))] == alone
    assert engine.stats().kv.prefix_hits_tokens > 0


# ---- the configs of the released checkpoints (their shapes and rope settings, as their config.json give them)


def _phi_config(**changes) -> dict:
    base = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 32064, "hidden_size": 3072,
            "intermediate_size": 8192, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 32, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
            "max_position_embeddings": 4096, "original_max_position_embeddings": 4096, "sliding_window": 2047,
            "rope_scaling": None, "tie_word_embeddings": False}
    return {**base, **changes}


def test_released_phi_configs():
    from llmd.model.config import ModelConfig

    mini_4k = ModelConfig.from_hf_config(_phi_config())  # Phi-3-mini-4k: plain RoPE, a 2047-token window
    assert mini_4k.rope_scaling is None and mini_4k.rotary_dim == 96 and mini_4k.head_dim == 96
    long = {"long_factor": [1.0 + i / 8 for i in range(48)], "short_factor": [1.0] * 48}
    for rope_type in ("su", "longrope"):  # Phi-3-mini-128k's first config named it "su"; Phi-3.5-mini "longrope"
        cfg = ModelConfig.from_hf_config(_phi_config(
            max_position_embeddings=131072, sliding_window=262144, rope_scaling={"type": rope_type, **long}))
        assert cfg.rope_scaling["rope_type"] == "longrope" and longrope_uses_long_factors(cfg)
        assert cfg.max_position_embeddings == 131072
        assert abs(cfg.rope_scaling["attention_factor"] - (1 + math.log(32) / math.log(4096)) ** 0.5) < 1e-12
    # Phi-4-mini: 24 heads of 128 with 8 KV heads, 3/4 of each head rotated, tied embeddings, longrope
    mini4 = ModelConfig.from_hf_config(_phi_config(
        vocab_size=200064, hidden_size=3072, num_attention_heads=24, num_key_value_heads=8, partial_rotary_factor=0.75,
        max_position_embeddings=131072, sliding_window=262144, tie_word_embeddings=True,
        rope_scaling={"type": "longrope", "long_factor": [1.0] * 48, "short_factor": [1.0] * 48}))
    assert mini4.head_dim == 128 and mini4.rotary_dim == 96 and mini4.tie_word_embeddings
    with pytest.raises(ModelFileError, match="long_factor has 40 values for a rotary dimension of 96"):
        ModelConfig.from_hf_config(_phi_config(
            rope_scaling={"type": "longrope", "long_factor": [1.0] * 40, "short_factor": [1.0] * 48}))


# ---- YaRN RoPE (Qwen2.5's long context; gpt-oss): HF folders and their GGUF files, past the pretraining context


@pytest.fixture(scope="module")
def yarn_models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("yarn_models")
    return {kind: write_tiny_model(root / kind, kind) for kind in YARN_KINDS}


YARN_KEYS = ("rope_type", "factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
             "truncate")


@pytest.mark.parametrize("kind", YARN_KINDS)
def test_yarn_logits_match_transformers(kind, yarn_models, tmp_path):
    """A prompt past the 32-token pretraining context and decode to 4x it: the HF folder and its GGUF file (whose
    metadata gives the same YaRN config) match transformers."""
    from transformers import AutoModelForCausalLM

    folder = yarn_models[kind]
    hf = load_model(folder, dtype=torch.float32, device="cpu")
    from_gguf = load_model(write_tiny_gguf(folder, tmp_path / f"{kind}.gguf"), dtype=torch.float32, device="cpu")
    assert hf.config.rope_scaling["rope_type"] == "yarn"
    assert {k: hf.config.rope_scaling[k] for k in YARN_KEYS} == {k: from_gguf.config.rope_scaling[k] for k in YARN_KEYS}
    assert hf.config.rope_theta == from_gguf.config.rope_theta
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompt, decode = prompt_ids(ORIGINAL_CONTEXT + 8), prompt_ids(2 * ORIGINAL_CONTEXT, seed=1)
    expected = reference_logits(ref, prompt, decode)
    for lm in (hf, from_gguf):
        assert (our_logits(lm, prompt, decode) - expected).abs().max().item() < TOLERANCE
    hf.model.model.rotary_emb.attention_scaling = 1.0  # the cos/sin scale left out: the check sees it
    assert (our_logits(hf, prompt, decode) - expected).abs().max().item() > 100 * TOLERANCE


@pytest.mark.parametrize("extra", [{}, {"truncate": False}, {"beta_fast": 8, "beta_slow": 0.25},
                                   {"mscale": 1.0, "mscale_all_dim": 0.5}, {"attention_factor": 1.3},
                                   {"factor": None}])
@pytest.mark.parametrize("theta,head_dim,partial,original", [(1e6, 16, 1.0, 32), (150000.0, 64, 1.0, 4096),
                                                             (1e4, 128, 0.5, 4096)])
def test_yarn_frequencies_equal_transformers(extra, theta, head_dim, partial, original):
    """Every YaRN key (gpt-oss: base 150000, 64-wide heads, 4096 tokens, truncate false), bit for bit against
    transformers' own _compute_yarn_parameters."""
    import transformers as tf
    from llmd.model.config import ModelConfig
    from llmd.model.llama import RotaryEmbedding, rope_inv_freq
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": original, **extra}
    hf = tf.Qwen2Config(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                        max_position_embeddings=8 * original,
                        rope_parameters={**scaling, "rope_theta": theta, "partial_rotary_factor": partial})
    want, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    cfg = ModelConfig("Qwen2ForCausalLM", 10, 4 * head_dim, 8, 1, 4, head_dim=head_dim, rope_theta=theta,
                      rope_scaling=dict(scaling), partial_rotary_factor=partial, max_position_embeddings=8 * original)
    assert torch.equal(rope_inv_freq(cfg), want)
    assert RotaryEmbedding(cfg).attention_scaling == attention_factor


def _qwen2(**changes):
    from llmd.model.config import ModelConfig

    return ModelConfig.from_hf_config({"architectures": ["Qwen2ForCausalLM"], "vocab_size": 10, "hidden_size": 64,
                                       "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 4,
                                       "max_position_embeddings": 32768, **changes})


def test_released_yarn_configs():
    """Qwen2.5's README setting (classic "type") and gpt-oss's (transformers >= 5 rope_parameters, truncate false);
    a config without the pretraining context takes max_position_embeddings, as transformers does."""
    qwen = _qwen2(rope_scaling={"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"})
    assert qwen.rope_scaling["rope_type"] == "yarn" and qwen.rope_scaling["truncate"]
    assert qwen.rope_scaling["attention_factor"] == 0.1 * math.log(4.0) + 1
    oss = _qwen2(max_position_embeddings=131072, rope_parameters={
        "rope_type": "yarn", "rope_theta": 150000, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "original_max_position_embeddings": 4096, "truncate": False})
    assert oss.rope_theta == 150000 and not oss.rope_scaling["truncate"]
    assert oss.rope_scaling["original_max_position_embeddings"] == 4096
    implied = _qwen2(rope_scaling={"type": "yarn", "factor": 2.0})
    assert implied.rope_scaling["original_max_position_embeddings"] == 32768


@pytest.mark.parametrize("change,field", [({"factor": 0}, "factor 0"), ({"factor": -2.0}, "factor -2.0"),
                                          ({"factor": "four"}, "factor 'four'"),
                                          ({"original_max_position_embeddings": None},
                                           "original_max_position_embeddings"),
                                          ({"attention_factor": 0.0}, "attention_factor")])
def test_bad_yarn_config_names_the_field(change, field):
    from llmd.model.config import ModelConfig

    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, **change}
    with pytest.raises(ModelFileError, match=field):
        ModelConfig("Qwen2ForCausalLM", 10, 64, 8, 1, 4, rope_scaling=scaling)


def test_bad_yarn_files_name_the_file_and_field(yarn_models, tmp_path):
    import json
    import shutil

    folder = tmp_path / "factor0"
    shutil.copytree(yarn_models["qwen2_yarn"], folder)
    cfg = json.loads((folder / "config.json").read_text())
    params = cfg.get("rope_scaling") or cfg["rope_parameters"]
    params["factor"] = 0
    (folder / "config.json").write_text(json.dumps(cfg))
    assert "yarn rope scaling factor 0" in _refusal(folder)
    src = write_tiny_gguf(yarn_models["qwen2_yarn"], tmp_path / "yarn.gguf")
    path = _rewrite(src, tmp_path / "factor.gguf", meta={"qwen2.rope.scaling.factor": -1.0})
    assert "yarn rope scaling factor -1.0" in _refusal(path)
    path = _rewrite(src, tmp_path / "ext.gguf", meta={"qwen2.rope.scaling.yarn_ext_factor": 0.5})
    assert "extrapolation factor 0.5" in _refusal(path, UnsupportedArchitecture)
    path = _rewrite(src, tmp_path / "dynamic.gguf", meta={"qwen2.rope.scaling.type": "dynamic"})
    assert "rope scaling type 'dynamic'" in _refusal(path, UnsupportedArchitecture)
