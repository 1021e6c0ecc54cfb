"""Grammar-constrained decoding: a request's Constraint compiled once, a matcher per request, token masks per step.

The library is llguidance, not xgrammar (the other candidate): llguidance is one Rust extension with no Python
dependencies, takes the vocabulary as plain byte strings per token id (so llmd's own tokenizer, byte-level BPE or
sentencepiece, GGUF-born ones included, adapts in a few lines), needs no up-front per-grammar compilation (a JSON
schema, Lark, regex or GBNF grammar is ready in about a millisecond and computes each mask lazily, in tens of
microseconds on the CPU), rolls back consumed tokens (speculative proposals are checked and undone), and bounds its
own work per grammar and per token (LLParserLimits). xgrammar precomputes a token-mask cache when it compiles each
grammar, a latency every new schema pays (agents send new schemas and tool lists all the time), and brings a
heavier Python stack with it.

Pieces:
  - `lltokenizer`: llmd's Tokenizer as llguidance's LLTokenizer (built once per engine, off the engine thread);
  - `GrammarCompiler`: Constraint -> CompiledGrammar, checked against size, nesting and alternative bounds,
    cached by (kind, text) in a bounded LRU; invalid or unsatisfiable -> ConstraintError (a 400);
  - `GrammarMatcher`: one request's state; it consumes exactly the request's output tokens (the engine feeds it
    the accepted run), fills one mask row per sampled position (1 + k with a speculative proposal of k, rolled
    back afterwards), and says when the grammar is finished (the request then ends);
  - `RowMasks`: one step's bitmask rows, applied to the logits in place before sampling.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

import llguidance
import numpy as np
import torch

from .types import Constraint, ConstraintError

if TYPE_CHECKING:
    from ..model.tokenizer import Tokenizer

MAX_CONSTRAINT_CHARS = 256 * 1024  # grammar / schema text
MAX_SCHEMA_DEPTH = 48  # nesting of a JSON schema document
MAX_SCHEMA_ALTERNATIVES = 2048  # anyOf / oneOf / allOf members and enum / const values, summed over the schema
COMPILE_TIMEOUT_S = 10.0  # the async front gives up waiting past this (llguidance's fuel limits bound the work)
GRAMMAR_CACHE_SIZE = 64
# Whitespace between JSON tokens, as llama.cpp's JSON-schema grammars allow it: nothing, one space, or one line
# break and an indentation, so a small model cannot loop on blank lines inside a value that is otherwise complete.
JSON_OPTIONS = {"whitespace_pattern": r"(\x20|\x0A[\x20\x09]{0,20})?"}
# llguidance's own bounds (per grammar and per token step), a bit below its defaults: a request can cost at most a
# few milliseconds of mask computation per token.
PARSER_LIMITS = dict(max_items_in_row=2000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
                     step_max_items=50_000, max_lexer_states=100_000, max_grammar_size=200_000)


# ---- the tokenizer ------------------------------------------------------------------------------------------------
class _TokenizerView:
    """llguidance's tokenizer protocol (see llguidance.TokenizerWrapper) over llmd's Tokenizer."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_id: int):
        self.eos_token_id = eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(i for i in tokenizer.special_ids if i < vocab_size)
        special = set(self.special_token_ids)
        tokens = []
        for i in range(vocab_size):  # ids past the tokenizer's own (a padded embedding) stand for nothing
            raw = tokenizer.token_bytes(i) if i < tokenizer.vocab_size else b""
            tokens.append(b"\xff" + raw if i in special else raw)  # llguidance's marking of special tokens
        self.tokens = tokens
        self.is_tokenizer_wrapper = True
        self._tokenizer = tokenizer

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text)


def lltokenizer(tokenizer: Tokenizer, vocab_size: int, eos_token_ids: list[int]) -> llguidance.LLTokenizer:
    """The model's vocabulary (vocab_size: the logits' width) as llguidance sees it; EOS ids end a finished grammar."""
    view = _TokenizerView(tokenizer, vocab_size, eos_token_ids[0])
    return llguidance.LLTokenizer(view, n_vocab=vocab_size, eos_token=list(eos_token_ids))


# ---- compiling ----------------------------------------------------------------------------------------------------
def _check_schema_bounds(schema) -> None:
    """Nesting and alternatives of a parsed JSON schema, walked without recursion."""
    alternatives = 0
    stack = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise ConstraintError(f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
        if isinstance(node, dict):
            for key in ("anyOf", "oneOf", "allOf", "enum"):
                if isinstance(node.get(key), list):
                    alternatives += len(node[key])
            if "const" in node:
                alternatives += 1
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
        if alternatives > MAX_SCHEMA_ALTERNATIVES:
            raise ConstraintError(f"the JSON schema has more than {MAX_SCHEMA_ALTERNATIVES} alternatives "
                                  "(anyOf/oneOf/allOf members and enum values)")


def grammar_source(constraint: Constraint) -> str:
    """The constraint as an llguidance grammar definition; ConstraintError when it is malformed or too large."""
    kind, text = constraint.kind, constraint.text
    if not isinstance(text, str):
        raise ConstraintError("the constraint text must be a string")
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise ConstraintError(f"the {kind} is {len(text)} characters long; at most {MAX_CONSTRAINT_CHARS} are allowed")
    try:
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
        if kind == "json_schema":
            try:
                schema = json.loads(text)
            except (ValueError, RecursionError) as e:
                raise ConstraintError(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ConstraintError("a JSON schema must be an object (or true/false)")
            _check_schema_bounds(schema)
            return llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(schema) if isinstance(schema, dict) else ("{}" if schema else '{"not": {}}'),
                defaults=JSON_OPTIONS)
        if kind == "lark":
            return llguidance.LLMatcher.grammar_from_lark(text)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(text)
        if kind == "gbnf":
            return llguidance.grammar_from("gbnf", text)
    except ValueError as e:  # llguidance's own parsing (GBNF conversion, schema options)
        raise ConstraintError(f"invalid {kind}: {e}") from None
    raise ConstraintError(f"unknown constraint kind {kind!r}")


class CompiledGrammar:
    """A checked grammar: a fresh matcher to copy for every request."""

    def __init__(self, constraint: Constraint, template: llguidance.LLMatcher, vocab_size: int,
                 eos_token_ids: frozenset[int]):
        self.constraint = constraint
        self._template = template
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._template.deep_copy(), self.vocab_size, self.eos_token_ids)


class GrammarCompiler:
    """Constraint -> CompiledGrammar for one model's vocabulary. Thread-safe; results (and errors) are cached."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, eos_token_ids: list[int],
                 cache_size: int = GRAMMAR_CACHE_SIZE):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._lltok: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar | ConstraintError] = OrderedDict()
        self._cache_size = cache_size
        self._limits = llguidance.LLParserLimits(**PARSER_LIMITS)

    def _llt(self) -> llguidance.LLTokenizer:
        with self._tokenizer_lock:  # not the cache's lock: cached() on the event loop never waits for this build
            if self._lltok is None:
                if self._tokenizer is None or not self._eos:
                    raise ConstraintError("this model has no tokenizer with an end-of-sequence token, so its "
                                          "output cannot be constrained")
                self._lltok = lltokenizer(self._tokenizer, self.vocab_size, self._eos)
            return self._lltok

    def warm_up(self) -> None:
        """Build the tokenizer adapter now (about a second for a large vocabulary), so the first constrained request
        does not wait for it. Safe to call from any thread; a model without a tokenizer skips it."""
        try:
            self._llt()
        except ConstraintError:
            pass

    def cached(self, constraint: Constraint) -> CompiledGrammar | ConstraintError | None:
        with self._lock:
            hit = self._cache.get((constraint.kind, constraint.text))
            if hit is not None:
                self._cache.move_to_end((constraint.kind, constraint.text))
            return hit

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        """Compile (or take from the cache) and check; raises ConstraintError."""
        hit = self.cached(constraint)
        if hit is None:
            try:
                hit = self._compile(constraint)
            except ConstraintError as e:
                hit = e
            with self._lock:
                self._cache[(constraint.kind, constraint.text)] = hit
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        if isinstance(hit, ConstraintError):
            raise ConstraintError(str(hit), field=hit.field)
        return hit

    def _compile(self, constraint: Constraint) -> CompiledGrammar:
        source = grammar_source(constraint)
        lltok = self._llt()
        matcher = llguidance.LLMatcher(lltok, source, log_level=0, limits=self._limits)
        if matcher.is_error():
            raise ConstraintError(f"invalid {constraint.kind}: {_first_line(matcher.get_error())}")
        # Unsatisfiable from the start (e.g. an empty enum): no token at all is allowed.
        probe = GrammarMatcher(matcher.deep_copy(), self.vocab_size, frozenset(self._eos))
        mask = probe.new_bitmask(1)
        probe.fill(mask, 0)
        if probe.error or not mask.any():
            why = probe.error or "no output can satisfy it"
            raise ConstraintError(f"the {constraint.kind} cannot be satisfied: {_first_line(why)}")
        return CompiledGrammar(constraint, matcher, self.vocab_size, frozenset(self._eos))


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0][:500] if message.strip() else "unknown error"


# ---- per request --------------------------------------------------------------------------------------------------
class GrammarMatcher:
    """One request's grammar state; it has consumed exactly the request's output tokens.

    Looking ahead (a proposal's mask rows, a draft's proposal) steps the state with `step` and undoes it with
    `rollback`. llguidance does not count an EOS among the tokens it can roll back, so `step` never takes one: an
    EOS ends the request, and the positions after it are never sampled."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos_token_ids: frozenset[int]):
        self._m = matcher
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids

    @property
    def error(self) -> str | None:
        if not self._m.is_error():
            return None
        return self._m.get_error() or "grammar error"

    @property
    def is_finished(self) -> bool:
        """Nothing but EOS can follow: the output is complete."""
        return self._m.is_stopped()

    def new_bitmask(self, rows: int) -> torch.Tensor:
        return torch.zeros((rows, (self.vocab_size + 31) // 32), dtype=torch.int32)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (int32 words, bit i of word w = token 32 * w + i)."""
        view = bitmask[row]
        self._m.unsafe_compute_mask_ptr(view.data_ptr(), view.numel() * 4)

    def fill_run(self, bitmask: torch.Tensor, row: int, proposal: list[int]) -> int:
        """Fill rows row .. row + m for the positions of a speculative proposal whose first m tokens the grammar
        allows (m <= k, up to an EOS); the matcher steps through those m tokens and rolls back. Returns m + 1."""
        m = self._m.validate_tokens(proposal) if proposal else 0
        self.fill(bitmask, row)
        stepped = 0
        for j in range(m):
            if not self.step(proposal[j]):
                break
            stepped += 1
            self.fill(bitmask, row + 1 + j)
        self.rollback(stepped)
        return stepped + 1

    def forced_tokens(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces from here (e.g. a JSON key that must come next), canonically
        tokenized: a speculative proposal that costs nothing to make."""
        if limit <= 0 or self._m.is_stopped():
            return []
        return self._m.compute_ff_tokens()[:limit]

    def step(self, token: int) -> bool:
        """Look ahead by one allowed, non-EOS token (undo with rollback); False (nothing done) otherwise."""
        if token in self.eos_token_ids or not self._m.validate_tokens([token]):
            return False
        return self._m.consume_token(token)

    def valid_prefix_len(self, tokens: list[int]) -> int:
        """How many leading tokens the grammar allows from here (nothing is consumed)."""
        return self._m.validate_tokens(tokens)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens stepped tokens."""
        if num_tokens:
            self._m.rollback(num_tokens)

    def accept(self, token: int) -> bool:
        """Consume one accepted output token; False if the grammar does not allow it (then it is in error)."""
        return self._m.consume_token(token)


# ---- per step -----------------------------------------------------------------------------------------------------
class RowMasks:
    """The grammar masks of one step: bitmask rows for some logits rows."""

    def __init__(self, bitmask: torch.Tensor, rows: list[int]):
        self.bitmask = bitmask  # [len(rows), words] int32, CPU
        self.rows = rows

    @torch.inference_mode()  # the runner's logits are inference tensors
    def apply(self, logits: torch.Tensor) -> None:
        """Disallowed tokens (and ids past the mask's vocabulary) get -inf, in place."""
        vocab = logits.shape[1]
        # unpack the inverted words to one byte per token, reinterpreted as bool: True = disallowed
        banned = np.unpackbits((~self.bitmask.numpy()).view(np.uint8), axis=-1, bitorder="little")
        banned = torch.from_numpy(banned).view(torch.bool).to(logits.device, non_blocking=True)
        width = min(vocab, banned.shape[1])
        for i, row in enumerate(self.rows):
            logits[row, :width].masked_fill_(banned[i, :width], float("-inf"))
            if width < vocab:
                logits[row, width:] = float("-inf")


def step_masks(groups: list[tuple[GrammarMatcher | None, list[int]]]) -> RowMasks | None:
    """Masks for one step's sampled sequences, in logits-row order: (grammar or None, proposal) per sequence, each
    owning 1 + len(proposal) rows. None when no sequence is constrained."""
    constrained = [(g, p) for g, p in groups if g is not None]
    if not constrained:
        return None
    bitmask = constrained[0][0].new_bitmask(sum(1 + len(p) for _, p in constrained))
    rows: list[int] = []
    logits_row = mask_row = 0
    for grammar, proposal in groups:
        if grammar is not None:
            written = grammar.fill_run(bitmask, mask_row, proposal)
            rows.extend(range(logits_row, logits_row + written))
            mask_row += written
        logits_row += 1 + len(proposal)
    return RowMasks(bitmask[:mask_row], rows)
