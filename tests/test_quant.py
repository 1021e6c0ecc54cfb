"""Weight-only quantization (llmd.model.quant): layers against the dequantized-weight matmul, GGUF blocks converted
exactly, and quantized models within their error budget."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from llmd.kernels import cpu_gemm
from llmd.kernels import quant_matmul as qmm
from llmd.model import quant
from llmd.model.gguf import _GGUFFile, dequantize
from llmd.model.linear import TransposedLinear
from llmd.model.loader import load_model
from simple_driver import greedy_generate, prefill_logits


def _linear(n: int, k: int, bias: bool = False, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    layer = nn.Linear(k, n, bias=bias)
    layer.weight.data.normal_(0, 0.05)
    return layer


@pytest.fixture(params=["torch-cpu-kernel", "dequant-fallback"])
def cpu_path(request, monkeypatch):
    """Run each layer test through both CPU paths, whichever this CPU would pick by itself."""
    fast = request.param == "torch-cpu-kernel"
    monkeypatch.setattr(quant.layers, "_cpu_kernel_fast", {"int8": fast, "int4": fast})
    return request.param


@pytest.mark.parametrize("mode,group", [("int8", None), ("int4-g32", 32), ("int4-g64", 64), ("int4-g128", 128)])
@pytest.mark.parametrize("m", [1, 7])
def test_quantized_linear_matches_dequantized_matmul(cpu_path, mode, group, m):
    lin = _linear(96, 256, bias=True)
    layer = quant.quantize_linear(lin, mode)
    assert isinstance(layer, quant.Int8Linear if mode == "int8" else quant.Int4Linear)
    x = torch.randn(2, m, 256)
    out = layer(x)
    kernel = layer.kernel
    if isinstance(kernel, cpu_gemm.LayerKernel) and kernel.q8:  # the compiled CPU path quantizes activations to int8 per block of 32
        x = cpu_gemm.quantize_activations_ref(x.reshape(-1, 256)).view_as(x)
    expected = x @ layer.dequantized_weight().t() + lin.bias
    assert out.shape == (2, m, 96)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    # and the quantized weight is close to the original: within half a quantization step wherever the chosen
    # (possibly clipped) range covers the weight
    w = lin.weight.detach()
    err = (layer.dequantized_weight() - w).abs()
    step = layer.scales.repeat_interleave(layer.group_size, dim=1)
    if mode == "int8":
        inside = w.abs() <= 127 * step
    else:
        low = layer.zeros.repeat_interleave(layer.group_size, dim=1) - 8 * step
        inside = (w >= low) & (w <= low + 15 * step)
    assert inside.float().mean() > 0.9
    assert (err[inside] <= step[inside] * 0.5 + 1e-6).all()


@pytest.mark.parametrize("mode", ["int8", "int4-g32", "int4-g64"])
def test_fused_layer_filled_by_rows_gives_each_projections_outputs(mode):
    """q/k/v (and gate/up) quantized into the row slices of one fused layer, as the loader does: its outputs are each
    projection's own quantized layer's, side by side (per-row scales: the rows do not see each other)."""
    parts = [_linear(n, 128, bias=False, seed=n) for n in (64, 32, 32)]
    spec = quant.parse_quant(mode)
    alone = [quant.quantize_linear(p, mode) for p in parts]
    fused = quant.empty_quantized(spec, 128, 128, False)
    row = 0
    for p in parts:
        quant.fill_from_weight(fused, p.weight.detach(), spec, slice(row, row + p.out_features))
        row += p.out_features
    x = torch.randn(5, 128)
    assert torch.equal(fused.dequantized_weight(), torch.cat([a.dequantized_weight() for a in alone]))
    torch.testing.assert_close(fused(x), torch.cat([a(x) for a in alone], dim=-1), rtol=0, atol=1e-5)


def _weights(kind: str, n: int = 64, k: int = 256, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "gaussian":
        return torch.randn(n, k, generator=g) * 0.05
    if kind == "outliers":  # heavy tails plus a few huge values, as in real LLM projections
        w = torch.distributions.StudentT(2.0).sample((n, k)) * 0.02
        spots = torch.rand(n, k, generator=g) < 0.005
        return torch.where(spots, torch.randn(n, k, generator=g) * 2.0, w)
    return torch.rand(n, k, generator=g) + 0.5  # all positive, uniform: min/max is already near optimal


def _sq_err_per_group(w, deq, group):
    return (deq - w).square().view(w.shape[0], -1, group).sum(-1)


@pytest.mark.parametrize("kind", ["gaussian", "outliers", "uniform"])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_clip_search_never_worse_than_min_max(kind, group):
    w = _weights(kind)
    base = qmm.dequantize_int4(*quant.quantize_int4(w, group, clip=False, refit_steps=0), group)
    best = qmm.dequantize_int4(*quant.quantize_int4(w, group), group)
    base_err, best_err = _sq_err_per_group(w, base, group), _sq_err_per_group(w, best, group)
    assert (best_err <= base_err * (1 + 1e-5) + 1e-12).all()  # per group, up to fp32 rounding
    if kind != "uniform":  # and it really helps where there are tails to clip
        assert best_err.sum() < 0.9 * base_err.sum()


@pytest.mark.parametrize("kind", ["gaussian", "outliers", "uniform"])
def test_int8_clip_search_never_worse_than_abs_max(kind):
    w = _weights(kind)
    base = qmm.dequantize_int8(*quant.quantize_int8(w, clip=False), w.shape[1])
    best = qmm.dequantize_int8(*quant.quantize_int8(w), w.shape[1])
    base_err, best_err = _sq_err_per_group(w, base, w.shape[1]), _sq_err_per_group(w, best, w.shape[1])
    assert (best_err <= base_err * (1 + 1e-5) + 1e-12).all()
    if kind == "gaussian":  # light tails: a slightly clipped range wins on most rows
        assert best_err.sum() < 0.99 * base_err.sum()


def test_int4_on_its_own_grid_is_exact():
    """Weights already on a 16-level grid per group (e.g. dequantized Q4_1) come back exactly."""
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (8, 128), generator=g).float()
    codes[:, ::32] = 0  # every group spans the whole grid
    codes[:, 1::32] = 15
    scale = torch.rand(8, 4, 1, generator=g) * 0.01 + 1e-3
    w = (codes.view(8, 4, 32) * scale - 0.05).view(8, 128)
    got = qmm.dequantize_int4(*quant.quantize_int4(w, 32), 32)
    torch.testing.assert_close(got, w, rtol=0, atol=1e-6)


def test_int4_packing_is_two_per_byte_with_group_scales():
    layer = quant.quantize_linear(_linear(64, 128), "int4-g32")
    assert layer.qweight.dtype == torch.uint8 and layer.qweight.shape == (64, 64)
    assert layer.scales.shape == layer.zeros.shape == (64, 4)


def test_int4_group_must_divide_in_features():
    with pytest.raises(ValueError, match="multiple of the int4 group size 128"):
        quant.quantize_linear(_linear(16, 192), "int4-g128")


def test_parse_quant_modes_and_errors(monkeypatch):
    assert quant.parse_quant("int4").group_size == quant.DEFAULT_INT4_GROUP
    assert quant.parse_quant("INT4-g32") == quant.QuantSpec("int4", 32, calibrate=True)  # GPTQ while loading
    # CPU: a GGUF keeps its packing where llmd's compiled CPU kernel runs (this machine has a C compiler), and is
    # dequantized without it
    assert quant.parse_quant(None, "gguf", "cpu").method == ("gguf" if cpu_gemm.available() else "none")
    monkeypatch.setenv("LLMD_CPU_GEMM", "0")
    assert quant.parse_quant(None, "gguf", "cpu").method == "none"
    assert quant.parse_quant(None, "hf", "cpu").method == "none"
    assert quant.parse_quant(None, "gguf", "cuda").method == "gguf"
    assert quant.parse_quant("gguf", "gguf").method == "gguf"
    with pytest.raises(ValueError, match="choose one of"):
        quant.parse_quant("int3")
    with pytest.raises(ValueError, match="32, 64 or 128"):
        quant.parse_quant("int4-g16")
    with pytest.raises(ValueError, match="not a GGUF file"):
        quant.parse_quant("gguf", "hf")


def test_gguf_blocks_convert_exactly(smollm2_gguf):
    """Q4_1 and Q8_0 rows become int4/int8 g32 layers whose weights equal the GGUF dequantization bit for bit."""
    from llmd.model.gguf import dequantize, iter_raw_tensors

    seen = set()
    for raw in iter_raw_tensors(smollm2_gguf):
        if raw.type_name in seen or raw.type_name not in ("Q4_1", "Q8_0"):
            continue
        n, k = raw.shape
        rows = raw.data[:64]  # a slice of rows keeps this fast
        if raw.type_name == "Q8_0":
            q, s = quant.int8_from_q8_0(rows, 64, k)
            got = qmm.dequantize_int8(q, s, 32)
        else:
            q, s, z = quant.int4_from_q4(rows, "Q4_1", 64, k)
            got = qmm.dequantize_int4(q, s, z, 32)
        want = dequantize(rows, raw.type_name, (64, k))
        torch.testing.assert_close(got, want, rtol=0, atol=2e-6)
        seen.add(raw.type_name)
    assert seen == {"Q4_1", "Q8_0"}


def test_q4_0_nibble_order():
    """Q4_0: byte j holds element j (low nibble) and j + 16 (high nibble); x = d (q - 8)."""
    import numpy as np

    d = np.array([0.5], dtype=np.float16).view(np.uint8)
    values = np.arange(32) % 16
    qs = (values[:16] | (values[16:] << 4)).astype(np.uint8)
    block = np.concatenate([d, qs])[None, :]
    q, s, z = quant.int4_from_q4(block, "Q4_0", 1, 32)
    torch.testing.assert_close(qmm.dequantize_int4(q, s, z, 32)[0], (torch.tensor(values, dtype=torch.float32) - 8) * 0.5)


@pytest.mark.parametrize("mode,max_rel_err", [("int8", 0.03), ("int4-g32", 0.4), ("int4-g64", 0.45)])
def test_quantized_tiny_model_within_error_budget(tiny_llama, mode, max_rel_err):
    ref = load_model(tiny_llama)
    qm = load_model(tiny_llama, quant=mode)
    layers = [m for m in qm.model.modules() if isinstance(m, quant.QuantizedLinear)]
    # every projection of both layers (q/k/v and gate/up fused: 4 per layer); the head stays full precision
    projections = [m for m in ref.model.modules() if isinstance(m, TransposedLinear) and m is not ref.model.lm_head]
    assert len(layers) == 2 * 4
    assert sum(m.out_features for m in layers) == sum(m.out_features for m in projections)
    assert qm.report.weight_bytes < ref.report.weight_bytes
    ids = ref.tokenizer.encode("The capital of France is Paris. Berlin is")
    want, got = prefill_logits(ref, ids), prefill_logits(qm, ids)
    rel = (got - want).norm() / want.norm()
    print(f"{mode}: relative logit error {rel:.4f}")
    assert rel < max_rel_err
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True,
                                    reduction="batchmean")
    print(f"{mode}: mean KL {kl:.5f}")
    assert kl < max_rel_err ** 2
    # greedy choice: wherever the reference's top token leads by more than twice the largest logit error, the
    # quantized model picks the same token (random tiny models have many near-ties, so not everywhere)
    top2 = want.topk(2, dim=-1).values
    decisive = (top2[:, 0] - top2[:, 1]) > 2 * (got - want).abs().max(dim=-1).values
    assert decisive.any() or mode != "int8"
    assert torch.equal(got.argmax(-1)[decisive], want.argmax(-1)[decisive])


def test_quantized_head_option(tiny_qwen2):
    """Tied embeddings: quantize_head gives the model its own int8 output head; the embedding stays."""
    ref = load_model(tiny_qwen2)
    qm = load_model(tiny_qwen2, quant="int8", quantize_head=True)
    assert isinstance(qm.model.lm_head, quant.Int8Linear)
    assert qm.model.model.embed_tokens.weight.dtype == torch.float32
    ids = ref.tokenizer.encode("Hello, world! How are you")
    want, got = prefill_logits(ref, ids), prefill_logits(qm, ids)
    assert (got - want).norm() / want.norm() < 0.05


def test_bad_group_for_model_is_a_clear_error(tiny_llama):
    with pytest.raises(ValueError, match="int4-g32"):
        load_model(tiny_llama, quant="int4-g128")


def test_bnb_int8_on_cpu(tiny_llama):
    pytest.importorskip("bitsandbytes")
    ref = load_model(tiny_llama)
    qm = load_model(tiny_llama, quant="bnb-int8")
    import bitsandbytes as bnb

    assert any(isinstance(m, bnb.nn.Linear8bitLt) for m in qm.model.modules())
    ids = ref.tokenizer.encode("The quick brown fox")
    want, got = prefill_logits(ref, ids), prefill_logits(qm, ids)
    assert (got - want).norm() / want.norm() < 0.05


@pytest.mark.slow
def test_smollm2_runs_from_its_q4_1_blocks(smollm2_gguf):
    """The bundled GGUF computing on the CPU straight from its Q4_1 blocks (kept as the file's, on the int16 path)
    answers like the dequantized model."""
    lm = load_model(smollm2_gguf, quant="gguf")
    q4_1 = [m for m in lm.model.modules() if isinstance(m, quant.GGUFLinear) and m.file_type == "Q4_1"]
    # per layer: qkv (fused), o, gate_up (fused), down
    assert len(q4_1) == 30 * 4 and not any(isinstance(m, quant.Int4Linear) for m in lm.model.modules())
    if cpu_gemm.available():
        q4_1[0].prepare(torch.device("cpu"), torch.float32)
        assert q4_1[0].kernel.act == "int16"
    # The tied Q8_0 token table is kept once, the file's blocks (interleaved in place where the head's int16 kernel
    # takes them), serving as both the embeddings (the file's exact values) and the head (a GGUFLinear over the same
    # bytes). It used to be rearranged into an int8 head, whose fp32 scales put the model over the 1.15x memory
    # budget below.
    head, emb = lm.model.lm_head, lm.model.model.embed_tokens
    assert isinstance(head, quant.GGUFLinear) and head.type_name == ("Q8_0_X8" if cpu_gemm.available() else "Q8_0")
    assert isinstance(emb, quant.GGUFEmbedding) and head.qweight.data_ptr() == emb.qweight.data_ptr()
    raw = next(t for t in quant.gguf_raw_tensors(smollm2_gguf) if t.name == "model.embed_tokens.weight")
    ids = torch.tensor([0, 1, 504, 49151, 504])
    assert torch.equal(lm.model.model.embed_tokens(ids), dequantize(raw.data, raw.type_name, raw.shape)[ids])
    assert lm.report.weight_bytes < 120 * 2**20  # vs ~513 MiB dequantized to fp32
    # the memory budget: resident weights within 1.01x the file's tensor bytes (every block kept as the file's)
    file_bytes = sum(t.nbytes for t in _GGUFFile(smollm2_gguf).tensors)
    assert lm.report.weight_bytes <= 1.01 * file_bytes, lm.report.weight_bytes / file_bytes
    ids = lm.tokenizer.encode("The capital of France is")
    logits = prefill_logits(lm, ids)
    assert lm.tokenizer.decode([int(logits[-1].argmax())]).strip() == "Paris"


# ---------------------------------------------------------------------------------------------------------------
# The quantized-checkpoint cache (llmd.model.quant_cache)


@pytest.fixture
def quant_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMD_QUANT_CACHE_DIR", str(tmp_path / "qcache"))
    return tmp_path / "qcache"


def _spy_quantizer(monkeypatch) -> list:
    """Records every quantization of a layer: weight by weight (fill_from_weight) or calibrated int4 (fill_int4)."""
    calls = []
    for name in ("fill_from_weight", "fill_int4"):
        real = getattr(quant.layers, name)  # where the loading code looks them up
        monkeypatch.setattr(quant.layers, name, lambda *a, real=real, **k: (calls.append(1), real(*a, **k))[1])
    return calls


@pytest.mark.parametrize("mode,head", [("int4-g32", False), ("int8", True)])
def test_second_load_reads_the_cache_with_identical_outputs(tiny_qwen2, quant_cache_dir, monkeypatch, mode, head):
    calls = _spy_quantizer(monkeypatch)
    first = load_model(tiny_qwen2, quant=mode, quantize_head=head)
    assert calls, "the first load quantizes"
    entries = list(quant_cache_dir.glob("*.safetensors"))
    assert len(entries) == 1
    calls.clear()
    second = load_model(tiny_qwen2, quant=mode, quantize_head=head)
    assert not calls, "the second load must read the cache, not quantize"
    assert isinstance(second.model.lm_head, quant.Int8Linear) == head
    ids = first.tokenizer.encode("Hello, world! How are you")
    assert torch.equal(prefill_logits(first, ids), prefill_logits(second, ids))
    assert greedy_generate(second, ids, 4) == greedy_generate(first, ids, 4)
    # another mode is another entry
    load_model(tiny_qwen2, quant="int4-g64" if mode == "int8" else "int8")
    assert len(list(quant_cache_dir.glob("*.safetensors"))) == 2


@pytest.mark.parametrize("damage", ["truncate", "flip-byte", "garbage"])
def test_damaged_cache_entry_is_ignored_with_a_warning_and_rebuilt(tiny_llama, quant_cache_dir, monkeypatch, caplog,
                                                                  damage):
    first = load_model(tiny_llama, quant="int4-g32")
    (entry,) = quant_cache_dir.glob("*.safetensors")
    data = bytearray(entry.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip-byte":
        data[-100] ^= 0xFF  # inside the last tensor's bytes: only the checksum can tell
    else:
        data = bytearray(b"not a safetensors file")
    entry.write_bytes(bytes(data))
    calls = _spy_quantizer(monkeypatch)
    with caplog.at_level("WARNING", logger="llmd.model.quant_cache"):
        second = load_model(tiny_llama, quant="int4-g32")
    assert calls, "a damaged entry is quantized again"
    assert any("damaged" in r.getMessage() for r in caplog.records)
    ids = first.tokenizer.encode("The quick brown fox")
    assert torch.equal(prefill_logits(first, ids), prefill_logits(second, ids))
    calls.clear()
    load_model(tiny_llama, quant="int4-g32")  # and the rebuilt entry is good again
    assert not calls


def test_cache_entry_holds_the_devices_forms_and_its_key_names_the_device_type(tiny_qwen2, quant_cache_dir):
    """An entry is the model as LoadPipeline.run() leaves it for its device: on the CPU the tied head is one
    transposed [hidden, vocab] table (the embeddings read from it), on CUDA the token table itself. So a CPU entry
    must never be read for CUDA, and the device type is part of the key."""
    from llmd.model import quant_cache
    from llmd.model.weights import iter_safetensors, safetensors_files

    lm = load_model(tiny_qwen2, quant="int8")
    assert lm.config.tie_word_embeddings
    (entry,) = quant_cache_dir.glob("*.safetensors")
    files, spec = safetensors_files(tiny_qwen2), quant.parse_quant("int8")
    assert entry == quant_cache.entry_path(files, spec, torch.float32, torch.device("cpu"), False)
    assert entry != quant_cache.entry_path(files, spec, torch.float32, torch.device("cuda"), False)
    stored = {name: tensor for name, tensor in iter_safetensors([entry])}
    assert "model.embed_tokens.weight" not in stored
    emb = lm.model.model.embed_tokens(torch.arange(lm.config.vocab_size))
    assert torch.equal(stored["lm_head.weight_t"], emb.t())


def test_changed_source_file_misses_the_cache(tiny_llama, quant_cache_dir, tmp_path):
    import os
    import shutil

    copy = tmp_path / "model"
    shutil.copytree(tiny_llama, copy)
    load_model(copy, quant="int8")
    (old,) = quant_cache_dir.glob("*.safetensors")
    st = next(copy.glob("*.safetensors"))
    os.utime(st, ns=(st.stat().st_atime_ns, st.stat().st_mtime_ns + 10**9))
    load_model(copy, quant="int8")
    (new,) = quant_cache_dir.glob("*.safetensors")  # a fresh entry, and the stale one removed
    assert new != old
