"""Mamba2 hybrids (llmd.model.mamba2) against transformers on CPU fp32: Granite 4 (Mamba2 and attention layers with
a shared MLP and experts, no positions: Granite 4.0-H's shape; and with RoPE, dense, tied) and Nemotron-H (Mamba2,
attention and MLP-only layers; and Nemotron 3's Mamba2, attention and MoE layers: squared-ReLU experts without a gate
behind a sigmoid router with its selection bias, a shared expert, in Nano's shape and in Super's with latent experts
and expert groups), from HF folders and GGUF files written as llama.cpp's converter writes them (granitehybrid,
nemotron_h, nemotron_h_moe; F32, and Q8_0 kept packed against its dequantized weights). A 40-token prompt fed in two
chunks, then 24 decode steps, each step's logits within 1e-4 of transformers'; through the engine (Nemotron-H from its
folder, Nemotron 3 Nano from its packed Q8_0 file: the experts in one C call), batched equals alone and a prefix hit
equals a miss. The scan (llmd.model.recurrent.mamba2_scan: the C kernel on fp32 CPU tensors where
it builds, and its torch reference mamba2_scan_ref) against transformers' chunked scan, and its batched forms against
one sequence at a time. Bad configs and checkpoints are refused by name.
"""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch
from engine_testing import make_engine, no_leaked_blocks  # noqa: F401  (autouse leak check)
from llmd.engine import SamplingParams, generate
from llmd.errors import ModelFileError, UnsupportedArchitecture
from llmd.model.config import ModelConfig, MoEConfig
from llmd.model.loader import load_model
from llmd.model.recurrent import StateMetadata, allocate_states, mamba2_scan, mamba2_scan_ref, state_bytes_per_sequence
from test_engine import GREEDY, random_prompts, run_alone, run_staggered
from test_families import TOLERANCE, _rewrite, our_logits, prompt_ids, reference_logits
from test_moe import assert_compiled_experts, assert_packed_matches_dequantized
from tiny_models import MAMBA2_KINDS, write_tiny_gguf, write_tiny_model

GGUF_KINDS = ("granite_hybrid", "granite_hybrid_dense", "nemotron_h", "nemotron_h_moe", "nemotron_h_moe_latent")
PATTERNS = {"nemotron_h": "M*-M", "nemotron_h_moe": "ME*EM", "nemotron_h_moe_latent": "ME*EM"}
_KIND_OF = {"M": "mamba", "*": "full_attention", "-": "mlp", "E": "moe"}


def layer_types(kind: str) -> list[str]:
    return [_KIND_OF[c] for c in PATTERNS.get(kind, "M*M")]


@pytest.fixture(scope="module")
def mamba2_models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("mamba2_models")
    return {kind: write_tiny_model(root / kind, kind, seed=i) for i, kind in enumerate(MAMBA2_KINDS)}


@pytest.fixture(scope="module")
def mamba2_ggufs(mamba2_models, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("mamba2_ggufs")
    return {(kind, t): write_tiny_gguf(mamba2_models[kind], root / f"{kind}-{t}.gguf", t)
            for kind in GGUF_KINDS for t in ("F32", "Q8_0")}


@pytest.fixture(scope="module")
def expected(mamba2_models) -> dict:
    """transformers' logits per family for one prompt and its decode."""
    from transformers import AutoModelForCausalLM

    prompt, decode = prompt_ids(40), prompt_ids(24, seed=1)
    out = {}
    for kind, folder in mamba2_models.items():
        ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        out[kind] = reference_logits(ref, prompt, decode)
    return out


def logits_of(lm) -> torch.Tensor:
    return our_logits(lm, prompt_ids(40), prompt_ids(24, seed=1))


@pytest.mark.parametrize("kind", MAMBA2_KINDS)
def test_hf_folder_matches_transformers(kind, mamba2_models, expected):
    lm = load_model(mamba2_models[kind], dtype=torch.float32, device="cpu")
    c = lm.config
    assert c.layer_types == layer_types(kind)
    assert [c.is_recurrent(i) for i in range(c.num_hidden_layers)] == [t == "mamba" for t in c.layer_types]
    assert c.num_kv_layers == 1  # Nemotron-H's MLP-only and MoE layers keep nothing
    diff = (logits_of(lm) - expected[kind]).abs().max().item()
    assert diff < TOLERANCE, f"{kind}: max |logit difference| {diff:.2e}"


@pytest.fixture(scope="module")
def engine_models(mamba2_models, mamba2_ggufs) -> dict:
    """Nemotron-H from its folder; Nemotron 3 Nano from its Q8_0 file as a user runs it (packed, the default integer
    activation path), its experts in one C call where the library builds."""
    packed = load_model(mamba2_ggufs["nemotron_h_moe", "Q8_0"], dtype=torch.float32, device="cpu")
    assert_compiled_experts(packed)
    return {"nemotron_h": load_model(mamba2_models["nemotron_h"], dtype=torch.float32, device="cpu"),
            "nemotron_h_moe": packed}


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("kind", ["nemotron_h", "nemotron_h_moe"])
def test_engine_batched_and_chunked_equal_alone(kind, engine_models):
    """Through the engine's runner (a state slot per sequence, KV only for the attention layer, nothing for
    Nemotron-H's MLP-only and MoE layers): staggered, chunked prompts with decodes riding along give each prompt's solo
    greedy tokens."""
    lm = engine_models[kind]
    prompts = random_prompts(6, 5, 60, 570, seed=3)
    params = SamplingParams(max_tokens=10, **GREEDY)
    alone = run_alone(lm, prompts, params)
    engine = make_engine(lm, max_num_batched_tokens=24)
    mamba = [i for i, t in enumerate(layer_types(kind)) if t == "mamba"]
    assert len(engine.runner.layer_windows) == 1 and sorted(engine.runner.states) == mamba
    batched = run_staggered(engine, prompts, params)
    assert [batched[str(i)] for i in range(len(prompts))] == alone


@pytest.mark.usefixtures("one_torch_thread")
def test_prefix_hit_restores_a_checkpoint_and_equals_a_miss(engine_models):
    lm = engine_models["nemotron_h_moe"]
    shared = prompt_ids(40, seed=9)  # 2.5 blocks of 16: the checkpoint sits at the last block boundary, 32
    prompts = [shared + p for p in random_prompts(3, 3, 20, 570, seed=10)]
    params = SamplingParams(max_tokens=8, **GREEDY)
    alone = run_alone(lm, prompts, params)
    engine = make_engine(lm)
    first = generate(engine, prompts[:1], params)[0].token_ids
    rest = [r.token_ids for r in generate(engine, prompts[1:], params)]
    assert [first] + rest == alone
    stats = engine.stats()
    assert stats.kv.prefix_hits_tokens >= 2 * 32 and stats.kv.state_checkpoint_hits >= 2


def _hub_style(src, dst, change) -> None:
    """A copy of the folder whose config.json is rewritten by `change` (a function of the parsed dict)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    change(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))


def test_hub_configs_load_as_transformers_5s(mamba2_models, expected, tmp_path):
    """The hub's config spellings: Granite's layers_block_type of mamba / attention, Nemotron-H's
    hybrid_override_pattern with num_hidden_layers, its older mamba_* keys and a JSON Infinity time_step_limit."""
    def granite(cfg):
        cfg["layers_block_type"] = [{"linear_attention": "mamba", "full_attention": "attention"}[t]
                                    for t in cfg.pop("layer_types")]

    def nemotron(cfg):
        del cfg["layers_block_type"]
        cfg.update(hybrid_override_pattern="M*-M", num_hidden_layers=4, mamba_d_conv=cfg.pop("conv_kernel"),
                   mamba_n_groups=cfg.pop("n_groups"), time_step_limit=[0.0, math.inf])

    for kind, change in (("granite_hybrid", granite), ("nemotron_h", nemotron)):
        _hub_style(mamba2_models[kind], tmp_path / kind, change)
        lm = load_model(tmp_path / kind, dtype=torch.float32, device="cpu")
        assert (logits_of(lm) - expected[kind]).abs().max().item() < TOLERANCE


def test_stacked_experts_load_as_the_per_expert_ones(mamba2_models, expected, tmp_path):
    """transformers 5's in-memory layout of Nemotron-H's experts (mixer.experts.up_proj [E, I, H] and down_proj
    [E, H, I], no .weight), as a checkpoint saved without its conversion reversed holds them."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "stacked"
    shutil.copytree(mamba2_models["nemotron_h_moe"], folder)
    tensors, stacks = {}, {}
    for name, t in load_file(folder / "model.safetensors").items():
        head, sep, rest = name.partition(".experts.")
        if sep:
            e, proj, _ = rest.split(".")
            stacks.setdefault(f"{head}.experts.{proj}", {})[int(e)] = t
        else:
            tensors[name] = t
    tensors |= {name: torch.stack([parts[e] for e in range(len(parts))]) for name, parts in stacks.items()}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    lm = load_model(folder, dtype=torch.float32, device="cpu")
    assert (logits_of(lm) - expected["nemotron_h_moe"]).abs().max().item() < TOLERANCE


def _random_scan_inputs(t: int, heads=4, head_dim=3, groups=2, state=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return dict(x=r(t, heads, head_dim), dt=r(t, heads), dt_bias=r(heads), A=-r(heads).exp(), B=r(t, groups, state),
                C=r(t, groups, state), D=r(heads))


@pytest.mark.parametrize("scan", [mamba2_scan, mamba2_scan_ref])
def test_scan_equals_transformers_chunked_scan(scan):
    """Our token-by-token scan from a given state equals transformers' chunked (SSD) scan, output and final state,
    over several of its chunks."""
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import mamba2_chunk_scan

    t = 37
    a = _random_scan_inputs(t)
    initial = torch.randn(1, 4, 3, 5, generator=torch.Generator().manual_seed(1))
    state = initial.clone()
    meta = StateMetadata.build([0], [False], [t])
    ours = scan(a["x"], a["dt"], a["dt_bias"], a["A"], a["B"], a["C"], a["D"], state, meta)
    ref, ref_state = mamba2_chunk_scan(a["x"][None], a["dt"][None], a["A"], a["B"][None], a["C"][None], chunk_size=8,
                                       D=a["D"], dt_bias=a["dt_bias"], initial_states=initial, dt_softplus=True,
                                       return_final_states=True)
    assert (ours - ref[0]).abs().max().item() < 1e-5
    assert (state - ref_state).abs().max().item() < 1e-5


@pytest.mark.parametrize("scan", [mamba2_scan, mamba2_scan_ref])
def test_scan_batched_forms_equal_one_sequence_at_a_time(scan):
    """A step of several sequences (their slots, fresh or continuing) computes what each alone computes, for prefill
    chunks and for the all-decode form (within rounding: torch's vector and scalar exp differ in the last bit); a
    fresh sequence ignores its slot's old state; time_step_limit clamps dt."""
    lens = [5, 1, 3]
    a = _random_scan_inputs(sum(lens))
    start = torch.randn(4, 4, 3, 5, generator=torch.Generator().manual_seed(2))
    slots, fresh = [2, 0, 3], [False, True, False]
    for limit in ((0.0, math.inf), (0.2, 0.9)):
        batched = start.clone()
        out = scan(*a.values(), batched, StateMetadata.build(slots, fresh, lens), dt_limit=limit)
        alone, rows, q = start.clone(), [], 0
        for slot, f, n in zip(slots, fresh, lens):
            part = {k: v[q:q + n] if v.shape[0] == sum(lens) else v for k, v in a.items()}
            rows.append(scan(*part.values(), alone, StateMetadata.build([slot], [f], [n]), dt_limit=limit))
            q += n
        assert (out - torch.cat(rows)).abs().max().item() < 1e-6 and (batched - alone).abs().max().item() < 1e-6
        zero = torch.zeros_like(start)  # the fresh sequence (slot 0, old state nonzero) starts from zeros
        part = {k: v[5:6] if v.shape[0] == sum(lens) else v for k, v in a.items()}
        assert torch.equal(rows[1], scan(*part.values(), zero, StateMetadata.build([0], [False], [1]),
                                                dt_limit=limit))
    decode = _random_scan_inputs(3, seed=3)
    batched, alone = start.clone(), start.clone()
    out = scan(*decode.values(), batched, StateMetadata.build(slots, fresh, [1, 1, 1]))  # the decode form
    for i, (slot, f) in enumerate(zip(slots, fresh)):
        part = {k: v[i:i + 1] if v.shape[0] == 3 else v for k, v in decode.items()}
        one = scan(*part.values(), alone, StateMetadata.build([slot], [f], [1]))
        assert (out[i:i + 1] - one).abs().max().item() < 1e-6
    assert (batched - alone).abs().max().item() < 1e-6
    clamped = scan(*decode.values(), start.clone(), StateMetadata.build(slots, fresh, [1, 1, 1]),
                          dt_limit=(0.2, 0.9))
    assert not torch.allclose(clamped, out)


def _config(kind: str, **change) -> dict:
    granite = {"architectures": ["GraniteMoeHybridForCausalLM"], "vocab_size": 64, "hidden_size": 32,
               "intermediate_size": 16, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
               "layer_types": ["mamba", "attention", "mamba"], "mamba_n_heads": 4, "mamba_d_head": 16,
               "mamba_d_state": 8, "mamba_n_groups": 2, "num_local_experts": 4, "shared_intermediate_size": 24}
    nemotron = {"architectures": ["NemotronHForCausalLM"], "vocab_size": 64, "hidden_size": 32,
                "intermediate_size": 48, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                "head_dim": 8, "hybrid_override_pattern": "M*-M", "mamba_num_heads": 4, "mamba_head_dim": 16,
                "ssm_state_size": 8, "n_groups": 2}
    return {**(granite if kind == "granite" else nemotron), **change}


def test_config_fields_and_the_cache_each_layer_keeps():
    g = ModelConfig.from_hf_config(_config("granite"))
    assert g.layer_types == ["mamba", "full_attention", "mamba"] and g.intermediate_size == 24
    assert g.moe is not None and g.moe.intermediate_size == 16 and g.moe.router == "softmax_topk"
    assert g.recurrent is not None and g.recurrent.state_shape == (4, 16, 8) and g.recurrent.conv_channels == 96
    assert not g.uses_rope and g.recurrent.conv_bias
    m = ModelConfig.from_hf_config(_config("nemotron", hybrid_override_pattern="ME*E", n_routed_experts=8,
                                           num_experts_per_tok=2, moe_intermediate_size=16,
                                           moe_shared_expert_intermediate_size=24, moe_latent_size=8, n_group=2,
                                           topk_group=1, routed_scaling_factor=2.5))
    assert m.layer_types == ["mamba", "moe", "full_attention", "moe"] and m.kv_layers == [2]
    assert m.moe == MoEConfig(8, 2, 16, router="sigmoid", scaling=2.5, selection_bias=True, groups=2, groups_kept=1,
                              shared_intermediate_size=24, activation="relu2", latent_size=8)
    assert not m.moe.gated and m.moe.gate_up_rows == 16
    n = ModelConfig.from_hf_config(_config("nemotron", num_hidden_layers=None))  # the pattern gives the count
    assert n.num_hidden_layers == 4 and n.layer_types == ["mamba", "full_attention", "mlp", "mamba"]
    assert n.kv_layers == [1] and [n.is_mixerless(i) for i in range(4)] == [False, False, True, False]
    assert n.recurrent is not None and n.recurrent.dt_limit == (0.0, math.inf)
    # two Mamba2 layers' conv inputs (3 of 96 channels, fp32) and states (4 x 16 x 8, fp32); nothing for the MLP
    assert state_bytes_per_sequence(n, torch.float32) == 2 * (96 * 3 * 4 + 4 * 16 * 8 * 4)
    states = allocate_states(n, 2, torch.float32, "cpu")
    assert sorted(states) == [0, 3] and states[0].ssm.shape == (2, 4, 16, 8)


@pytest.mark.parametrize("kind, change, words", [
    ("granite", {"mamba_d_head": 12}, "mamba_n_heads 4 x mamba_d_head 12"),
    ("granite", {"mamba_n_groups": 3}, "4 Mamba2 heads do not split into 3 groups"),
    ("granite", {"layer_types": ["mamba", "attention"]}, "layer_types"),
    ("nemotron", {"hybrid_override_pattern": "M*X"}, "layer pattern"),
    ("nemotron", {"time_step_limit": [0.0, "lots"]}, "time_step_limit"),
    ("nemotron", {"hybrid_override_pattern": "ME*M", "n_routed_experts": 6, "n_group": 4}, "expert groups 4"),
])
def test_bad_configs_are_named(kind, change, words):
    with pytest.raises(ModelFileError, match=words):
        ModelConfig.from_hf_config(_config(kind, **change))


@pytest.mark.parametrize("kind, change, words", [
    ("nemotron", {"mlp_hidden_act": "gelu"}, "mlp_hidden_act"),
    ("granite", {"hidden_act": "gelu"}, "hidden_act"),
])
def test_unsupported_variants_are_named(kind, change, words):
    with pytest.raises(UnsupportedArchitecture, match=words):
        ModelConfig.from_hf_config(_config(kind, **change))


@pytest.mark.parametrize("kind, change, words", [
    # the state is larger than the checkpoint's: its in_proj and conv have the wrong shape
    ("granite_hybrid", lambda c: c.update(mamba_d_state=16), r"tensor 'model\.layers\.0\.mamba\..*' has shape"),
    # the pattern swaps two layers' kinds
    ("granite_hybrid", lambda c: c.update(layer_types=["full_attention", "linear_attention", "linear_attention"]),
     r"'model\.layers\.0\.mamba\..*' belongs to a mamba layer, but the config's layer pattern makes layer 0 a "
     r"full_attention layer"),
    ("nemotron_h", lambda c: c.update(layers_block_type=["linear_attention", "mlp", "full_attention",
                                                         "linear_attention"]),
     r"'backbone\.layers\.1\.mixer\.[qkvo]_proj\.weight' belongs to a full_attention layer, but the config's layer "
     r"pattern makes layer 1 a mlp layer"),
    ("nemotron_h_moe", lambda c: c.update(layers_block_type=["moe", "linear_attention", "full_attention", "moe",
                                                             "linear_attention"]),
     r"'backbone\.layers\.0\.mixer\.\w+' belongs to a mamba layer, but the config's layer pattern makes layer 0 a "
     r"moe layer"),
    ("nemotron_h_moe", lambda c: c.update(layers_block_type=["linear_attention", "full_attention", "moe", "moe",
                                                             "linear_attention"]),
     r"'backbone\.layers\.1\.mixer\.(gate|experts|shared_experts)\.\S+' belongs to a moe layer, but the config's "
     r"layer pattern makes layer 1 a full_attention layer"),
    # the experts' latent space narrower than the checkpoint's
    ("nemotron_h_moe_latent", lambda c: c.update(moe_latent_size=16),
     r"tensor 'model\.layers\.1\.mlp\.experts\.0\.\w+_proj\.weight' has shape \(\d+, 32\), expected"),
])
def test_checkpoints_that_do_not_match_the_config_are_named(kind, change, words, mamba2_models, tmp_path):
    _hub_style(mamba2_models[kind], tmp_path / kind, change)
    with pytest.raises(ModelFileError, match=words):
        load_model(tmp_path / kind, dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("quant", ["none", "gguf"])
@pytest.mark.parametrize("kind", GGUF_KINDS)
def test_gguf_matches_transformers(kind, quant, mamba2_ggufs, expected):
    """Granite 4 as llama.cpp's converter writes it (A as -exp(A_log), the conv squeezed, the norm by group, gate and
    up split, q/k permuted, the layer kinds as per-layer KV head counts), and Nemotron-H (the same Mamba2 transforms;
    the layer kinds as per-layer KV head counts and feed-forward widths; the experts stacked, without a gate, beside
    the router's selection bias, the shared expert and the latent projections), dequantized or kept packed."""
    lm = load_model(mamba2_ggufs[kind, "F32"], dtype=torch.float32, device="cpu", quant=quant)
    assert lm.config.architecture == ("NemotronHForCausalLM" if kind.startswith("nemotron")
                                      else "GraniteMoeHybridForCausalLM")
    assert lm.config.layer_types == layer_types(kind)
    diff = (logits_of(lm) - expected[kind]).abs().max().item()
    assert diff < TOLERANCE, f"{kind} ({quant}): max |logit difference| {diff:.2e}"


def test_gguf_multi_token_prediction_block_is_left_unread(mamba2_ggufs, expected, tmp_path):
    """Nemotron 3's MTP head as the converter appends it: one more block (attention and experts, counted in
    block_count and in the per-layer arrays), nextn_predict_layers 1; the decoder runs without it."""
    p, rng = "nemotron_h_moe.", np.random.default_rng(0)
    extra = {"blk.5.attn_q.weight": rng.standard_normal((64, 64), np.float32),
             "blk.5.ffn_up_exps.weight": rng.standard_normal((8, 32, 64), np.float32)}
    path = _rewrite(mamba2_ggufs["nemotron_h_moe", "F32"], tmp_path / "mtp.gguf", extra=extra,
                    meta={p + "block_count": 6, p + "nextn_predict_layers": 1,
                          p + "attention.head_count_kv": [0, 0, 2, 0, 0, 2],
                          p + "feed_forward_length": [0, 32, 0, 32, 0, 32]})
    lm = load_model(path, dtype=torch.float32, device="cpu")
    assert lm.config.num_hidden_layers == 5
    assert (logits_of(lm) - expected["nemotron_h_moe"]).abs().max().item() < TOLERANCE


@pytest.mark.parametrize("kind", ["granite_hybrid", "nemotron_h", "nemotron_h_moe", "nemotron_h_moe_latent"])
def test_gguf_q8_0_stays_packed_and_matches_its_dequantized_weights(kind, mamba2_ggufs, monkeypatch):
    from llmd.model.quant import GGUFLinear

    path = mamba2_ggufs[kind, "Q8_0"]
    if kind == "nemotron_h":  # no experts: the logits alone, on the exact-weights activation path
        monkeypatch.setenv("LLMD_CPU_GEMM_ACT", "fp32")
        packed = load_model(path, dtype=torch.float32, device="cpu", quant="gguf")
        dequantized = load_model(path, dtype=torch.float32, device="cpu", quant="none")
        assert (logits_of(packed) - logits_of(dequantized)).abs().max().item() < TOLERANCE
    else:
        assert_packed_matches_dequantized(path, "Q8_0", monkeypatch)  # the experts, and the logits
        packed = load_model(path, dtype=torch.float32, device="cpu", quant="gguf")
    layer = packed.model.model.layers[0]
    mixer = layer.mamba if kind.startswith("granite") else layer.mixer
    assert isinstance(mixer.in_proj, GGUFLinear) and mixer.in_proj.file_type == "Q8_0"


@pytest.mark.parametrize("head_count_kv, words", [
    ([2, 0, 0], r"'model\.layers\.0\.mamba\..*' belongs to a mamba layer, but the config's layer pattern makes "
                r"layer 0 a full_attention layer"),
    ([0, 2], "head_count_kv has 2 entries for 3 layers"),
])
def test_gguf_layer_pattern_that_does_not_match_the_tensors(head_count_kv, words, mamba2_ggufs, tmp_path):
    path = _rewrite(mamba2_ggufs["granite_hybrid", "F32"], tmp_path / "bad.gguf",
                    meta={"granitehybrid.attention.head_count_kv": head_count_kv})
    with pytest.raises(ModelFileError, match=words):
        load_model(path, dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("kind, meta, words", [
    # the layer pattern: layer 0 made an attention layer, layer 3 an MLP layer, each holding Mamba2's tensors
    ("nemotron_h_moe", {"attention.head_count_kv": [2, 0, 2, 0, 0]},
     r"tensor 'blk\.0\.ssm_in\.weight' belongs to a mamba layer, but layer 0 is a full_attention layer"),
    ("nemotron_h", {"feed_forward_length": [0, 0, 128, 128]},
     r"tensor 'blk\.3\.ssm_in\.weight' belongs to a mamba layer, but layer 3 is a mlp layer"),
    ("nemotron_h", {"feed_forward_length": [0, 128]}, r"feed_forward_length is \[0, 128\], not one value per block"),
    # sizes: the experts' width, the latent space, the Mamba2 state
    ("nemotron_h_moe", {"expert_feed_forward_length": 64},
     r"tensor 'blk\.1\.ffn_up_exps\.weight' has shape \[8, 32, 64\], expected \[8, 64, 64\]"),
    ("nemotron_h_moe_latent", {"moe_latent_size": 64},
     r"tensor 'blk\.1\.ffn_up_exps\.weight' has shape \[8, 32, 32\], expected \[8, 32, 64\]"),
    ("nemotron_h", {"ssm.state_size": 16}, r"tensor 'blk\.0\.ssm_in\.weight' has shape \[296, 64\]"),
    # routing llmd would not run as the file means it
    ("nemotron_h_moe", {"expert_gating_func": 1}, "expert_gating_func 1"),
    ("nemotron_h_moe", {"expert_group_count": 2}, "expert_group_count 2 without"),
])
def test_nemotron_h_gguf_that_does_not_match_its_metadata_is_named(kind, meta, words, mamba2_ggufs, tmp_path):
    """Checked from the header, before any weight is read; the error names the file and the tensor."""
    src = mamba2_ggufs[kind, "F32"]
    arch = "nemotron_h_moe" if "moe" in kind else "nemotron_h"
    path = _rewrite(src, tmp_path / "bad.gguf", meta={f"{arch}.{k}": v for k, v in meta.items()})
    with pytest.raises(ModelFileError, match=words) as caught:
        load_model(path, dtype=torch.float32, device="cpu")
    assert str(caught.value).startswith(str(path))
