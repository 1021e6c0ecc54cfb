"""Calibrated int4 quantization (llmd.model.gptq, llmd.model.calibrate): GPTQ lowers the output error where the
inputs look like its calibration data, is deterministic, and reads the checkpoint's tensors by name correctly."""

from __future__ import annotations

import pytest
import torch

from llmd.kernels import quant_matmul as qmm
from llmd.model import quant
from llmd.model.calibrate import calibration_token_ids
from llmd.model.gptq import gptq_int4, input_hessian
from llmd.model.loader import load_model
from simple_driver import prefill_logits
from llmd.model.weights import safetensors_files, safetensors_readers


@pytest.fixture
def quant_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMD_QUANT_CACHE_DIR", str(tmp_path / "qcache"))
    return tmp_path / "qcache"


def _correlated_inputs(t: int, k: int, seed: int) -> torch.Tensor:
    """Activations with correlated channels and a few large ones, as in real LLM layers."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g) @ (torch.eye(k) + 0.2 * torch.randn(k, k, generator=g))
    x[:, :4] *= 10
    return x


@pytest.mark.parametrize("group", [32, 64, 128])
def test_gptq_lowers_output_error_on_held_out_inputs_of_the_same_kind(group):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 256, generator=g) * 0.05
    x = _correlated_inputs(1536, 256, seed=1)
    calib, held_out = x[:1024], x[1024:]  # same channel statistics, different samples
    packed = gptq_int4(w, input_hessian(calib), group)
    assert packed[0].shape == (48, 128) and packed[1].shape == packed[2].shape == (48, 256 // group)
    gptq = qmm.dequantize_int4(*packed, group)
    plain = qmm.dequantize_int4(*quant.quantize_int4(w, group), group)
    y = held_out @ w.t()
    plain_err = (held_out @ plain.t() - y).norm()
    gptq_err = (held_out @ gptq.t() - y).norm()
    assert gptq_err < 0.7 * plain_err
    # the same inputs give the same bytes
    again = gptq_int4(w, input_hessian(calib), group)
    assert all(torch.equal(a, b) for a, b in zip(packed, again))


def test_gptq_handles_inputs_never_seen_in_calibration():
    """A channel that is always zero in calibration (a singular Hessian) still gets a finite, sane quantization."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 64, generator=g) * 0.05
    x = torch.randn(32, 64, generator=g)
    x[:, 5] = 0
    deq = qmm.dequantize_int4(*gptq_int4(w, input_hessian(x), 32), 32)
    assert torch.isfinite(deq).all()
    assert (deq - w).abs().max() < 0.05


def _plain_copy(loaded, path):
    """The same model with every int4 layer re-quantized weight by weight (no calibration), for comparison."""
    readers = safetensors_readers(safetensors_files(path))
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    for name, module in loaded.model.named_modules():
        if isinstance(module, quant.Int4Linear):
            parent, _, leaf = name.rpartition(".")
            weight = torch.cat([readers[f"{parent}.{part}.weight"]() for part in fused.get(leaf, (leaf,))])
            quant.fill_from_weight(module, weight, quant.QuantSpec("int4", module.group_size))
    return loaded


@pytest.mark.parametrize("kind", ["tiny_llama", "tiny_qwen2"])
def test_calibrated_model_beats_plain_int4_on_calibration_like_text(kind, request, quant_cache_dir):
    path = request.getfixturevalue(kind)
    ref = load_model(path)
    calibrated = load_model(path, quant="int4-g32")
    plain = _plain_copy(load_model(path, quant="int4-g32"), path)  # the second load reads the cache entry
    # calibration-like inputs: the calibration documents as the model's tokenizer sees them
    for ids in calibration_token_ids(safetensors_files(path)):
        want = prefill_logits(ref, ids)
        plain_err = (prefill_logits(plain, ids) - want).norm()
        calibrated_err = (prefill_logits(calibrated, ids) - want).norm()
        assert calibrated_err < 0.85 * plain_err


def test_calibration_is_deterministic(tiny_qwen3, tmp_path, monkeypatch):
    """Two cold quantizations of the same checkpoint (sharded, q/k norm) write byte-identical cache entries."""
    entries = []
    for run in ("a", "b"):
        monkeypatch.setenv("LLMD_QUANT_CACHE_DIR", str(tmp_path / run))
        load_model(tiny_qwen3, quant="int4-g32")
        (entry,) = (tmp_path / run).glob("*.safetensors")
        entries.append(entry)
    assert entries[0].name == entries[1].name
    assert entries[0].read_bytes() == entries[1].read_bytes()


def test_untied_head_is_calibrated_too(tiny_llama, quant_cache_dir):
    ref = load_model(tiny_llama)
    qm = load_model(tiny_llama, quant="int4-g32", quantize_head=True)
    assert isinstance(qm.model.lm_head, quant.Int4Linear)
    ids = ref.tokenizer.encode("The capital of France is Paris. Berlin is")
    want = prefill_logits(ref, ids)
    assert (prefill_logits(qm, ids) - want).norm() / want.norm() < 0.4


def test_gguf_tensor_readers_match_the_file_stream(smollm2_gguf):
    """Reading by name gives exactly what the loader's stream gives (q/k rows un-permuted, Q4_1 dequantized)."""
    from llmd.model.gguf import load_gguf, tensor_readers

    readers = tensor_readers(smollm2_gguf)
    wanted = {"model.layers.3.self_attn.q_proj.weight", "model.layers.3.self_attn.k_proj.weight",
              "model.layers.3.mlp.down_proj.weight", "model.layers.3.input_layernorm.weight"}
    seen = set()
    for name, tensor in load_gguf(smollm2_gguf).tensors:
        if name in wanted:
            assert torch.equal(readers[name](), tensor), name
            seen.add(name)
        if seen == wanted:
            break
    assert seen == wanted


def test_cache_hit_skips_calibration_and_the_key_names_it(tiny_llama, quant_cache_dir, monkeypatch):
    from llmd.model import loader, quant_cache

    runs = []
    real = loader.quantize_calibrated
    monkeypatch.setattr(loader, "quantize_calibrated", lambda *a, **k: (runs.append(1), real(*a, **k))[1])
    first = load_model(tiny_llama, quant="int4-g32")
    assert runs == [1]
    second = load_model(tiny_llama, quant="int4-g32")
    assert runs == [1], "the second start reads the cache entry instead of calibrating again"
    ids = first.tokenizer.encode("The quick brown fox")
    assert torch.equal(prefill_logits(first, ids), prefill_logits(second, ids))
    # calibrated and weight-by-weight int4 of the same file are different entries
    files = safetensors_files(tiny_llama)
    cpu = torch.device("cpu")
    on = quant_cache.entry_path(files, quant.QuantSpec("int4", 32, calibrate=True), torch.float32, cpu, False)
    off = quant_cache.entry_path(files, quant.QuantSpec("int4", 32), torch.float32, cpu, False)
    assert on != off
