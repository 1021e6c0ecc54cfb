"""One request's state inside the engine.

The KV state of a sequence is two explicit numbers over one token list: `token_ids` (prompt followed by every
generated token) and `num_computed_tokens` (how many of them have K/V in the cache). Whatever remains,
`token_ids[num_computed_tokens:]`, is what the next forward must process; when that forward reaches the end of the
list, a new token is sampled. Prefill, chunked prefill, decode and recompute after preemption are all this one rule,
and speculative decoding runs a proposal after the last token and keeps the KV of what verification accepted.
An embedding request is the same rule stopped at the end of the prompt: its last chunk yields a pooled vector
instead of a token, and the sequence finishes there.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .types import EmbedParams, FinishReason, ImageSpan, Priority, RequestTimings, SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from .grammar import GrammarMatcher

_arrival_counter = itertools.count()


def rope_positions(images: list[ImageSpan], start: int, n: int) -> tuple[list[int], list[int], list[int]]:
    """The (t, h, w) RoPE positions of tokens start .. start + n - 1 for a model with multimodal RoPE (Qwen3.5, as
    transformers' get_rope_index): a text token's three are its index shifted by what the images before it saved;
    an image with a grid puts its token (row r, column c) at (p, p + r, p + c), p its first token's shifted index,
    and the text after it continues from p + max(rows, columns). Decode steps past the prompt are the same rule
    (the "rope delta"), so a token's positions depend only on its index and the images: chunks, prefix hits and
    recompute after preemption see the same ones."""
    t: list[int] = []
    h: list[int] = []
    w: list[int] = []
    shift, i, end = 0, start, start + n

    def text(lo: int, hi: int) -> None:
        if lo < hi:
            run = range(lo + shift, hi + shift)
            t.extend(run)
            h.extend(run)
            w.extend(run)

    for image in images:
        if image.grid is None:
            continue
        if image.start >= end:
            break
        text(i, image.start)
        rows, cols = image.grid
        first = image.start + shift
        for j in range(max(i, image.start) - image.start, min(image.end, end) - image.start):
            t.append(first)
            h.append(first + j // cols)
            w.append(first + j % cols)
        shift += max(rows, cols) - image.length
        i = max(i, image.end)
    text(i, end)
    return t, h, w


@dataclass
class BlockTable:
    """A sequence's blocks in one KV group: one id per block of the context from position 0 (the leading
    `num_dropped` released, their ids kept as placeholders that are never read), and the prefix-cache keys of its
    leading full blocks."""

    ids: list[int] = field(default_factory=list)
    num_dropped: int = 0
    hashes: list[int] = field(default_factory=list)

    @property
    def held(self) -> list[int]:
        return self.ids[self.num_dropped :]


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: Priority,
        timings: RequestTimings,
        generator: torch.Generator | None = None,
        grammar: "GrammarMatcher | None" = None,
        embed: EmbedParams | None = None,
        images: list[ImageSpan] | None = None,
    ):
        self.request_id = request_id
        self.images = images or []  # the prompt's images, in order (their embeddings replace their tokens')
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []  # one per block of the context, from position 0
        # leading entries of block_ids released because every layer's sliding window has passed them (their ids
        # stay as placeholders, never read): llmd.engine.block_manager
        self.num_dropped_blocks = 0
        self.block_hashes: list[int] = []  # prefix-cache keys of this sequence's leading full blocks
        # the window layers' own blocks in a model that mixes window and global layers (the second KV group,
        # llmd.engine.block_manager); empty otherwise
        self.window_blocks = BlockTable()
        # a hybrid model's recurrent state (llmd.engine.state_pool): this sequence's slot while it runs, and the
        # prefix checkpoint to copy into it before its next step (a prefix hit)
        self.state_slot: int | None = None
        self.restore_from: int | None = None
        self.params = params
        self.priority = Priority(priority)
        self.arrival_order = next(_arrival_counter)
        self.status = SeqStatus.WAITING
        self.timings = timings
        self.generator = generator
        self.grammar = grammar  # the output's grammar state: it has consumed exactly the output tokens
        self.finish_reason: FinishReason | None = None
        self.admitted_once = False
        # An embedding request: prefill only, no token is sampled; each chunk's final hidden states are kept until
        # the last chunk, then pooled (engine/pooling.py). It neither reads nor fills the prefix cache.
        self.embed = embed
        self.hidden_chunks: list[torch.Tensor] = []
        # Output not yet handed to the caller (filled by the engine after sampling).
        self.pending_token_ids: list[int] = []
        self.pending_logprobs: list[TokenLogprob] = []
        self.pending_text = ""

    def cache_keys(self, token_ids: list[int]) -> list[int]:
        """token_ids as the prefix cache keys them: an image's placeholder positions by its pixels' digest (negative
        ids that no real token has), so two requests with the same image share blocks and two different images never
        do."""
        if not self.images:
            return token_ids
        keys = list(token_ids)
        for image in self.images:
            seed = int.from_bytes(image.digest[:8], "little")
            for j in range(image.start, min(image.end, len(keys))):
                keys[j] = -1 - ((seed + j - image.start) & 0x3FFFFFFFFFFFFFFF)
        return keys

    @property
    def key_ids(self) -> list[int]:
        return self.cache_keys(self.token_ids)

    def bidirectional_span(self, position: int) -> ImageSpan | None:
        """The image whose tokens attend both ways and that holds `position` (None: none does)."""
        return next((im for im in self.images if im.bidirectional and im.start <= position < im.end), None)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        """True while more than one token lacks K/V (prompt, or recompute after preemption)."""
        return self.num_uncomputed > 1

    @property
    def sort_key(self) -> tuple[int, int]:
        """Scheduling order: interactive before batch, then first come first served."""
        return (int(self.priority), self.arrival_order)

    def reset_for_recompute(self) -> None:
        self.num_computed_tokens = 0
        self.block_ids = []
        self.num_dropped_blocks = 0
        self.block_hashes = []
        self.window_blocks = BlockTable()
        self.restore_from = None
        self.status = SeqStatus.WAITING

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
            f"blocks={len(self.block_ids) - self.num_dropped_blocks}, {self.status.value})"
        )
