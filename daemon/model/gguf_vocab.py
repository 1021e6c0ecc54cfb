"""A GGUF file's vocabulary (`tokenizer.ggml.*`) rebuilt as a `tokenizers.Tokenizer`, as transformers and llama.cpp
read it.

Three vocabulary models:
- "gpt2": byte-level BPE from the file's tokens and merges, split first by the regex its `tokenizer.ggml.pre` names
  (llama.cpp's names: llama-bpe for Llama 3, qwen2, smollm, tekken, ...). A file without a `pre` (or "default")
  gets GPT-2's own split, as transformers reads it (llama.cpp falls back to an older regex of its own and warns
  that quality suffers); a name llmd does not know is refused, naming it, as llama.cpp does.
- "llama": a SentencePiece vocabulary (Llama 2, Mistral 7B, Phi-3, Gemma) as BPE with byte fallback: the file holds
  no merges, so they are recovered from the vocabulary, best score first (Gemma: file order), which is how
  SentencePiece's own BPE picks merges. `add_space_prefix` (default on) puts '▁' before the text as transformers
  does: only at its start and not when it starts with a space (llama.cpp also adds one then, and after each special
  token); Phi-3's vocabulary is read as llama.cpp reads it, '▁' always.

- "gemma4": Gemma 4's BPE over whole characters (no byte alphabet), as llama.cpp reads it: spaces written '▁' first,
  the text cut into runs of newlines and runs of anything else, the file's merges, `<0xNN>` tokens for bytes no
  token spells; no space prefix.

All: control tokens (and <unk>) become special tokens and user-defined ones plain added tokens, matched whole in text.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from ..errors import ModelFileError

TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED = 2, 3, 4
_SPACE = "\u2581"  # SentencePiece's visible space

# ---- split regexes of byte-level vocabularies, by llama.cpp's `tokenizer.ggml.pre` names

_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (  # Llama 3's with single digits
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (  # Mistral Nemo: cased words, single digits, no contractions
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (  # o200k (Llama 4, Phi-4-mini): cased words with their contractions
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_FALCON = (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")
_BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"
_DEEPSEEK_CODER = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}")
_DEEPSEEK_V3 = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    (r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
     r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
)

# Each name maps to the regexes applied one after the other (each splits the pieces the previous one left).
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "dbrx", "smaug-bpe", "falcon3", "falcon-h1", "pixtral", "chatglm-bpe",
         "glm4", "midm-2.0", "lfm2"),
        (_LLAMA3,),
    ),
    **dict.fromkeys(
        ("qwen2", "deepseek-r1-qwen", "kormo", "stablelm2", "megrez", "hunyuan", "grok-2"), (_QWEN2,)),
    "tekken": (_TEKKEN,),
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2"), (_GPT4O,)),
    # GPT-2's split; the code models among them first cut every digit alone
    **dict.fromkeys(("default", "gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais", "trillion", "roberta-bpe", "gigachat",
                     "exaone4", "mellum", "a.x-4.0", "jina-v1-en", "jina-v2-code", "jina-es", "jina-de"), (_GPT2,)),
    "falcon": _FALCON,
    **dict.fromkeys(("bloom", "poro-chat", "gpt3-finnish"), (_BLOOM,)),
    "viking": (_BLOOM, r"\p{N}"),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"), (r"\p{N}", _GPT2)),
    **dict.fromkeys(("deepseek-coder",), _DEEPSEEK_CODER),
    **dict.fromkeys(("deepseek-v3", "hunyuan-dense"), _DEEPSEEK_V3),
}

# Families whose SentencePiece vocabulary transformers reads differently from Llama 2's (see _sentencepiece)
_GEMMA_ARCHS = {"gemma", "gemma2", "gemma3", "gemma3n"}
_PREFIX_BY_NORMALIZER_ARCHS = {"phi3"}


@lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: printable stand-in character -> byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[chr(b)] = b
        else:
            mapping[chr(256 + extra)] = b
            extra += 1
    return mapping


def backend_from_gguf(metadata: dict, where: str | Path) -> BackendTokenizer:
    """The tokenizer the file's `tokenizer.ggml.*` keys describe (BOS/EOS adding is left to the caller)."""
    model = metadata.get("tokenizer.ggml.model")
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    if not tokens or not all(isinstance(t, str) for t in tokens):
        raise ModelFileError(where, "GGUF tokenizer has no token list")
    types = list(metadata.get("tokenizer.ggml.token_type") or [])
    if model == "gpt2":
        backend = _byte_level(metadata, tokens, where)
    elif model == "llama":
        backend = _sentencepiece(metadata, tokens, where)
    elif model == "gemma4":
        backend = _gemma4(metadata, tokens, where)
    else:
        raise ModelFileError(
            where, f"tokenizer model {model!r} is not supported in GGUF files "
                   "(supported: gpt2 = byte-level BPE, llama = SentencePiece, gemma4 = Gemma 4's BPE)")
    vocab = backend.get_vocab(with_added_tokens=False)
    control = [t for t, kind in zip(tokens, types) if kind in (TOKEN_UNKNOWN, TOKEN_CONTROL) and t in vocab]
    user = [t for t, kind in zip(tokens, types) if kind == TOKEN_USER_DEFINED and t in vocab]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    return backend


def _byte_level(metadata: dict, tokens: list[str], where) -> BackendTokenizer:
    pre = metadata.get("tokenizer.ggml.pre") or "default"
    if pre not in PRE_TOKENIZER_SPLITS:
        raise ModelFileError(
            where, f"GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; "
                   f"supported: {', '.join(sorted(PRE_TOKENIZER_SPLITS))}")
    alphabet = set(byte_decoder())
    spelling = {b: c for c, b in byte_decoder().items()}
    types = metadata.get("tokenizer.ggml.token_type") or []
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        # Added tokens are stored as text, not in the byte alphabet. A control token keeps its text (it is matched
        # whole, never merged into); any other is respelled so that merges can reach it.
        is_control = i < len(types) and types[i] == TOKEN_CONTROL
        if not is_control and not set(token) <= alphabet:
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab[token] = i  # a repeated spelling keeps its last id, as llama.cpp and transformers do
    pairs = _merge_pairs(metadata, where)
    try:
        # Llama 3's and Tekken's tokenizers (and llama.cpp) take a piece that is a whole token as is, before merging
        ignore_merges = PRE_TOKENIZER_SPLITS[pre] in ((_LLAMA3,), (_TEKKEN,))
        backend = BackendTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False,
                                              ignore_merges=ignore_merges))
    except Exception as e:  # the tokenizers library raises plain Exceptions
        raise ModelFileError(where, f"GGUF tokenizer vocabulary is inconsistent: {e}") from None
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZER_SPLITS[pre]]
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    return backend


def _merge_pairs(metadata: dict, where) -> list[tuple[str, str]]:
    """The file's merges as pairs, each cut at its first space after the first character (as llama.cpp cuts them: a
    left part may be a space)."""
    pairs = []
    for m in metadata.get("tokenizer.ggml.merges") or []:
        cut = m.find(" ", 1)
        if cut < 0:
            raise ModelFileError(where, f"GGUF tokenizer merge {m!r} is not 'left right'")
        pairs.append((m[:cut], m[cut + 1:]))
    return pairs


def _gemma4(metadata: dict, tokens: list[str], where) -> BackendTokenizer:
    """Gemma 4's vocabulary (see the module docstring): llama.cpp's LLAMA_VOCAB_PRE_TYPE_GEMMA4 split, no byte
    encoding, byte fallback."""
    vocab = {t: i for i, t in enumerate(tokens)}  # a repeated spelling keeps its last id, as llama.cpp does
    try:
        backend = BackendTokenizer(models.BPE(vocab=vocab, merges=_merge_pairs(metadata, where), fuse_unk=False,
                                              byte_fallback=True))
    except Exception as e:  # the tokenizers library raises plain Exceptions
        raise ModelFileError(where, f"GGUF tokenizer vocabulary is inconsistent: {e}") from None
    backend.normalizer = normalizers.Replace(" ", _SPACE)
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|[\n]+"), behavior="isolated")
    backend.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    return backend


def _sentencepiece(metadata: dict, tokens: list[str], where) -> BackendTokenizer:
    arch = metadata.get("general.architecture")
    gemma = arch in _GEMMA_ARCHS
    scores = metadata.get("tokenizer.ggml.scores")
    if gemma:
        # Gemma stores its runs of spaces as real spaces, while the text they match has '▁' by then; and its scores
        # do not follow its merge order, the file order does.
        tokens = [_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
        scores = [-float(i) for i in range(len(tokens))]
    elif not isinstance(scores, list) or len(scores) != len(tokens):
        raise ModelFileError(where, "GGUF SentencePiece tokenizer needs one score per token (tokenizer.ggml.scores)")
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = merges_from_scores(vocab, dict(zip(tokens, scores)))
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else None
    try:
        backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True,
                                              byte_fallback=True))
    except Exception as e:
        raise ModelFileError(where, f"GGUF tokenizer vocabulary is inconsistent: {e}") from None
    prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    to_text = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if not prefix:
        backend.normalizer = normalizers.Replace(" ", _SPACE)
    elif arch in _PREFIX_BY_NORMALIZER_ARCHS:  # '▁' before every text, even one that starts with a space
        backend.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE), normalizers.Replace(" ", _SPACE)])
    else:  # '▁' before the text unless it starts with a space already
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=_SPACE, prepend_scheme="first", split=False)
    if prefix:
        to_text.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(to_text)
    return backend


def merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges a SentencePiece vocabulary implies: every split of a token into two tokens, the token with the
    best score first (then the longer left part, then the longer right part; ties keep vocabulary order)."""
    found = []
    for token, score in scores.items():
        splits = [k for k in range(1, len(token)) if token[:k] in vocab and token[k:] in vocab]
        if len(splits) > 1:
            splits.sort(key=lambda k: (vocab[token[:k]], vocab[token[k:]]))
        found.extend((score, k, len(token) - k, token) for k in splits)
    found.sort(key=lambda m: m[:3], reverse=True)  # stable: equal keys stay in the order found
    return [(token[:k], token[k:]) for _, k, _, token in found]
