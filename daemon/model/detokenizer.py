"""Incremental detokenization: token ids in, text deltas out, never half a UTF-8 character.

Decoding each token alone is wrong twice over: a character can span tokens (emoji and CJK in byte-level BPE), and
tokenizers strip or add spaces depending on what precedes a token (sentencepiece's leading '▁'). So each step
decodes a short window that starts at the previously emitted tokens, and emits what the new tokens add to that
window's text. When the text ends in U+FFFD (an unfinished byte sequence), nothing is emitted until the character
completes. Work per token is O(window), not O(sequence).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
# A window that still ends in U+FFFD after this many pending tokens is real replacement text, not a split character.
_MAX_PENDING = 8


class IncrementalDetokenizer:
    def __init__(self, tokenizer: "Tokenizer", skip_special_tokens: bool = True, context_ids: list[int] | None = None):
        """`context_ids`: tokens already shown (e.g. the end of the prompt), so the first delta gets its space right."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(context_ids or [])[-4:]
        # text of ids[_prefix:_read] was already emitted; ids[_read:] are pending
        self._prefix = 0
        self._read = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly "")."""
        self._ids.append(int(token_id))
        prefix_text, full_text = self._texts()
        pending = len(self._ids) - self._read
        if full_text.endswith(_REPLACEMENT) and pending < _MAX_PENDING:
            return ""
        return self._emit(prefix_text, full_text)

    def flush(self) -> str:
        """Text of any tokens still held back (an unfinished character at the end comes out as U+FFFD)."""
        if self._read == len(self._ids):
            return ""
        return self._emit(*self._texts())

    def _texts(self) -> tuple[str, str]:
        return self._decode(self._ids[self._prefix : self._read]), self._decode(self._ids[self._prefix :])

    def _emit(self, prefix_text: str, full_text: str) -> str:
        if full_text.startswith(prefix_text):
            delta = full_text[len(prefix_text) :]
        else:
            # A byte-fallback decoder read the emitted character's bytes and an invalid new byte as one broken run
            # (all U+FFFD): the new tokens' own bytes give their text without touching what was already shown.
            new = [i for i in self._ids[self._read :]
                   if not (self.skip_special_tokens and i in self.tokenizer.hidden_ids)]
            delta = b"".join(self.tokenizer.token_bytes(i) for i in new).decode("utf-8", errors="replace")
        self._advance()
        return delta

    def _advance(self) -> None:
        # The tokens just emitted become the next window's context. They start and end on character boundaries
        # (text is only emitted once no character is left unfinished), so decoding them alone gives clean text;
        # a window starting mid-character would break byte-fallback decoders, which reject a whole byte run.
        self._ids = self._ids[self._read :]
        self._prefix, self._read = 0, len(self._ids)
