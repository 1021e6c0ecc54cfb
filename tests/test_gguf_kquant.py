"""GGUF files of every packed type load with their tensors kept as the file's blocks (llmd.model.quant.gguf_layers)
and run with the logits of transformers loading the same file (which dequantizes with gguf): tiny random-weight Llama GGUFs
written here with K-quant, Q5, IQ4, MXFP4 and legacy blocks (raw block bytes with their type), untied and tied heads; the
torch fallback (no C kernel) gives the same logits; resident bytes against the file's; bad files are refused naming
file, tensor and problem."""

from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
import torch
from test_gguf import _tokenizer_metadata, VOCAB
from test_gguf_blocks import random_blocks

from llmd.errors import ModelFileError
from llmd.kernels import cpu_gemm
from llmd.kernels import gguf_blocks as gb
from llmd.model.quant import GGUFConcat, GGUFEmbedding, GGUFLinear, packed_weight_bytes
from llmd.model.loader import load_model
from simple_driver import prefill_logits

T = gguf.GGMLQuantizationType
HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 256, 4, 2, 512, 3
# per layer, a Q4_K_M-like mix in layer 0, the other packed types in layer 1, MXFP4 (gpt-oss's expert type) in layer 2,
# its gate fused with a Q4_K up projection
LAYER_TYPES = [
    {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q5_0", "ffn_gate": "Q4_K",
     "ffn_up": "Q4_K", "ffn_down": "Q6_K"},
    {"attn_q": "Q5_K", "attn_k": "Q3_K", "attn_v": "Q2_K", "attn_output": "IQ4_XS", "ffn_gate": "IQ4_NL",
     "ffn_up": "Q5_1", "ffn_down": "Q8_0"},
    {"attn_q": "MXFP4", "attn_k": "MXFP4", "attn_v": "Q8_0", "attn_output": "MXFP4", "ffn_gate": "MXFP4",
     "ffn_up": "Q4_K", "ffn_down": "MXFP4"},
]
SHAPES = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (HIDDEN // HEADS * KV_HEADS, HIDDEN),
          "attn_v": (HIDDEN // HEADS * KV_HEADS, HIDDEN), "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (FFN, HIDDEN),
          "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}
# fp16 scales of random blocks, per type, so the weights have a sane size (super-block scales multiply 6-bit ones;
# MXFP4: its power-of-two scales at most this)
SCALE = {"MXFP4": 0.005, "Q8_0": 0.002, "Q4_0": 0.01, "Q4_1": 0.01, "Q5_0": 0.005, "Q5_1": 0.005, "IQ4_NL": 0.0005,
         "IQ4_XS": 0.00002, "Q2_K": 0.001, "Q3_K": 0.0005, "Q4_K": 0.0002, "Q5_K": 0.0001, "Q6_K": 0.0005}


def _blocks(type_name: str, shape, seed: int) -> np.ndarray:
    if type_name == "TQ2_0":  # a type without a kernel here: 64 bytes of 2-bit codes, then its fp16 scale
        raw = np.random.default_rng(seed).integers(0, 256, (shape[0], shape[1] // 256, 66), dtype=np.uint8)
        raw[..., 64:66] = np.array([0.01], dtype=np.float16).view(np.uint8)
        return raw.reshape(shape[0], -1)
    return random_blocks(type_name, shape[0], shape[1], seed=seed, scale=SCALE[type_name])


def write_kquant_gguf(path, embd="Q4_K", head: str | None = "Q6_K", layer_types=LAYER_TYPES, seed=0) -> None:
    """A Llama GGUF of random blocks; head None: tied to the token table."""
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(len(layer_types))
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(VOCAB)
    _tokenizer_metadata(w)
    rng = np.random.default_rng(seed)
    norm = lambda: (1.0 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)  # noqa: E731
    w.add_tensor("token_embd.weight", _blocks(embd, (VOCAB, HIDDEN), seed), raw_dtype=T[embd])
    for i, types in enumerate(layer_types):
        w.add_tensor(f"blk.{i}.attn_norm.weight", norm())
        w.add_tensor(f"blk.{i}.ffn_norm.weight", norm())
        for j, (name, kind) in enumerate(types.items()):
            blocks = _blocks(kind, SHAPES[name], seed + 10 * i + j + 1)
            w.add_tensor(f"blk.{i}.{name}.weight", blocks, raw_dtype=T[kind])
    w.add_tensor("output_norm.weight", norm())
    if head is not None:
        w.add_tensor("output.weight", _blocks(head, (VOCAB, HIDDEN), seed + 99), raw_dtype=T[head])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def file_tensor_bytes(path) -> int:
    from llmd.model.gguf import _GGUFFile

    return sum(t.nbytes for t in _GGUFFile(path).tensors)


@pytest.fixture(scope="module")
def kquant_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("kquant")
    untied, tied = d / "untied.gguf", d / "tied.gguf"
    write_kquant_gguf(untied, embd="Q3_K", head="Q6_K")
    write_kquant_gguf(tied, embd="Q4_K", head=None, seed=7)
    return {"untied": untied, "tied": tied}


def _reference_logits(path, ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


IDS = [1, 5, 9, 3, 30, 17, 2, 8, 8, 12, 39, 0]


@pytest.mark.parametrize("variant", ["untied", "tied"])
def test_logits_equal_transformers_with_every_tensor_packed(kquant_files, variant, monkeypatch):
    """With fp32 activations (the file's exact weights); the default integer path is checked below."""
    monkeypatch.setenv("LLMD_CPU_GEMM_ACT", "fp32")
    path = kquant_files[variant]
    lm = load_model(path, quant="gguf", device="cpu", dtype=torch.float32)
    model = lm.model
    packed = [m for m in model.modules() if isinstance(m, GGUFLinear)]
    assert {m.type_name for m in packed} == {"Q4_K", "Q6_K", "Q5_0", "Q5_K", "Q3_K", "Q2_K", "IQ4_XS", "IQ4_NL",
                                              "Q5_1", "Q8_0", "MXFP4"}
    if variant == "untied":
        assert isinstance(model.model.embed_tokens, GGUFEmbedding) and model.model.embed_tokens.type_name == "Q3_K"
        assert isinstance(model.lm_head, GGUFLinear) and model.lm_head.type_name == "Q6_K"
    else:  # the head reads the token table's very bytes (held once)
        assert isinstance(model.lm_head, GGUFLinear) and model.lm_head.type_name == "Q4_K"
        assert model.lm_head.qweight.data_ptr() == model.model.embed_tokens.qweight.data_ptr()
    assert not any(p.dim() == 2 for p in model.parameters())  # no weight matrix was dequantized
    got = prefill_logits(lm, IDS)
    want = _reference_logits(path, IDS)
    assert got.shape == want.shape == (len(IDS), VOCAB)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # resident weights against the file's tensor bytes (norms are fp32 in both)
    file_bytes = file_tensor_bytes(path)
    assert lm.report.weight_bytes <= 1.15 * file_bytes, (lm.report.weight_bytes, file_bytes)


def test_torch_fallback_gives_the_same_logits(kquant_files, monkeypatch):
    monkeypatch.setenv("LLMD_CPU_GEMM_ACT", "fp32")  # the fallback computes the exact weights, as fp32 activations do
    path = kquant_files["untied"]
    with_kernel = prefill_logits(load_model(path, quant="gguf", device="cpu"), IDS)
    monkeypatch.setenv("LLMD_CPU_GEMM", "0")
    import llmd.model.quant.gguf_layers as gl

    monkeypatch.setattr(gl, "_CHUNK_ELEMENTS", 300 * 256)  # several chunks per layer
    fallback = prefill_logits(load_model(path, quant="gguf", device="cpu"), IDS)
    torch.testing.assert_close(fallback, with_kernel, rtol=1e-4, atol=1e-4)


def test_packed_layer_matches_its_dequantized_weights(monkeypatch):
    monkeypatch.setenv("LLMD_CPU_GEMM_ACT", "fp32")
    for type_name in gb.BLOCKS:
        k = 2 * gb.BLOCKS[type_name][0] if gb.BLOCKS[type_name][0] == 32 else 256
        layer = GGUFLinear(k, 40, type_name)
        layer.fill(torch.from_numpy(_blocks(type_name, (40, k), 3)), "w", "test")
        x = torch.randn(5, k)
        want = x @ gb.dequantize_blocks(layer.qweight, type_name).t()
        torch.testing.assert_close(layer(x), want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(layer._chunked(x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", ["untied", "tied"])
def test_packed_head_takes_int16_or_fp32_activations_by_default(kquant_files, variant, monkeypatch):
    """By default every packed layer takes the integer path and the output head int16 activations where it is Q6_K
    (the file's own head) and fp32 where it is the tied Q4_K token table; LLMD_CPU_GEMM_ACT=int8 puts the head on the
    integer path too."""
    if not cpu_gemm.available():
        return
    monkeypatch.delenv("LLMD_CPU_GEMM_ACT", raising=False)
    model = load_model(kquant_files[variant], quant="gguf", device="cpu").model
    layers = [m for m in model.model.modules() if isinstance(m, (GGUFLinear, GGUFConcat))]
    assert layers and all(m.kernel.act == "int8" for m in layers)
    assert model.lm_head.output_head and model.lm_head.kernel.act == ("int16" if variant == "untied" else "fp32")
    monkeypatch.setenv("LLMD_CPU_GEMM_ACT", "int8")
    assert load_model(kquant_files[variant], quant="gguf", device="cpu").model.lm_head.kernel.act == "int8"


def test_resident_bytes_by_type(kquant_files):
    lm = load_model(kquant_files["untied"], quant="gguf", device="cpu")
    from llmd.model.gguf import _GGUFFile

    in_file: dict[str, int] = {}
    for t in _GGUFFile(kquant_files["untied"]).tensors:
        in_file[t.type_name] = in_file.get(t.type_name, 0) + t.nbytes
    by_type = packed_weight_bytes(lm.model)  # exactly the file's bytes, type by type
    assert by_type == {k: v for k, v in in_file.items() if k != "F32"}


def test_a_type_without_kernel_converts_to_q8_0_with_one_warning(tmp_path, caplog, monkeypatch):
    monkeypatch.setenv("LLMD_CPU_GEMM_ACT", "fp32")  # the conversion's cost alone
    path = tmp_path / "tq.gguf"
    types = [dict(LAYER_TYPES[0], ffn_up="TQ2_0", ffn_gate="TQ2_0")]
    write_kquant_gguf(path, layer_types=types)
    with caplog.at_level(logging.WARNING, logger="llmd.model.gguf"):
        lm = load_model(path, quant="gguf", device="cpu")
    lines = [r.getMessage() for r in caplog.records if "TQ2_0" in r.getMessage()]
    assert len(lines) == 1 and "Q8_0" in lines[0] and "relative RMS change" in lines[0]
    mlp = lm.model.model.layers[0].mlp
    assert isinstance(mlp.gate_up_proj, GGUFLinear) and mlp.gate_up_proj.file_type == "Q8_0"
    torch.testing.assert_close(prefill_logits(lm, IDS), _reference_logits(path, IDS), rtol=0.05, atol=0.05)


# ---- bad input


def _error(path) -> str:
    with pytest.raises(ModelFileError) as info:
        load_model(path, quant="gguf", device="cpu")
    message = str(info.value)
    assert str(path) in message
    return message


def test_truncated_last_block(kquant_files, tmp_path):
    data = kquant_files["untied"].read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:-100])  # inside the last tensor's last block
    message = _error(path)
    assert "'output.weight'" in message and "truncated" in message


def test_size_not_matching_type_and_shape(kquant_files, tmp_path):
    """A tensor declared with more rows than its bytes: it overlaps the next tensor."""
    import shutil

    path = tmp_path / "size.gguf"
    shutil.copy(kquant_files["untied"], path)
    reader = gguf.GGUFReader(path, "r+")
    t = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    t.field.parts[3][1] = HIDDEN * 2  # [K, N] -> N doubled
    reader.data.flush()
    del reader
    message = _error(path)
    assert "'blk.0.attn_q.weight'" in message and "does not match its type and shape" in message


def test_row_not_a_multiple_of_the_block(tmp_path):
    path = tmp_path / "row.gguf"
    blocks = random_blocks("Q4_K", 4, 256)
    w = gguf.GGUFWriter(path, "llama")
    w.add_tensor("blk.0.attn_v.weight", blocks, raw_dtype=T.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader = gguf.GGUFReader(path, "r+")
    reader.tensors[0].field.parts[3][0] = 320  # a row of 320 is not whole 256-element super-blocks
    reader.data.flush()
    del reader
    message = _error(path)
    assert "'blk.0.attn_v.weight'" in message and "not a multiple of Q4_K blocks" in message


def test_unknown_and_undequantizable_types_are_refused_by_name(kquant_files, tmp_path):
    import shutil

    # Q8_K (no dequantizer in gguf either) is larger than the tensor's bytes: refused as overlapping, by type too
    for type_id, expect in ((99, "unknown tensor type id 99"), (T.Q8_K.value, "Q8_K")):
        path = tmp_path / f"type{type_id}.gguf"
        shutil.copy(kquant_files["untied"], path)
        reader = gguf.GGUFReader(path, "r+")
        t = next(t for t in reader.tensors if t.name == "blk.1.ffn_up.weight")
        t.field.parts[4][0] = type_id
        reader.data.flush()
        del reader
        message = _error(path)
        assert expect in message and "blk.1.ffn_up.weight" in message



def test_auto_without_the_cpu_kernels_says_it_dequantizes(kquant_files, monkeypatch, caplog):
    from llmd.kernels import cpu_gemm

    monkeypatch.setattr(cpu_gemm, "available", lambda: False)  # as on a machine without a C compiler
    with caplog.at_level(logging.WARNING, logger="llmd.model.loader"):
        lm = load_model(kquant_files["tied"], device="cpu")
    lines = [r.getMessage() for r in caplog.records if "dequantized to float32" in r.getMessage()]
    assert len(lines) == 1 and "Q4_K" in lines[0] and "--quant gguf" in lines[0]
    assert not any(isinstance(m, GGUFLinear) for m in lm.model.modules())


@pytest.mark.parametrize("act", ["fp32", "int8"])
def test_mixed_types_fuse_and_the_c_layer_stack_runs_them_bit_for_bit(kquant_files, act, monkeypatch):
    """q/k (Q4_K) and v (Q6_K) fuse into one GGUFConcat; the C layer stack then runs every layer and gives the module
    path's hidden states bit for bit, for a prefill chunk and decodes; with LLMD_CPU_GEMM_ACT=int8 too, where every
    packed layer takes the integer path (its own linear kind in the stack)."""
    from llmd.kernels import cpu_gemm, cpu_ops
    from llmd.kernels import cpu_stack as ck
    from llmd.model import cpu_stack
    from llmd.model.attention import AttentionMetadata, allocate_kv_cache
    from llmd.model.quant import GGUFConcat

    monkeypatch.setenv("LLMD_CPU_GEMM_ACT", act)
    lm = load_model(kquant_files["untied"], quant="gguf", device="cpu")
    model, cfg = lm.model, lm.config
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, GGUFConcat) and [p.file_type for p in qkv.parts] == ["Q4_K", "Q4_K", "Q6_K"]
    w = torch.cat([gb.dequantize_blocks(p.qweight, p.type_name) for p in qkv.parts])
    x = torch.randn(3, HIDDEN)
    ref = x @ w.t() if act == "fp32" else cpu_gemm.quantize_activations_ref(x) @ w.t()
    torch.testing.assert_close(qkv(x), ref, rtol=1e-4, atol=1e-4)
    if cpu_ops.load() is None:
        return

    compiled = cpu_stack.CompiledCpuForward.try_build(model)
    assert compiled is not None
    kinds = {getattr(layer, name).kind for layer in compiled.stack.layers for name in ("qkv", "o", "gate_up", "down")}
    assert kinds == {ck.KINDS["gguf", act]}

    def run(use_stack: bool) -> list[torch.Tensor]:
        forward = compiled if use_stack else model
        kv = allocate_kv_cache(cfg.num_hidden_layers, 4, 16, cfg.num_key_value_heads, cfg.head_dim, torch.float32,
                               "cpu")
        out, length = [], 0
        with torch.inference_mode():
            for ids in (IDS[:9], IDS[9:10], IDS[10:11], IDS[11:]):
                length += len(ids)
                meta = AttentionMetadata.build([len(ids)], [length], [[3, 1]], 16)
                out.append(forward(torch.tensor(ids), torch.arange(length - len(ids), length), kv, meta).clone())
        return out

    with_stack = run(True)
    assert compiled.stack._caches  # the stack ran
    without = run(False)
    assert all(torch.equal(a, b) for a, b in zip(with_stack, without))


def test_tensor_shape_not_the_models_is_refused_by_name(kquant_files, tmp_path):
    """The output head declared with one row fewer (its bytes then still fit the file): the packed layer refuses
    it, naming the tensor and both shapes, before the model runs."""
    import shutil

    path = tmp_path / "shape.gguf"
    shutil.copy(kquant_files["untied"], path)
    reader = gguf.GGUFReader(path, "r+")
    t = next(t for t in reader.tensors if t.name == "output.weight")
    t.field.parts[3][1] = VOCAB - 1
    reader.data.flush()
    del reader
    message = _error(path)
    assert "'lm_head.weight'" in message and "Q6_K" in message and f"[{VOCAB}, {HIDDEN}]" in message
