"""The tokenizer: a `tokenizers.Tokenizer` plus what serving needs around it (special ids, chat template, FIM ids).

Two sources:
- a Hugging Face folder: tokenizer.json, tokenizer_config.json (bos/eos, add_bos/eos_token, chat_template, or a
  chat_template.jinja or chat_template.json file), generation_config.json and config.json (eos ids);
- GGUF metadata (`tokenizer.ggml.*`, rebuilt by gguf_vocab: byte-level BPE or SentencePiece), its BOS/EOS flags
  and its chat template.

A model without a chat template (a base model) has `has_chat_template` False: its prompts are raw text, and
apply_chat_template refuses with an InvalidRequest saying so.

Decoding skips special tokens, except those an output parser reads: in a harmony vocabulary (gpt-oss's o200k_harmony,
known by its <|channel|> and <|message|> tokens) the message frame markers are special tokens, and text decoded for
the output keeps them (`shown_special_ids`), as llama.cpp renders them; tools/parsers.py takes them out of the
content. There <|end|> ends a message, not the generation: in a vocabulary with <|return|> and <|call|> (the
generation's real ends) it is no end-of-generation token whatever the files say (`message_end_ids`), as in
llama.cpp. Gemma 4's vocabulary (known by its <|channel> and <|tool_call> tokens) shows its thought channel and
call markers and the <|"|> string delimiter of its call syntax (tools/gemma4.py), as vLLM and llama.cpp decode them
for their parsers; there <|tool_response>, which the model writes after its calls to wait for their results, ends
the generation, as in llama.cpp.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from tokenizers import processors
from tokenizers import Tokenizer as BackendTokenizer

from ..errors import InvalidRequest, ModelFileError
from .chat_template import render_chat
from .gguf_vocab import backend_from_gguf, byte_decoder

# the end-of-generation tokens llama.cpp recognises by their text in a GGUF vocabulary
_END_OF_TURN = frozenset({
    "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<EOT>", "_<EOT>", "[EOT]", "<|return|>", "<|call|>", "<end_of_utterance>", "<｜end▁of▁sentence｜>", "<turn|>",
})

# harmony's message frame markers, decoded like text (see the module docstring); the vocabulary is harmony's when it
# has the first two
HARMONY_SHOWN = ("<|channel|>", "<|message|>", "<|start|>", "<|end|>", "<|constrain|>", "<|call|>", "<|return|>")
# Gemma 4's, likewise (the vocabulary is Gemma 4's when it has the first two)
GEMMA4_SHOWN = ("<|channel>", "<|tool_call>", "<channel|>", "<tool_call|>", '<|"|>')
GEMMA4_AWAIT_RESULTS = "<|tool_response>"

# (prefix, suffix, middle) spellings of fill-in-the-middle tokens, StarCoder/SmolLM style then Qwen style
_FIM_SPELLINGS = (
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    ("<|fim▁begin|>", "<|fim▁hole|>", "<|fim▁end|>"),
)

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
        named_templates: dict[str, str] | None = None,
    ):
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        eos_ids = set(eos_token_ids or ())
        if eos_token and backend.token_to_id(eos_token) is not None:
            eos_ids.add(backend.token_to_id(eos_token))
        # harmony's <|end|> ends a message, not the generation (<|return|> and <|call|> do): never an EOS here, nor
        # in the engine, whatever a file's metadata says
        ends = [backend.token_to_id(t) for t in ("<|return|>", "<|call|>", "<|end|>")]
        self.message_end_ids = frozenset(ends[2:] if None not in ends else ())
        gemma4 = all(backend.token_to_id(t) is not None for t in GEMMA4_SHOWN[:2])
        if gemma4 and backend.token_to_id(GEMMA4_AWAIT_RESULTS) is not None:
            eos_ids.add(backend.token_to_id(GEMMA4_AWAIT_RESULTS))
        self.eos_token_ids: set[int] = eos_ids - self.message_end_ids
        self.chat_template = chat_template
        # other templates by name; "tool_use" renders requests that carry tools, as in transformers
        self.named_templates: dict[str, str] = dict(named_templates or {})
        # variables a chat template sees (bos_token, eos_token, ...), as transformers passes them
        self.special_tokens = {"bos_token": bos_token, "eos_token": eos_token, **(special_tokens or {})}
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.special_ids = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        shown: set[int] = set()
        for markers in (HARMONY_SHOWN, GEMMA4_SHOWN):
            if all(backend.token_to_id(t) in self.special_ids for t in markers[:2]):
                shown = {i for i in map(backend.token_to_id, markers) if i in self.special_ids}
        self.shown_special_ids = frozenset(shown)  # special tokens that decoding keeps
        self.hidden_ids = frozenset(self.special_ids - shown)  # those it skips
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
        template, named = cfg.get("chat_template"), {}
        if isinstance(template, list):  # named templates: "default", and e.g. "tool_use" for requests with tools
            named = {t.get("name"): t.get("template") for t in template
                     if isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)}
            template = named.pop("default", None)
        jinja_file = folder / "chat_template.jinja"
        if template is None and jinja_file.exists():
            template = jinja_file.read_text(encoding="utf-8")
        if template is None:  # multimodal repos keep it in chat_template.json
            template = _read_json(folder / "chat_template.json").get("chat_template")
        eos_ids = set(_id_list(gen.get("eos_token_id")) or _id_list(model_cfg.get("eos_token_id")))
        if bos is None:  # some repos only give the id
            bos_id = gen.get("bos_token_id", model_cfg.get("bos_token_id"))
            bos = backend.id_to_token(bos_id) if isinstance(bos_id, int) else None
        flags = [bool(cfg[k]) if k in cfg else None for k in ("add_bos_token", "add_eos_token")]
        _set_special_processing(backend, bos, flags[0], eos, flags[1])
        extra = {k: _token_text(cfg.get(k)) for k in ("unk_token", "pad_token")}
        return cls(backend, bos_token=bos, eos_token=eos, eos_token_ids=eos_ids,
                   chat_template=template if isinstance(template, str) else None, special_tokens=extra,
                   named_templates=named)

    @classmethod
    def from_gguf(cls, metadata: dict, path: str | Path | None = None) -> "Tokenizer":
        where = path or "GGUF file"
        backend = backend_from_gguf(metadata, where)
        tokens = metadata["tokenizer.ggml.tokens"]

        def token_at(key):
            idx = metadata.get(key)
            return tokens[idx] if isinstance(idx, int) and 0 <= idx < len(tokens) else None

        bos, eos = token_at("tokenizer.ggml.bos_token_id"), token_at("tokenizer.ggml.eos_token_id")
        # llama.cpp (and transformers) add BOS to a SentencePiece vocabulary whose file does not say otherwise
        add_bos = metadata.get("tokenizer.ggml.add_bos_token", metadata.get("tokenizer.ggml.model") == "llama")
        _set_special_processing(backend, bos, bool(add_bos), eos, bool(metadata.get("tokenizer.ggml.add_eos_token")))
        eos_ids = {
            metadata[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                  "tokenizer.ggml.eom_token_id")
            if isinstance(metadata.get(k), int)
        }
        # A GGUF has no generation_config.json: like llama.cpp, end generation also at the end-of-turn tokens the
        # vocabulary has (Gemma's <end_of_turn> while its eos is <eos>, Llama 3's <|eom_id|>, ...)
        eos_ids |= {i for i, t in enumerate(tokens) if t in _END_OF_TURN}
        extra = {"unk_token": token_at("tokenizer.ggml.unknown_token_id"),
                 "pad_token": token_at("tokenizer.ggml.padding_token_id")}
        template = metadata.get("tokenizer.chat_template")
        prefix = "tokenizer.chat_template."  # named templates, e.g. tokenizer.chat_template.tool_use
        named = {k[len(prefix):]: v for k, v in metadata.items() if k.startswith(prefix) and isinstance(v, str)}
        return cls(backend, bos_token=bos, eos_token=eos, eos_token_ids=eos_ids,
                   chat_template=template if isinstance(template, str) and template.strip() else None,
                   special_tokens=extra, named_templates=named)

    # ---- text <-> ids

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        if skip_special_tokens and self.shown_special_ids:
            return self.backend.decode([i for i in ids if i not in self.hidden_ids], skip_special_tokens=False)
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
            table = byte_decoder()
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

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """The chat rendered by the model's template (InvalidRequest naming `messages` if it has none or it raises)."""
        template = self.chat_template
        if kwargs.get("tools") is not None and "tool_use" in self.named_templates:
            template = self.named_templates["tool_use"]
        if template is None:
            raise InvalidRequest(
                "this model has no chat template (a base model): send a raw prompt to a completion route instead",
                "messages")
        if not messages:
            raise InvalidRequest("messages must not be empty", "messages")
        # transformers drops keys whose value is None before rendering
        cleaned = [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m for m in messages]
        return render_chat(template, cleaned, add_generation_prompt, self.special_tokens, **kwargs)

    def with_chat_template(self, template: str) -> "Tokenizer":
        """This tokenizer with another chat template (a created model's TEMPLATE); the vocabulary is shared."""
        other = copy.copy(self)
        other.chat_template, other.named_templates = template, {}
        return other

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


def _set_special_processing(backend: BackendTokenizer, bos: str | None, add_bos: bool | None, eos: str | None,
                            add_eos: bool | None) -> None:
    """Make encode(add_special_tokens=True) put BOS first and EOS last exactly when the model asks for them
    (None: as the tokenizer does already)."""
    bos_id = backend.token_to_id(bos) if bos else None
    eos_id = backend.token_to_id(eos) if eos else None
    plain, full = backend.encode("a", add_special_tokens=False).ids, backend.encode("a", add_special_tokens=True).ids
    adds_now = full != plain
    adds_bos, adds_eos = adds_now and full[:1] == [bos_id], adds_now and full[-1:] == [eos_id]
    add_bos = (adds_bos if add_bos is None else add_bos) and bos_id is not None
    add_eos = (adds_eos if add_eos is None else add_eos) and eos_id is not None
    if (adds_bos, adds_eos) == (add_bos, add_eos) and adds_now == (add_bos or add_eos):
        return
    current = None if adds_now else backend.post_processor  # a processor adding other tokens is replaced
    if not (add_bos or add_eos):
        backend.post_processor = current
        return
    specials = [(t, i) for t, i, on in ((bos, bos_id, add_bos), (eos, eos_id, add_eos)) if on]

    def wrapped(part: str, type_id: int) -> str:
        return " ".join([f"{bos}:{type_id}"] * add_bos + [f"{part}:{type_id}"] + [f"{eos}:{type_id}"] * add_eos)

    template = processors.TemplateProcessing(single=wrapped("$A", 0), pair=f"{wrapped('$A', 0)} {wrapped('$B', 1)}",
                                             special_tokens=list(dict.fromkeys(specials)))
    backend.post_processor = processors.Sequence([current, template]) if current else template


from .detokenizer import IncrementalDetokenizer  # noqa: E402  (re-exported: part of the tokenizer's contract)
