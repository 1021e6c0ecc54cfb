"""Tiny GGUF files that carry only a vocabulary (no tensors), trained here with `tokenizers` on a corpus of our own:
a Llama-3-style byte-level BPE (pre "llama-bpe"), a Qwen2-style one (pre "qwen2") and SentencePiece ("llama" model,
byte fallback, scores). Nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

import gguf
from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as Backend

from llmd.model.gguf_vocab import PRE_TOKENIZER_SPLITS

# English, code and a little French/German; no CJK or emoji, so those reach the SentencePiece vocabulary as bytes
CORPUS = [
    "The quick brown fox jumps over the lazy dog. What is the capital of France? Paris is.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for (int i = 0; i < 10; i++) {\n\tprintf(\"%d\\n\", i);\n}\n",
    "I'm sure we'll see they've done it; don't worry, it's fine. You're right, I'd say.",
    "Numbers: 1, 12, 123, 1234, 3.14159, 2024-01-01, 100000 and 42.",
    "Le café est très bon. Über alles, naïve Schüler.",
    "    indented    with    runs     of spaces\n\n\nand blank lines\t\ttabs",
    "Hello world! Hello there, hello again. HELLO LOUD. CamelCaseWords and snake_case_words.",
]


def _trained(pre_tokenizer, decoder, vocab_size: int, specials: list[str], byte_fallback: bool = False) -> Backend:
    backend = Backend(models.BPE(byte_fallback=byte_fallback))
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoder
    alphabet = pre_tokenizers.ByteLevel.alphabet() if not byte_fallback else []
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, initial_alphabet=alphabet,
                                  show_progress=False)
    backend.train_from_iterator(CORPUS * 3, trainer=trainer)
    return backend


def _writer(path: Path, arch: str) -> gguf.GGUFWriter:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(16)
    w.add_feed_forward_length(32)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    return w


def _finish(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_byte_level_gguf(path: Path, pre: str, specials: list[str], user_defined: list[str], *, bos: str | None,
                          eos: str, add_bos: bool, template: str | None = None, unmerged: list[str] = ()) -> Path:
    """A "gpt2" vocabulary split by llama.cpp's `pre` regexes: specials (control) first, then the trained tokens,
    then `user_defined` tokens (e.g. <think>) and `unmerged` ordinary tokens, which no merge reaches."""
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZER_SPLITS[pre]]
    pre_tok = pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend = _trained(pre_tok, decoders.ByteLevel(), 700, specials)
    vocab = backend.get_vocab()
    tokens = sorted(vocab, key=vocab.get) + user_defined + list(unmerged)
    merges = [" ".join(m) for m in _merges(backend)]
    w = _writer(path, "qwen2" if pre == "qwen2" else "llama")
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in specials else 4 if t in user_defined else 1 for t in tokens])
    w.add_token_merges(merges)
    if bos is not None:
        w.add_bos_token_id(tokens.index(bos))
    w.add_eos_token_id(tokens.index(eos))
    w.add_add_bos_token(add_bos)
    if template is not None:
        w.add_chat_template(template)
    _finish(w)
    return path


def write_sentencepiece_gguf(path: Path, *, arch: str = "llama", add_space_prefix: bool | None = True,
                             add_eos: bool = False) -> Path:
    """A "llama" (SentencePiece) vocabulary: <unk>, <s>, </s>, the 256 byte tokens, the trained pieces scored by
    merge order (earlier merge, higher score), a control token <|tool|> and a user-defined one <sep>."""
    pre_tok = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    backend = _trained(pre_tok, decoders.Metaspace(), 450, [], byte_fallback=True)
    vocab = backend.get_vocab()
    merged = {"".join(m): rank for rank, m in enumerate(_merges(backend))}
    pieces = sorted(vocab, key=vocab.get)
    tokens = ["<unk>", "<s>", "</s>", "<|tool|>", "<sep>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3, 3, 4] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * (5 + 256) + [-float(merged.get(p, len(merged) + i)) for i, p in enumerate(pieces)]
    w = _writer(path, arch)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_add_eos_token(add_eos)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)
    _finish(w)
    return path


def _merges(backend: Backend) -> list[tuple[str, str]]:
    import json

    merges = json.loads(backend.to_str())["model"]["merges"]
    return [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in merges]
