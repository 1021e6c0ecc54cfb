"""Tokenizer, chat templates and the incremental detokenizer, against transformers (the reference)."""

from __future__ import annotations

import pytest

from llmd.errors import InvalidRequest
from llmd.model.detokenizer import IncrementalDetokenizer
from llmd.model.gguf import read_gguf_metadata
from llmd.model.tokenizer import Tokenizer

TEXTS = [
    "Hello world",
    "What is the capital of France?",
    "emoji 😀👍🏽 and a family 👨‍👩‍👧 done",
    "中文字符和日本語のテキスト、한국어도",
    "def f(x):\n    if x:\n        return x  # indented\n\treturn None\n",
    "    leading spaces and trailing   ",
    "numbers 12345 and 3.14159, 2024-01-01",
    "<|im_start|>user\nhi there<|im_end|>\n",
    "don't can't I'm we'll",
    "a\n\n\nb  \n c",
    "Café naïve über ÅÄÖ",
    "tabs\tand\t\ttabs\r\nwindows newline, six      spaces, a\u00a0non-breaking one",
    "12 123 1234 12345 -7 1e10 x = [1, 2]; y = {'a': 1} != z",
    "flags 🇫🇷 and <|endoftext|> inside text",
    " ",
]

CHATS = {
    "user": [{"role": "user", "content": "What is the capital of France?"}],
    "system": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi 😀"}],
    "multi_turn": [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi! How can I help?"},
        {"role": "user", "content": "Write  code:\n    x = 1"},
    ],
}


@pytest.fixture(scope="module")
def smol_meta(smollm2_gguf):
    return read_gguf_metadata(smollm2_gguf)


@pytest.fixture(scope="module")
def smol(smol_meta, smollm2_gguf):
    return Tokenizer.from_gguf(smol_meta, smollm2_gguf)


@pytest.fixture(scope="module")
def smol_ref(smollm2_gguf):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)


# ---- SmolLM2 from GGUF vs transformers


def test_gguf_tokenizer_matches_transformers(smol, smol_ref):
    assert smol.vocab_size == len(smol_ref)
    assert smol.bos_token_id == smol_ref.bos_token_id == 1
    assert smol_ref.eos_token_id == 2 and smol.eos_token_ids == {0, 2}  # <|im_end|>, and <|endoftext|> (llama.cpp)
    for text in TEXTS:
        ids = smol.encode(text)
        assert ids == smol_ref.encode(text, add_special_tokens=False), text
        assert smol.encode(text, add_special_tokens=True) == smol_ref.encode(text), text
        assert smol.decode(ids) == smol_ref.decode(ids, skip_special_tokens=True), text
        assert smol.decode(ids, skip_special_tokens=False) == smol_ref.decode(ids), text
    # special tokens in text stay whole
    assert smol.encode("<|im_start|>")[0] == 1 and len(smol.encode("<|im_start|>")) == 1


def test_digits_are_split_one_by_one(smol):
    # SmolLM2's tokenizer (and llama.cpp's "smollm" pre-tokenizer) put every digit in its own token
    ids = smol.encode("year 2024")
    assert [smol.decode([i]) for i in ids[-4:]] == ["2", "0", "2", "4"]


@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_chat_template_matches_transformers(smol, smol_ref, chat, add_generation_prompt):
    messages = CHATS[chat]
    text = smol.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert text == smol_ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    ids = smol_ref.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, return_dict=False)
    assert smol.encode_chat(messages, add_generation_prompt=add_generation_prompt) == list(ids)


def test_token_bytes_concatenate_to_the_text(smol):
    for text in TEXTS:
        ids = smol.encode(text)
        assert b"".join(smol.token_bytes(i) for i in ids) == text.encode("utf-8")
    assert smol.id_to_piece(smol.encode(" world")[0]) == "Ġworld"


def test_fim_tokens(smol, smol_meta):
    assert smol.fim_token_ids() is None  # SmolLM2-Instruct has none
    from tokenizers import AddedToken

    for spelling in (["<fim_prefix>", "<fim_suffix>", "<fim_middle>"], ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]):
        tok = Tokenizer.from_gguf(smol_meta)
        tok.backend.add_special_tokens([AddedToken(t, special=True) for t in spelling])
        ids = tok.fim_token_ids()
        assert ids is not None and [tok.id_to_piece(i) for i in ids] == spelling


# ---- tiny HF-format models vs transformers


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
def test_hf_folder_tokenizer_and_template_match_transformers(request, fixture):
    from transformers import AutoTokenizer

    folder = request.getfixturevalue(fixture)
    ours, ref = Tokenizer.from_hf_folder(folder), AutoTokenizer.from_pretrained(folder)
    assert ours.bos_token_id == ref.bos_token_id
    assert ref.eos_token_id in ours.eos_token_ids
    for text in TEXTS:
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False), text
        assert ours.encode(text, add_special_tokens=True) == ref.encode(text), text
        ids = ours.encode(text)
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids), text
    for messages in CHATS.values():
        for gen in (True, False):
            assert ours.apply_chat_template(messages, gen) == ref.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=gen)
            assert ours.encode_chat(messages, gen) == list(ref.apply_chat_template(
                messages, add_generation_prompt=gen, return_dict=False))


# ---- template errors and fallback


def _with_template(smol, template):
    tok = Tokenizer(smol.backend, bos_token=smol.bos_token, eos_token=smol.eos_token, chat_template=template)
    return tok


def test_template_error_becomes_invalid_request(smol):
    tok = _with_template(smol, "{% if messages[0]['role'] != 'system' %}{{ raise_exception('need a system turn') }}{% endif %}")
    with pytest.raises(InvalidRequest, match="need a system turn"):
        tok.apply_chat_template(CHATS["user"])
    with pytest.raises(InvalidRequest, match="compile"):
        _with_template(smol, "{% for m in messages %}").apply_chat_template(CHATS["user"])
    with pytest.raises(InvalidRequest):
        smol.apply_chat_template([])


def test_template_is_sandboxed(smol):
    tok = _with_template(smol, "{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(InvalidRequest):
        tok.apply_chat_template(CHATS["user"])
    tok = _with_template(smol, "{% set ns = namespace(_x=1) %}{{ ns }}")
    with pytest.raises(InvalidRequest):
        tok.apply_chat_template(CHATS["user"])


def test_template_helpers(smol):
    tok = _with_template(smol, "{{ bos_token }}|{{ eos_token }}|{{ strftime_now('%Y') | length }}|{{ messages | tojson }}")
    out = tok.apply_chat_template([{"role": "user", "content": "é<b>"}])
    assert out == '<|im_start|>|<|im_end|>|4|[{"role": "user", "content": "é<b>"}]'


def test_model_without_template_refuses_chat(smol):
    tok = _with_template(smol, None)
    assert not tok.has_chat_template and smol.has_chat_template
    with pytest.raises(InvalidRequest, match="no chat template") as err:
        tok.apply_chat_template(CHATS["system"])
    assert err.value.field == "messages"
    with pytest.raises(InvalidRequest, match="no chat template"):
        tok.encode_chat(CHATS["user"])


# ---- incremental detokenizer


def _stream(tok, ids, **kw):
    detok = IncrementalDetokenizer(tok, **kw)
    pieces = [detok.push(i) for i in ids]
    pieces.append(detok.flush())
    return pieces, detok


@pytest.mark.parametrize("text", TEXTS)
def test_detokenizer_round_trip(smol, text):
    ids = smol.encode(text)
    pieces, _ = _stream(smol, ids)
    assert "".join(pieces) == smol.decode(ids)
    assert all("\ufffd" not in p for p in pieces)  # no broken character ever emitted


def test_detokenizer_holds_split_characters(smol):
    ids = smol.encode("😀")
    assert len(ids) > 1  # one emoji spans several byte-level tokens
    pieces, _ = _stream(smol, ids)
    assert pieces[:-2] == [""] * (len(ids) - 1) and "".join(pieces) == "😀"


def test_detokenizer_skips_special_tokens_and_keeps_spaces(smol):
    ids = smol.encode_chat(CHATS["multi_turn"])
    pieces, _ = _stream(smol, ids)
    assert "".join(pieces) == smol.decode(ids)
    pieces, _ = _stream(smol, ids, skip_special_tokens=False)
    assert "".join(pieces) == smol.decode(ids, skip_special_tokens=False)


def test_detokenizer_window_stays_small(smol):
    ids = smol.encode(" ".join(TEXTS) * 20)
    detok = IncrementalDetokenizer(smol)
    out = []
    for i in ids:
        out.append(detok.push(i))
        assert len(detok._ids) <= 9  # a short window, not the whole sequence
    out.append(detok.flush())
    assert "".join(out) == smol.decode(ids)


def test_detokenizer_with_sentencepiece_style_spaces():
    """A Metaspace ('▁') tokenizer strips the first token's space when decoding it alone; the stream must not."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    import json

    backend = Backend(models.BPE(byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Sequence([decoders.Metaspace(), decoders.ByteFallback(), decoders.Fuse()])
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"], show_progress=False)
    backend.train_from_iterator(["hello world, the quick brown fox"] * 10, trainer=trainer)
    # byte-fallback pieces are ordinary vocabulary entries in sentencepiece models (not special tokens)
    spec = json.loads(backend.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    backend = Backend.from_str(json.dumps(spec))
    tok = Tokenizer(backend, bos_token="<s>", eos_token="</s>")
    for text in ["hello world the fox", "  two leading", "emoji 😀 and 中文"]:
        ids = tok.encode(text)
        pieces, _ = _stream(tok, ids)
        assert "".join(pieces) == tok.decode(ids), text
        assert all("\ufffd" not in p for p in pieces)
    # with the prompt's tail as context, the first generated word keeps its leading space
    prompt, answer = tok.encode("hello"), tok.encode(" world")
    detok = IncrementalDetokenizer(tok, context_ids=prompt)
    assert "".join(detok.push(i) for i in answer) + detok.flush() == " world"
