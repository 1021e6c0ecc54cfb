"""Mixtures of experts (llmd.model.moe) against transformers on CPU fp32: Qwen3-MoE (q/k norm, a dense layer),
Qwen2-MoE (a gated shared expert, weights not renormalised), Mixtral, GLM-4.5 (sigmoid scores with a selection bias
and expert groups, shared expert, partial rotary); from HF folders, and (Qwen, Mixtral) from GGUF files written as
llama.cpp's converter writes them, experts stacked and kept packed. Then the engine's invariants with experts:
batched == alone, prefix hit == miss, preempted == not, speculation on == off; and bad files refused by name.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from engine_testing import make_engine, no_leaked_blocks  # noqa: F401  (autouse leak check)
from llmd.engine import SamplingParams, generate
from llmd.errors import ModelFileError
from llmd.kernels import cpu_gemm, cpu_moe
from llmd.model.config import ModelConfig
from llmd.model.loader import load_model
from llmd.model.moe import Experts, expert_hits
from llmd.model.quant.gguf_experts import GGUFExpertLinear
from test_engine import GREEDY, random_prompts, run_alone, run_staggered
from test_families import TOLERANCE, _rewrite, our_logits, prompt_ids, reference_logits
from tiny_models import MOE_KINDS, write_tiny_gguf, write_tiny_model

GGUF_KINDS = ("qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "gpt_oss")


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("moe_models")
    return {kind: write_tiny_model(root / kind, kind) for kind in MOE_KINDS}


@pytest.fixture(scope="module")
def moe_ggufs(moe_models, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("moe_ggufs")
    return {(kind, t): write_tiny_gguf(moe_models[kind], root / f"{kind}-{t}.gguf", t)
            for kind in GGUF_KINDS for t in ("F32", "Q8_0")}


@pytest.fixture(scope="module")
def expected(moe_models) -> dict:
    """transformers' logits per family for one prompt and its decode."""
    from transformers import AutoModelForCausalLM

    prompt, decode = prompt_ids(40), prompt_ids(24, seed=1)
    out = {}
    for kind, folder in moe_models.items():
        ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        out[kind] = reference_logits(ref, prompt, decode)
    return out


def logits_of(lm) -> torch.Tensor:
    return our_logits(lm, prompt_ids(40), prompt_ids(24, seed=1))


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_hf_folder_matches_transformers(kind, moe_models, expected):
    lm = load_model(moe_models[kind], dtype=torch.float32, device="cpu")
    assert lm.config.moe is not None
    layers = lm.model.model.layers
    assert any(isinstance(getattr(layer.mlp, "experts", None), Experts) for layer in layers)
    diff = (logits_of(lm) - expected[kind]).abs().max().item()
    assert diff < TOLERANCE, f"{kind}: max |logit difference| {diff:.2e}"
    hits = expert_hits(lm.model)
    assert hits and all(sum(h) > 0 for h in hits)  # every MoE layer routed the tokens somewhere, and counted them


@pytest.mark.parametrize("quant", ["none", "gguf"])
@pytest.mark.parametrize("kind", GGUF_KINDS)
def test_gguf_matches_transformers(kind, quant, moe_ggufs, expected):
    lm = load_model(moe_ggufs[kind, "F32"], dtype=torch.float32, device="cpu", quant=quant)
    assert lm.config.architecture == {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                                      "mixtral": "MixtralForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
                                      "gpt_oss": "GptOssForCausalLM"}[kind]
    diff = (logits_of(lm) - expected[kind]).abs().max().item()
    assert diff < TOLERANCE, f"{kind} ({quant}): max |logit difference| {diff:.2e}"


def assert_packed_matches_dequantized(path, type_name: str, monkeypatch) -> None:
    """The file's experts stay its blocks (resident bytes are the file's) and compute what the dequantized weights
    compute (the exact-weights activation path)."""
    dequantized = load_model(path, dtype=torch.float32, device="cpu", quant="none")
    monkeypatch.setenv("LLMD_CPU_GEMM_ACT", "fp32")
    packed = load_model(path, dtype=torch.float32, device="cpu", quant="gguf")
    experts = [m for m in packed.model.modules() if isinstance(m, GGUFExpertLinear)]
    assert experts and all(p.type_name == type_name for m in experts for p in m.parts)
    fp = next(m for m in dequantized.model.modules() if isinstance(m, Experts)).gate_up_proj.weight
    assert torch.equal(experts[0].dequantized_weight(), fp)
    diff = (logits_of(packed) - logits_of(dequantized)).abs().max().item()
    assert diff < TOLERANCE, f"{path.name}: packed vs dequantized max |logit difference| {diff:.2e}"


@pytest.mark.parametrize("kind", GGUF_KINDS)
def test_packed_experts_match_their_dequantized_weights(kind, moe_ggufs, monkeypatch):
    assert_packed_matches_dequantized(moe_ggufs[kind, "Q8_0"], "Q8_0", monkeypatch)


def test_mxfp4_experts_stay_packed_and_match_their_dequantized_weights(moe_models, tmp_path, monkeypatch):
    """gpt-oss's expert type, written by gguf's own MXFP4 quantizer."""
    path = write_tiny_gguf(moe_models["qwen3_moe"], tmp_path / "qwen3_moe-MXFP4.gguf", "MXFP4")
    assert_packed_matches_dequantized(path, "MXFP4", monkeypatch)


@pytest.fixture(scope="module")
def packed_qwen3_moe(moe_ggufs):
    """Q8_0 experts on the default (integer activation) path, as a user runs a GGUF."""
    return load_model(moe_ggufs["qwen3_moe", "Q8_0"], dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def packed_gpt_oss(moe_ggufs):
    """gpt-oss's Q8_0 experts (biased, the clamped SwiGLU) on the default path."""
    return load_model(moe_ggufs["gpt_oss", "Q8_0"], dtype=torch.float32, device="cpu")


def assert_compiled_experts(lm, acts: tuple[str, str] | None = None) -> bool:
    """Every MoE layer of `lm` chose the one C call (of the layer's activation, with its biases) where the library
    builds, else the Python grouping; True where compiled."""
    layers = [m for m in lm.model.modules() if isinstance(m, Experts)]
    assert layers
    if not cpu_gemm.available():
        assert all(m.kernel is None for m in layers)
        return False
    for m in layers:
        assert isinstance(m.kernel, cpu_moe.MoEKernel) and m.kernel.activation == m.moe.activation
        assert (m.kernel.moe.gate_up_bias is not None) == (m.gate_up_proj.bias is not None)
        assert (m.kernel.moe.down_bias is not None) == (m.down_proj.bias is not None)
        assert acts is None or m.kernel.acts == acts
    return True


@pytest.mark.parametrize("kind", ["packed_qwen3_moe", "packed_gpt_oss"])
def test_packed_experts_run_as_one_c_call_with_the_python_groupings_bits(kind, request):
    """Loaded on the CPU, each MoE layer's packed experts are chosen to run as one C call per step
    (llmd.kernels.cpu_moe), gpt-oss's biased experts with the clamped SwiGLU too; the logits are the Python grouping's
    (Experts.grouped) bit for bit."""
    lm = request.getfixturevalue(kind)
    if not assert_compiled_experts(lm, ("int8", "int8")):
        return
    layers = [m for m in lm.model.modules() if isinstance(m, Experts)]
    assert kind != "packed_gpt_oss" or all(m.moe.activation == "swiglu_clamped" and m.down_proj.bias is not None
                                           for m in layers)
    compiled = logits_of(lm)
    kernels = [m.kernel for m in layers]
    try:
        for m in layers:
            m.kernel = None  # prepared: forward takes the Python grouping
        grouped = logits_of(lm)
    finally:
        for m, kernel in zip(layers, kernels):
            m.kernel = kernel
    assert torch.equal(compiled, grouped)


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("kind", ["packed_qwen3_moe", "glm4_moe", "gpt_oss", "packed_gpt_oss"])
def test_engine_batched_and_prefix_hits_equal_alone(kind, request, moe_models):
    lm = request.getfixturevalue(kind) if kind.startswith("packed") else \
        load_model(moe_models[kind], dtype=torch.float32, device="cpu")
    shared = prompt_ids(40, seed=9)  # a common prefix of whole blocks: later requests hit the prefix cache
    prompts = [shared + p for p in random_prompts(8, 2, 40, 570, seed=10)]
    params = SamplingParams(max_tokens=16, **GREEDY)
    alone = run_alone(lm, prompts, params)
    engine = make_engine(lm, max_num_batched_tokens=32)  # prompts are chunked too
    batched = run_staggered(engine, prompts, params)
    assert [batched[str(i)] for i in range(len(prompts))] == alone
    stats = engine.stats()
    assert stats.kv.prefix_hits_tokens > 0
    moe_layers = sum(lm.config.moe.is_sparse(i) for i in range(lm.config.num_hidden_layers))
    assert len(stats.expert_hits) == moe_layers and all(len(h) == lm.config.moe.num_experts
                                                         for h in stats.expert_hits)


@pytest.mark.usefixtures("one_torch_thread")
def test_engine_preempted_and_speculating_equal_plain(packed_qwen3_moe):
    prompts = random_prompts(6, 10, 40, 570, seed=2)
    params = SamplingParams(max_tokens=24, **GREEDY)
    ample = [r.token_ids for r in generate(make_engine(packed_qwen3_moe), prompts, params)]
    engine = make_engine(packed_qwen3_moe, num_kv_blocks=10)
    assert [r.token_ids for r in generate(engine, prompts, params)] == ample
    assert engine.stats().num_preemptions > 0
    spec = make_engine(packed_qwen3_moe, speculative_mode="draft", draft_model="self:1", num_speculative_tokens=3)
    assert [r.token_ids for r in generate(spec, prompts, params)] == ample
    assert spec.stats().spec is not None and spec.stats().spec.accepted_total > 0


# ---- bad files and configs -------------------------------------------------------------------------------------


def _gguf_refusal(path) -> str:
    with pytest.raises(ModelFileError) as info:
        load_model(path, dtype=torch.float32, device="cpu")
    assert str(path) in str(info.value)
    return str(info.value)


def test_expert_count_that_does_not_match_the_tensors(moe_ggufs, tmp_path):
    path = _rewrite(moe_ggufs["qwen3_moe", "F32"], tmp_path / "count.gguf", meta={"qwen3moe.expert_count": 6})
    message = _gguf_refusal(path)  # from the header: the first tensor that disagrees with 6 experts
    assert "ffn_gate_inp.weight" in message and "[8, 64], expected [6, 64]" in message and "6 experts" in message


def test_missing_expert_tensor(moe_ggufs, tmp_path):
    path = _rewrite(moe_ggufs["qwen3_moe", "F32"], tmp_path / "missing.gguf", drop=("blk.0.ffn_up_exps.weight",))
    assert "missing" in _gguf_refusal(path)


def test_router_of_the_wrong_width(moe_ggufs, tmp_path):
    path = _rewrite(moe_ggufs["qwen3_moe", "F32"], tmp_path / "router.gguf",
                    change={"blk.0.ffn_gate_inp.weight": np.zeros((6, 64), np.float32)})
    message = _gguf_refusal(path)
    assert "ffn_gate_inp.weight" in message and "[6, 64], expected [8, 64]" in message


@pytest.mark.parametrize("change,problem", [({"num_experts_per_tok": 9}, "experts per token"),
                                            ({"moe_intermediate_size": 0}, "intermediate size")])
def test_bad_moe_configs_name_the_problem(change, problem, moe_models):
    import json

    cfg = json.loads((moe_models["qwen3_moe"] / "config.json").read_text())
    with pytest.raises(ModelFileError, match=problem):
        ModelConfig.from_hf_config({**cfg, **change})


def test_gguf_writer_quantizes_stacked_experts():
    """The test files' experts are what llama.cpp quantizes: each expert's rows in blocks (a guard on the writer)."""
    data = np.random.default_rng(0).standard_normal((4, 8, 64)).astype(np.float32)
    blocks = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
    assert blocks.shape == (4, 8, 68)


# ---- served: a real daemon and the official client --------------------------------------------------------------


def test_served_by_a_real_daemon(moe_ggufs, tmp_path):
    """A Qwen3-MoE GGUF named on the command line answers the OpenAI client (streamed and not, the same greedy
    text), and the stats report where its tokens went."""
    import json
    import shutil
    import urllib.request

    import openai
    from llmd_daemon_proc import start_daemon

    path = tmp_path / "tiny-moe.gguf"
    shutil.copy(moe_ggufs["qwen3_moe", "Q8_0"], path)
    daemon = start_daemon(tmp_path / "llmd", "--model", str(path))
    try:
        client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="x", max_retries=0)
        whole = client.completions.create(model="tiny-moe", prompt="def fibonacci(n):", max_tokens=12,
                                          temperature=0)
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model="tiny-moe", prompt="def fibonacci(n):", max_tokens=12, temperature=0, stream=True))
        assert whole.usage.completion_tokens == 12 and streamed == whole.choices[0].text
        with urllib.request.urlopen(daemon.url + "/v1/llmd/stats", timeout=10) as resp:
            stats = json.loads(resp.read())
        (served,) = stats["models"]
        hits = served["stats"]["expert_hits"]
        assert len(hits) == 1 and sum(hits[0]) >= 2 * 2 * 12  # layer 0: top-2 of each prompt and decoded token
    finally:
        assert daemon.stop() == 0, daemon.log()


# ---- gpt-oss: sinks, windows, YaRN, biased router and experts; its HF layouts (fp and MXFP4) and GGUF MXFP4 -----


def _mxfp4_rows(w: torch.Tensor) -> np.ndarray:
    """[E, out, in] -> GGUF MXFP4 rows [E, out, in / 32 * 17] (gguf's quantizer)."""
    return gguf.quants.quantize(w.float().numpy(), gguf.GGMLQuantizationType.MXFP4)


def _hf_blocks(rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF MXFP4 rows -> transformers' `_blocks` [..., in/32, 16] (element 2i in byte i's low nibble) and `_scales`."""
    blocks = rows.reshape(*rows.shape[:-1], -1, 17)
    codes = np.concatenate((blocks[..., 1:] & 0x0F, blocks[..., 1:] >> 4), axis=-1)  # elements 0..31
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return torch.from_numpy(packed), torch.from_numpy(np.ascontiguousarray(blocks[..., 0]))


@pytest.fixture(scope="module")
def gpt_oss_forms(moe_models, tmp_path_factory) -> dict:
    """The tiny gpt-oss with MXFP4-representable experts, as an fp HF folder (transformers' reference), as the HF
    MXFP4 checkpoint form (`*_blocks` / `*_scales`) and as a GGUF with MXFP4 experts."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    src = moe_models["gpt_oss"]
    root = tmp_path_factory.mktemp("gpt_oss_forms")
    fp_dir, mx_dir = root / "fp", root / "mxfp4"
    shutil.copytree(src, fp_dir)
    shutil.copytree(src, mx_dir)
    state = load_file(src / "model.safetensors")
    fp, mx = dict(state), {}
    for name, t in state.items():
        if not name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            mx[name] = t
            continue
        rows = _mxfp4_rows(t.transpose(1, 2))  # the checkpoint holds [E, in, out]; MXFP4 blocks run along in
        values = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType.MXFP4)
        fp[name] = torch.from_numpy(np.ascontiguousarray(values)).transpose(1, 2).contiguous()
        mx[name + "_blocks"], mx[name + "_scales"] = _hf_blocks(rows)
    save_file(fp, fp_dir / "model.safetensors")
    save_file(mx, mx_dir / "model.safetensors")
    cfg = json.loads((mx_dir / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router", "attn", "lm_head"]}
    (mx_dir / "config.json").write_text(json.dumps(cfg))
    return {"fp": fp_dir, "mxfp4": mx_dir, "gguf": write_tiny_gguf(fp_dir, root / "gpt-oss.gguf", "MXFP4")}


def test_gpt_oss_forms_match_transformers(gpt_oss_forms, monkeypatch):
    """Past the window (8) and past YaRN's original context (64) with decode; the MXFP4 experts stay packed."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(gpt_oss_forms["fp"], dtype=torch.float32).eval()
    prompt, decode = prompt_ids(70), prompt_ids(24, seed=1)
    expected = reference_logits(ref, prompt, decode)
    monkeypatch.setenv("LLMD_CPU_GEMM_ACT", "fp32")  # the exact-weights path: equal to the reference's values
    for form in ("fp", "mxfp4", "gguf"):
        lm = load_model(gpt_oss_forms[form], dtype=torch.float32, device="cpu")
        packed = [m for m in lm.model.modules() if isinstance(m, GGUFExpertLinear)]
        assert (form != "fp") == bool(packed) and all(p.type_name == "MXFP4" for m in packed for p in m.parts)
        if packed:  # the MXFP4 experts run as one C call per layer and step
            assert_compiled_experts(lm, ("fp32", "fp32"))
        diff = (our_logits(lm, prompt, decode) - expected).abs().max().item()
        assert diff < TOLERANCE, f"gpt-oss {form}: max |logit difference| {diff:.2e}"


def test_gpt_oss_bad_mxfp4_scales_are_named(gpt_oss_forms, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "bad"
    shutil.copytree(gpt_oss_forms["mxfp4"], folder)
    state = load_file(folder / "model.safetensors")
    name = "model.layers.1.mlp.experts.down_proj_scales"
    state[name] = torch.full_like(state[name], 255)  # E8M0 255 is NaN
    save_file(state, folder / "model.safetensors")
    with pytest.raises(ModelFileError, match="down_proj_scales"):
        load_model(folder, dtype=torch.float32, device="cpu")


def test_gpt_oss_mxfp4_without_its_scales_is_named(gpt_oss_forms, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "half"
    shutil.copytree(gpt_oss_forms["mxfp4"], folder)
    state = load_file(folder / "model.safetensors")
    del state["model.layers.0.mlp.experts.gate_up_proj_scales"]
    save_file(state, folder / "model.safetensors")
    with pytest.raises(ModelFileError, match="gate_up_proj_scales.*missing"):
        load_model(folder, dtype=torch.float32, device="cpu")


def test_gpt_oss_mxfp4_experts_filled_under_calibrated_int4(gpt_oss_forms):
    """--quant int4 calibrates the linear layers layer by layer; the packed experts are filled as they stream in."""
    fp = load_model(gpt_oss_forms["fp"], dtype=torch.float32, device="cpu", quant="none")
    int4 = load_model(gpt_oss_forms["mxfp4"], dtype=torch.float32, device="cpu", quant="int4")
    want = [m.gate_up_proj.weight for m in fp.model.modules() if isinstance(m, Experts)]
    got = [m.gate_up_proj.dequantized_weight() for m in int4.model.modules() if isinstance(m, Experts)]
    assert len(got) == len(want) == 2 and all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
