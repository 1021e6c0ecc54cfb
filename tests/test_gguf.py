"""GGUF reading: crafted small files (gguf.GGUFWriter) for every failure mode, dequantization against gguf's own
reference, HF naming and the q/k un-permutation, and the bundled SmolLM2 file's header."""

from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest
import torch

from llmd.errors import LlmdError, ModelFileError, UnsupportedArchitecture
from llmd.model.gguf import (
    dequantize,
    hf_tensor_name,
    iter_raw_tensors,
    load_gguf,
    read_gguf_metadata,
    unpermute_rows,
)

T = gguf.GGMLQuantizationType
HIDDEN, HEADS, KV_HEADS, FFN, VOCAB = 64, 4, 2, 128, 40


def _tokenizer_metadata(w: gguf.GGUFWriter) -> None:
    # a byte-level vocabulary: 3 control tokens, the printable ASCII bytes, a few merges
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [chr(c) for c in range(ord("a"), ord("a") + 26)]
    tokens += ["Ġ", "Ġa", "ab", "abc", "Ġab", "ĊĊ", "Ċ", "b", "x", "y", "z"][: VOCAB - len(tokens)]
    tokens = list(dict.fromkeys(tokens))
    while len(tokens) < VOCAB:
        tokens.append(f"<extra_{len(tokens)}>")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    w.add_token_merges(["Ġ a", "a b", "ab c", "Ġ ab"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}")


def write_gguf(path, arch="llama", types=None, extra_tensor=None, seed=0):
    """A 1-layer llama GGUF; `types` maps a short tensor name to its GGML type. Returns {gguf name: fp32 source}."""
    types = types or {}
    rng = np.random.default_rng(seed)
    shapes = {
        "token_embd.weight": (VOCAB, HIDDEN),
        "blk.0.attn_norm.weight": (HIDDEN,),
        "blk.0.attn_q.weight": (HIDDEN, HIDDEN),
        "blk.0.attn_k.weight": (HIDDEN // HEADS * KV_HEADS, HIDDEN),
        "blk.0.attn_v.weight": (HIDDEN // HEADS * KV_HEADS, HIDDEN),
        "blk.0.attn_output.weight": (HIDDEN, HIDDEN),
        "blk.0.ffn_norm.weight": (HIDDEN,),
        "blk.0.ffn_gate.weight": (FFN, HIDDEN),
        "blk.0.ffn_up.weight": (FFN, HIDDEN),
        "blk.0.ffn_down.weight": (HIDDEN, FFN),
        "output_norm.weight": (HIDDEN,),
        "output.weight": (VOCAB, HIDDEN),
    }
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(1)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(VOCAB)
    _tokenizer_metadata(w)
    sources = {}
    for name, shape in shapes.items():
        x = rng.standard_normal(shape).astype(np.float32)
        sources[name] = x
        kind = types.get(name, T.F32)
        if kind == T.F32:
            w.add_tensor(name, x)
        elif kind == T.F16:
            w.add_tensor(name, x.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(x, kind), raw_dtype=kind)
    if extra_tensor is not None:
        name, data, kind = extra_tensor
        w.add_tensor(name, data, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sources


@pytest.fixture
def small_gguf(tmp_path):
    path = tmp_path / "small.gguf"
    write_gguf(path, types={"blk.0.attn_q.weight": T.Q4_0, "blk.0.ffn_up.weight": T.Q4_1,
                            "token_embd.weight": T.Q8_0, "blk.0.ffn_down.weight": T.F16})
    return path


def _error(path, exc=ModelFileError) -> str:
    with pytest.raises(exc) as info:
        model = load_gguf(path)
        list(model.tensors)
    message = str(info.value)
    assert str(path) in message  # every error names the file
    return message


def _patched_copy(src, dst, patch):
    shutil.copy(src, dst)
    reader = gguf.GGUFReader(dst, "r+")
    patch(reader)
    reader.data.flush()
    del reader
    return dst


# ---- dequantization


@pytest.mark.parametrize("kind", [T.Q8_0, T.Q4_0, T.Q4_1, T.F16, T.BF16])
def test_dequantize_matches_gguf_reference(kind):
    x = np.random.default_rng(1).standard_normal((8, 96)).astype(np.float32) * 3
    packed = gguf.quants.quantize(x, kind)
    expected = gguf.quants.dequantize(packed, kind)
    ours = dequantize(packed.view(np.uint8), kind.name, (8, 96))
    assert ours.dtype == torch.float32 and tuple(ours.shape) == (8, 96)
    np.testing.assert_array_equal(ours.numpy(), expected)


def test_unpermute_inverts_llama_cpp_permutation():
    # llama.cpp's converter groups each head's rows as (2, half) and interleaves them to (half, 2)
    heads, head_dim, cols = 3, 8, 5
    hf = torch.randn(heads * head_dim, cols)
    stored = hf.reshape(heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(hf.shape)
    assert not torch.equal(stored, hf)
    assert torch.equal(unpermute_rows(stored, heads), hf)


def test_tensor_names_follow_hugging_face():
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("blk.7.attn_k.weight") == "model.layers.7.self_attn.k_proj.weight"
    assert hf_tensor_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert hf_tensor_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_tensor_name("output_norm.weight") == "model.norm.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("rope_freqs.weight") is None


# ---- a good file


def test_small_file_loads_with_reference_values(small_gguf):
    model = load_gguf(small_gguf)
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (HIDDEN, HEADS, KV_HEADS)
    assert cfg.num_hidden_layers == 1 and cfg.vocab_size == VOCAB and not cfg.tie_word_embeddings
    assert cfg.eos_token_ids == [2] and cfg.bos_token_id == 1
    tensors = dict(model.tensors)
    reader = gguf.GGUFReader(small_gguf)
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        ref = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
        if ".attn_q." in t.name:
            ref = unpermute_rows(ref, HEADS)
        elif ".attn_k." in t.name:
            ref = unpermute_rows(ref, KV_HEADS)
        assert torch.equal(tensors[name], ref), name
    assert model.metadata["general.architecture"] == "llama"
    assert "tokenizer.ggml.tokens" not in model.metadata  # only small scalars for display
    assert model.tokenizer.eos_token_ids == {0, 2}  # eos, and <|endoftext|> as llama.cpp ends generation there too


def test_raw_tensors_stay_packed_and_match(small_gguf):
    loaded = dict(load_gguf(small_gguf).tensors)
    raw = {r.name: r for r in iter_raw_tensors(small_gguf)}
    assert raw.keys() == loaded.keys()
    q = raw["model.layers.0.self_attn.q_proj.weight"]
    assert q.type_name == "Q4_0" and q.shape == (HIDDEN, HIDDEN) and q.data.shape == (HIDDEN, HIDDEN // 32 * 18)
    for name, r in raw.items():
        assert torch.equal(dequantize(r.data, r.type_name, r.shape), loaded[name]), name


def test_metadata_matches_gguf_reader(small_gguf):
    ours = read_gguf_metadata(small_gguf)
    reader = gguf.GGUFReader(small_gguf)
    for key, field in reader.fields.items():
        if not key.startswith("GGUF."):
            assert ours[key] == field.contents(), key


# ---- failures: each one a ModelFileError naming the file and the problem


def test_truncated_file(small_gguf, tmp_path):
    data = small_gguf.read_bytes()
    for cut in (10, 200, 2000, len(data) - 100):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        message = _error(path)
        assert "truncated" in message or "past the end" in message or "only" in message


def test_tensor_offset_beyond_file(small_gguf, tmp_path):
    def patch(reader):
        reader.tensors[3].field.parts[5][0] = 1 << 40

    path = _patched_copy(small_gguf, tmp_path / "offset.gguf", patch)
    message = _error(path)
    assert "extends past the end of the file" in message and "'blk.0." in message


def test_unknown_tensor_type_id(small_gguf, tmp_path):
    def patch(reader):
        reader.tensors[0].field.parts[4][0] = 99

    message = _error(_patched_copy(small_gguf, tmp_path / "type.gguf", patch))
    assert "unknown tensor type id 99" in message


def test_unsupported_tensor_type_is_refused_by_name(tmp_path):
    path = tmp_path / "q8k.gguf"
    blocks = np.random.default_rng(0).integers(0, 255, (4, 292), dtype=np.uint8)  # one Q8_K block per row
    write_gguf(path, extra_tensor=("blk.0.attn_v.bias", blocks, T.Q8_K))  # a type gguf cannot dequantize either
    message = _error(path)
    assert "Q8_K" in message and "supported" in message
    with pytest.raises(ModelFileError):
        list(iter_raw_tensors(path))


def test_bad_magic(small_gguf, tmp_path):
    path = tmp_path / "magic.gguf"
    path.write_bytes(b"GGML" + small_gguf.read_bytes()[4:])
    assert "bad magic" in _error(path)


def test_not_a_gguf_at_all(tmp_path):
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    assert "only 0 bytes" in _error(empty)
    missing = tmp_path / "missing.gguf"
    assert "cannot read" in _error(missing)


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    write_gguf(path, arch="gpt2")
    message = _error(path, UnsupportedArchitecture)
    assert "'gpt2'" in message and "llama" in message


def test_huge_array_length_fails_fast(small_gguf, tmp_path):
    def patch(reader):
        reader.fields["tokenizer.ggml.tokens"].parts[4][0] = 1 << 50  # the array's length

    message = _error(_patched_copy(small_gguf, tmp_path / "huge.gguf", patch))
    assert "tokenizer.ggml.tokens" in message


def test_bad_string_length(small_gguf, tmp_path):
    def patch(reader):
        reader.fields["general.architecture"].parts[3][0] = 1 << 62  # the value's string length

    message = _error(_patched_copy(small_gguf, tmp_path / "str.gguf", patch))
    assert "general.architecture" in message


def test_all_errors_are_user_errors(small_gguf, tmp_path):
    # random corruption anywhere in the header never escapes as anything but an LlmdError
    data = bytearray(small_gguf.read_bytes())
    rng = np.random.default_rng(0)
    header_end = 3000
    failures = 0
    for i in range(30):
        corrupt = bytearray(data)
        for pos in rng.integers(4, header_end, 4):
            corrupt[pos] = int(rng.integers(0, 256))
        path = tmp_path / f"rand{i}.gguf"
        path.write_bytes(bytes(corrupt))
        try:
            list(load_gguf(path).tensors)
        except LlmdError:
            failures += 1
    assert failures > 0


# ---- the bundled model


def test_smollm2_header(smollm2_gguf):
    model = load_gguf(smollm2_gguf)
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 576, 9, 3)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings and cfg.rope_theta == 100000.0
    first = next(model.tensors)
    assert first[0] == "model.embed_tokens.weight" and tuple(first[1].shape) == (49152, 576)
    assert "Smollm2" in model.metadata["general.name"]
    assert model.tokenizer.chat_template and "<|im_start|>" in model.tokenizer.chat_template
