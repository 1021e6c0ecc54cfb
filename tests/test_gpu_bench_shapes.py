"""The GPU check's `shapes` stage (tests/gpu/bench_gpu.py, section shapes) run on the CPU at its tiny scale: the
models it builds have the declared families' features, at full scale the configs have the real checkpoints' shapes,
and its table's figures are positive, with the bytes read per decode step equal to the model's weight bytes plus
the K/V the step attends over. The `moe` and `hybrid` stages (sections moe, hybrid) likewise, under the Triton
interpreter. No speed is asserted (the figures are for reading)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
import bench_gpu  # noqa: E402

from llmd.model.gemma import GemmaCausalLM  # noqa: E402
from llmd.model.llama import CausalLM  # noqa: E402
from llmd.model.quant.layers import Int8Linear  # noqa: E402
from llmd.model.registry import build_model  # noqa: E402

S, F = "sliding_attention", "full_attention"
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_full_scale_configs_are_the_real_checkpoints_shapes():
    gemma = bench_gpu.shape_config("gemma3-4b")
    assert (gemma.architecture, gemma.hidden_size, gemma.num_hidden_layers, gemma.num_attention_heads,
            gemma.num_key_value_heads, gemma.head_dim, gemma.intermediate_size, gemma.vocab_size) == \
        ("Gemma3ForCausalLM", 2560, 34, 8, 4, 256, 10240, 262208)
    # 5 window layers : 1 global, from sliding_window_pattern 6 as transformers derives it
    assert gemma.layer_windows == [None if (i + 1) % 6 == 0 else 1024 for i in range(34)]
    assert [i for i, w in enumerate(gemma.layer_windows) if w is None] == [5, 11, 17, 23, 29]
    assert (gemma.rope_local_theta, gemma.rope_theta, gemma.query_pre_attn_scalar) == (10_000.0, 1_000_000.0, 256)
    assert gemma.rope_scaling == {"rope_type": "linear", "factor": 8.0} and gemma.tie_word_embeddings

    qwen = bench_gpu.shape_config("qwen2.5-7b")
    assert (qwen.architecture, qwen.hidden_size, qwen.num_hidden_layers, qwen.num_attention_heads,
            qwen.num_key_value_heads, qwen.head_dim, qwen.intermediate_size, qwen.vocab_size) == \
        ("Qwen2ForCausalLM", 3584, 28, 28, 4, 128, 18944, 152064)
    assert qwen.attention_bias and qwen.rope_theta == 1_000_000.0 and not qwen.tie_word_embeddings
    assert qwen.layer_windows == [None] * 28  # its config's sliding_window is off (use_sliding_window false)

    # the model classes at these configs hold the checkpoints' parameter counts (built on meta: no memory)
    counts = {}
    for name in ("gemma3-4b", "qwen2.5-7b"):
        with torch.device("meta"):
            model = build_model(bench_gpu.shape_config(name))
        counts[name] = sum(p.numel() for p in model.parameters())
    assert counts["qwen2.5-7b"] == 7_615_616_512  # Qwen2.5-7B's safetensors total
    assert 3.8e9 < counts["gemma3-4b"] < 3.95e9  # Gemma 3 4B's ~4.3B less its ~0.42B vision tower


def test_gemma4_configs_are_the_real_checkpoints_shapes():
    """E4B: 42 layers of 2560, 8 heads (2 KV) of 256, global ones of 512 every sixth layer, the last 18 layers reading
    earlier layers' K/V, per-layer inputs of 256; 31B: 60 layers of 5376, 32 heads (16 KV; 4 on the global layers,
    V from K). Parameter counts: the text models' (E4B's per-layer table included)."""
    e4b, big = bench_gpu.shape_config("gemma4-e4b"), bench_gpu.shape_config("gemma4-31b")
    assert (e4b.architecture, e4b.hidden_size, e4b.num_hidden_layers, e4b.num_attention_heads, e4b.vocab_size,
            e4b.intermediate_size, e4b.sliding_window) == ("Gemma4ForCausalLM", 2560, 42, 8, 262144, 10240, 512)
    assert e4b.layer_head_dims == [512 if (i + 1) % 6 == 0 else 256 for i in range(42)]
    assert e4b.kv_layers == list(range(24)) and e4b.kv_source(41) == 23 and e4b.kv_source(40) == 22
    assert e4b.gemma4.per_layer_input_size == 256 and e4b.final_logit_softcapping == 30.0
    assert (big.hidden_size, big.num_hidden_layers, big.num_attention_heads, big.intermediate_size) == \
        (5376, 60, 32, 21504)
    assert big.layer_kv_heads == [4 if (i + 1) % 6 == 0 else 16 for i in range(60)] and big.gemma4.k_eq_v
    counts = {}
    for name in ("gemma4-e4b", "gemma4-31b"):
        with torch.device("meta"):
            model = build_model(bench_gpu.shape_config(name))
        counts[name] = sum(p.numel() for p in model.parameters())
    assert 7.4e9 < counts["gemma4-e4b"] < 7.5e9 and 30.6e9 < counts["gemma4-31b"] < 30.8e9


def test_tiny_models_keep_the_families_structure():
    config = bench_gpu.shape_config("gemma3-4b", "tiny")
    model, _ = bench_gpu.random_model("fp32", config, "cpu")
    assert type(model) is GemmaCausalLM and model.lm_head is None  # tied head
    attn = [layer.self_attn for layer in model.model.layers]
    assert [a.layer_type for a in attn] == [S] * 5 + [F, S]
    assert [a.window for a in attn] == [16] * 5 + [None, 16]
    assert all(a.q_norm is not None and a.k_norm is not None for a in attn)  # Gemma 3's q/k norms
    assert all(a.scale == 256 ** -0.5 for a in attn)  # query_pre_attn_scalar, not head_dim (16)
    assert (attn[0].num_heads, attn[0].num_kv_heads, attn[0].head_dim) == (4, 2, 16)
    assert attn[0].o_proj.weight.shape == (80, 64)  # q width (heads x head_dim) differs from hidden, as on 4B
    rope = model.model.rotary_emb
    assert rope.sliding is not None and rope.sliding.config.rope_theta == 10_000.0
    assert rope.full.config.rope_theta == 1_000_000.0 and rope.full.config.rope_scaling["factor"] == 8.0
    assert all(float(p.abs().max()) == 0.0 for n, p in model.named_parameters() if "norm" in n)  # scale 1 + 0

    config = bench_gpu.shape_config("qwen2.5-7b", "tiny")
    model, _ = bench_gpu.random_model("int8", config, "cpu")
    assert type(model) is CausalLM and model.lm_head is not None
    layer = model.model.layers[0].self_attn
    assert isinstance(layer.qkv_proj, Int8Linear) and isinstance(model.model.layers[0].mlp.down_proj, Int8Linear)
    assert layer.qkv_proj.bias is not None and layer.qkv_proj.bias.shape == (7 * 16 + 2 * 16,)  # qkv bias
    assert layer.o_proj.bias is None
    assert (layer.num_heads, layer.num_kv_heads) == (7, 1)  # Qwen2.5-7B's 7:1 grouping
    assert config.layer_windows == [None, None]


def _param_bytes(model) -> int:
    """Every parameter and quantized weight buffer, counted from the modules' own names."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total + sum(b.numel() * b.element_size() for n, b in model.named_buffers()
                       if n.endswith(("qweight", "scales", "zeros")))


def test_shapes_stage_on_cpu_prints_a_table_of_positive_figures(tmp_path, capsys):
    rc = bench_gpu.main(["--out", str(tmp_path), "--sections", "shapes", "--name", "gpu_shapes",
                         "--device", "cpu", "--scale", "tiny", "--peak-gbs", "50"])
    out = capsys.readouterr().out
    assert rc == 0, out
    results = json.loads((tmp_path / "gpu_shapes.json").read_text())
    rows = results["shapes"]
    assert [(r["model"], r["mode"]) for r in rows] == [("gemma3-4b", "fp32"), ("qwen2.5-7b", "fp32"),
                                                       ("gemma3-4b", "int8"), ("qwen2.5-7b", "int8")]
    run = bench_gpu.SHAPE_RUNS["tiny"]
    contexts = [run["prompt_len"] + s + 1 for s in range(run["warmup"], run["warmup"] + run["steps"])]
    for row in rows:
        assert "error" not in row
        config = bench_gpu.shape_config(row["model"], "tiny")
        model, _ = bench_gpu.random_model(row["mode"], config, "cpu")
        embed = model.model.embed_tokens.weight.numel() * 4  # fp32 activations: an fp32 table
        params = _param_bytes(model)
        assert row["weight_bytes"] == params
        assert row["weight_read_bytes"] == params - (embed if model.lm_head is not None else 0)
        # K/V per token per layer, fp32; Gemma's window layers read at most their 16 tokens
        per_token = 2 * config.num_key_value_heads * config.head_dim * 4
        windows = [16] * 5 + [None, 16] if row["model"] == "gemma3-4b" else [None, None]
        for batch in run["batches"]:
            kv = sum(batch * per_token * (c if w is None else min(c, w)) for c in contexts for w in windows)
            figures = row[f"b{batch}"]
            assert figures["bytes_per_step"] == pytest.approx(row["weight_read_bytes"] + kv / len(contexts))
            assert figures["gbs"] == pytest.approx(figures["tok_s"] / batch * figures["bytes_per_step"] / 1e9)
            assert figures["tok_s"] > 0 and figures["pct_roofline"] > 0
        assert row["prefill_tok_s"] > 0 and row["mem_peak_bytes"] >= row["mem_weights_bytes"] > 0
    # the table: a header, then one line per row whose every figure is a positive number
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["model", "mode"])
    table = lines[header + 1:header + 1 + len(rows)]
    for line, row in zip(table, rows, strict=True):
        name, mode, *cells = line.split()
        assert (name, mode) == (row["model"], row["mode"])
        assert len(cells) == len(bench_gpu.SHAPE_COLUMNS) - 2
        assert all(math.isfinite(float(c)) and float(c) > 0 for c in cells), line


def test_gemma4_shapes_on_cpu(tmp_path, capsys):
    """The gemma4 stage's models at the tiny scale: each layer's K/V in its own head shape, a sharing layer reading its
    source's again; the per-layer table (one row per token) left out of the bytes a step reads."""
    rc = bench_gpu.main(["--out", str(tmp_path), "--sections", "shapes", "--name", "gpu_shapes", "--device", "cpu",
                         "--scale", "tiny", "--peak-gbs", "50", "--models", "gemma4-e4b,gemma4-31b"])
    assert rc == 0, capsys.readouterr().out
    rows = json.loads((tmp_path / "gpu_shapes.json").read_text())["shapes"]
    assert [(r["model"], r["mode"]) for r in rows] == [("gemma4-e4b", "fp32"), ("gemma4-31b", "fp32"),
                                                       ("gemma4-e4b", "int8"), ("gemma4-31b", "int8")]
    run = bench_gpu.SHAPE_RUNS["tiny"]
    context = run["prompt_len"] + run["warmup"] + 1  # the first timed step's
    for row in rows:
        config = bench_gpu.shape_config(row["model"], "tiny")
        model, _ = bench_gpu.random_model(row["mode"], config, "cpu")
        table = getattr(model.model, "embed_tokens_per_layer", None)
        assert row["weight_read_bytes"] == _param_bytes(model) - (table.weight.numel() * 4 if table else 0)
        e4b = row["model"] == "gemma4-e4b"
        period = [(1 if e4b else 2, 16, 16)] * 5 + [(1, 32, None)]  # (KV heads, head size, window) per layer
        kv = sum(2 * h * d * 4 * (context if w is None else min(context, w)) for h, d, w in period * (1 + e4b))
        assert bench_gpu.kv_read_bytes(config, 1, context, 4) == kv
        assert "error" not in row and row["b1"]["tok_s"] > 0 and row["prefill_tok_s"] > 0


def test_device_cpu_is_refused_for_the_cuda_only_sections(tmp_path):
    with pytest.raises(SystemExit):
        bench_gpu.main(["--out", str(tmp_path), "--device", "cpu"])


def test_moe_stage_at_tiny_scale():
    """The moe stage's code at gpt-oss-20b's tiny shape (MXFP4, biases, clamped SwiGLU): decode and a dot-tiling
    batch, under the interpreter without CUDA; each row checked against the reference, its GB/s the hit experts'
    bytes (blocks and biases) over its time."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = bench_gpu.moe_bandwidth(4800.0, device=device, scale="tiny", batches=(1, 9), models=("gpt-oss-20b",))
    hidden, inter, experts, top_k, kind, _, _ = bench_gpu.MOE_SHAPES["tiny"]["gpt-oss-20b"]
    assert kind == "MXFP4"
    blocks = (2 * inter * hidden + hidden * inter) // 32 * 17  # 17 bytes per 32 weights
    biases = (2 * inter + hidden) * (2 if device == "cuda" else 4)
    assert [r["batch"] for r in rows] == [1, 9]
    for row in rows:
        assert "error" not in row and row["rel_err"] < 2e-2
        assert 0 < row["experts_hit"] <= min(experts, row["batch"] * top_k)
        assert row["gbs"] == pytest.approx(row["experts_hit"] * (blocks + biases) / (row["us"] / 1e3) / 1e6)


def test_hybrid_stage_at_tiny_scale():
    """The hybrid stage's code at Qwen3.5-9B's and Granite-4.0-H-Small's tiny shapes: decode steps, the prefill chunk
    by each delta-rule (scan) kernel (the reference timed once, beside the chunked one), every result and state
    checked against the reference; GB/s the fp32 states read and written over the delta rule's (scan's) time."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = bench_gpu.hybrid_recurrent(4800.0, device=device, scale="tiny")
    hk, hv, d, taps, batches, chunk = bench_gpu.HYBRID_SHAPES["tiny"]["qwen3.5-9b"]
    heads, p, n, groups, taps, mamba_batches, mamba_chunk = bench_gpu.MAMBA2_SHAPES["tiny"]["granite-4.0-h-small"]
    cases = [f"decode batch {b}" for b in batches] + [f"prefill {chunk} chunked", f"prefill {chunk} by token"]
    mamba_cases = [f"decode batch {b}" for b in mamba_batches] + \
        [f"prefill {mamba_chunk} chunked", f"prefill {mamba_chunk} by token"]
    assert [(r["model"], r["case"]) for r in rows] == [("qwen3.5-9b", c) for c in cases] + \
        [("granite-4.0-h-small", c) for c in mamba_cases]
    for row in rows:
        assert "error" not in row and max(row["rel_err"].values()) < (2e-2 if device == "cuda" else 1e-5)
        state_bytes, us = (hv * d * d * 8, row["rule_us"]) if row["model"] == "qwen3.5-9b" else \
            (heads * p * n * 8, row["scan_us"])
        assert row["state_gbs"] == pytest.approx(row["batch"] * state_bytes / (us / 1e3) / 1e6)
        assert row["conv_us"] > 0 and row["tok_s"] > 0
    for model_rows in (rows[: len(cases)], rows[len(cases) :]):
        assert ("reference_ms" in model_rows[-2]) and ("reference_ms" not in model_rows[-1])
