"""The tokenizer: a `tokenizers.Tokenizer` plus what serving needs around it (special ids, chat template, FIM ids).

Two sources:
- a Hugging Face folder: tokenizer.json, tokenizer_config.json (bos/eos, add_bos_token, chat_template, or a
  chat_template.jinja file), generation_config.json and config.json (eos ids);
- GGUF metadata (`tokenizer.ggml.*`): a byte-level BPE ("gpt2" model) rebuilt from its tokens and merges, with the
  pre-tokenizer its `tokenizer.ggml.pre` names, control tokens as special tokens, and the chat template.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from ..errors import InvalidRequest, ModelFileError
from .chat_template import render_chat

# Split patterns for byte-level BPE vocabularies, keyed by llama.cpp's `tokenizer.ggml.pre` names.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# GPT-2's own split, with every digit on its own first (as SmolLM2's and StarCoder's tokenizer.json do)
_DIGITS_FIRST = {"smollm", "starcoder", "refact"}

# (prefix, suffix, middle) spellings of fill-in-the-middle tokens, StarCoder/SmolLM style then Qwen style
_FIM_SPELLINGS = (
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    ("<|fim▁begin|>", "<|fim▁hole|>", "<|fim▁end|>"),
)

_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
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


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFileError(path, f"not valid JSON: {e}") from None
    return data if isinstance(data, dict) else {}


def _id_list(value) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


class Tokenizer:
    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        eos_token_ids: set[int] | None = None,
        chat_template: str | None = None,
        special_tokens: dict[str, str | None] | None = None,
    ):
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        eos_ids = set(eos_token_ids or ())
        if eos_token and backend.token_to_id(eos_token) is not None:
            eos_ids.add(backend.token_to_id(eos_token))
        self.eos_token_ids: set[int] = eos_ids
        self.chat_template = chat_template
        # variables a chat template sees (bos_token, eos_token, ...), as transformers passes them
        self.special_tokens = {"bos_token": bos_token, "eos_token": eos_token, **(special_tokens or {})}
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.special_ids = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        self._byte_level = '"ByteLevel"' in (backend.decoder.__getstate__().decode() if backend.decoder else "")

    # ---- construction

    @classmethod
    def from_hf_folder(cls, path: str | Path) -> "Tokenizer":
        folder = Path(path)
        tok_file = folder / "tokenizer.json"
        if not tok_file.exists():
            raise ModelFileError(folder, "no tokenizer.json (llmd needs a fast tokenizer file)")
        try:
            backend = BackendTokenizer.from_file(str(tok_file))
        except Exception as e:  # the tokenizers library reports parse errors as plain Exceptions
            raise ModelFileError(tok_file, f"cannot read the tokenizer: {e}") from None
        cfg = _read_json(folder / "tokenizer_config.json")
        gen = _read_json(folder / "generation_config.json")
        model_cfg = _read_json(folder / "config.json")
        bos, eos = _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token"))
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: use the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        jinja_file = folder / "chat_template.jinja"
        if template is None and jinja_file.exists():
            template = jinja_file.read_text(encoding="utf-8")
        eos_ids = set(_id_list(gen.get("eos_token_id")) or _id_list(model_cfg.get("eos_token_id")))
        if bos is None:  # some repos only give the id
            bos_id = gen.get("bos_token_id", model_cfg.get("bos_token_id"))
            bos = backend.id_to_token(bos_id) if isinstance(bos_id, int) else None
        if "add_bos_token" in cfg and bos:
            _set_bos_processing(backend, bos, bool(cfg["add_bos_token"]))
        extra = {k: _token_text(cfg.get(k)) for k in ("unk_token", "pad_token")}
        return cls(backend, bos_token=bos, eos_token=eos, eos_token_ids=eos_ids, chat_template=template,
                   special_tokens=extra)

    @classmethod
    def from_gguf(cls, metadata: dict, path: str | Path | None = None) -> "Tokenizer":
        where = path or "GGUF file"
        model = metadata.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ModelFileError(
                where, f"tokenizer model {model!r} is not supported in GGUF files (supported: gpt2, byte-level BPE)"
            )
        tokens = metadata.get("tokenizer.ggml.tokens") or []
        merges = metadata.get("tokenizer.ggml.merges") or []
        types = metadata.get("tokenizer.ggml.token_type") or []
        if not tokens or not all(isinstance(t, str) for t in tokens):
            raise ModelFileError(where, "GGUF tokenizer has no token list")
        vocab = {}
        for i, t in enumerate(tokens):
            vocab.setdefault(t, i)
        pairs = []
        for m in merges:
            left, sep, right = m.partition(" ")
            if not sep:
                raise ModelFileError(where, f"GGUF tokenizer merge {m!r} is not 'left right'")
            pairs.append((left, right))
        try:
            backend = BackendTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
        except Exception as e:
            raise ModelFileError(where, f"GGUF tokenizer vocabulary is inconsistent: {e}") from None
        backend.pre_tokenizer = _byte_level_pre_tokenizer(metadata.get("tokenizer.ggml.pre"))
        backend.decoder = decoders.ByteLevel()
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
        alphabet = set(_byte_decoder())
        control = [
            AddedToken(t, special=True, normalized=False)
            for t, kind in zip(tokens, types)
            if kind == _TOKEN_CONTROL and set(t) <= alphabet
        ]
        user = [AddedToken(t, special=False, normalized=False) for t, kind in zip(tokens, types)
                if kind == _TOKEN_USER_DEFINED]
        backend.add_special_tokens(control)
        backend.add_tokens(user)

        def token_at(key):
            idx = metadata.get(key)
            return tokens[idx] if isinstance(idx, int) and 0 <= idx < len(tokens) else None

        bos, eos = token_at("tokenizer.ggml.bos_token_id"), token_at("tokenizer.ggml.eos_token_id")
        if metadata.get("tokenizer.ggml.add_bos_token") and bos:
            _set_bos_processing(backend, bos, True)
        eos_ids = {
            metadata[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                  "tokenizer.ggml.eom_token_id")
            if isinstance(metadata.get(k), int)
        }
        extra = {"unk_token": token_at("tokenizer.ggml.unknown_token_id"),
                 "pad_token": token_at("tokenizer.ggml.padding_token_id")}
        template = metadata.get("tokenizer.chat_template")
        return cls(backend, bos_token=bos, eos_token=eos, eos_token_ids=eos_ids,
                   chat_template=template if isinstance(template, str) else None, special_tokens=extra)

    # ---- text <-> ids

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_piece(self, token_id: int) -> str | None:
        """The vocabulary entry as stored (e.g. 'Ġworld' in a byte-level vocabulary)."""
        return self.backend.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for (may be part of a UTF-8 character)."""
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self.special_ids:
            return piece.encode("utf-8")
        if self._byte_level:
            table = _byte_decoder()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
            return piece.encode("utf-8")
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # sentencepiece byte fallback
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return piece.replace("\u2581", " ").encode("utf-8")

    # ---- chat

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        if not messages:
            raise InvalidRequest("messages must not be empty", "messages")
        # transformers drops keys whose value is None before rendering
        cleaned = [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m for m in messages]
        return render_chat(self.chat_template, cleaned, add_generation_prompt, self.special_tokens, **kwargs)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        """Token ids of the rendered chat. As transformers does, no special tokens are added on top of the
        template's text: a BOS appears exactly when the template writes one."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs),
                           add_special_tokens=False)

    def fim_token_ids(self) -> tuple[int, int, int] | None:
        for spelling in _FIM_SPELLINGS:
            ids = tuple(self.backend.token_to_id(t) for t in spelling)
            if all(i is not None for i in ids):
                return ids  # type: ignore[return-value]
        return None


def _byte_level_pre_tokenizer(pre: str | None):
    if pre in _SPLITS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_FIRST:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


def _set_bos_processing(backend: BackendTokenizer, bos: str, add_bos: bool) -> None:
    """Make encode(add_special_tokens=True) prepend BOS exactly when the model asks for it."""
    bos_id = backend.token_to_id(bos)
    if bos_id is None:
        return
    adds_now = backend.encode("a", add_special_tokens=True).ids[:1] == [bos_id]
    if add_bos and not adds_now:
        template = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
        )
        current = backend.post_processor
        backend.post_processor = processors.Sequence([current, template]) if current else template
    elif not add_bos and adds_now:
        backend.post_processor = None


from .detokenizer import IncrementalDetokenizer  # noqa: E402  (re-exported: part of the tokenizer's contract)
