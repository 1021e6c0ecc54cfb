"""The target's own multi-token-prediction head as the draft (Qwen3.5 / Qwen3.6: llmd.model.qwen3_5_mtp).

The head reads the target's final hidden state at position t with token t+1 and guesses token t+2; its one
attention layer keeps its own paged KV (a pool as large in blocks as the target's, one layer deep; no prefix cache:
a position's KV depends on the next token too). Rules:
- The target runner hands each forward's hidden rows to `observe` (ModelRunner.hidden_observer): a generating
  sequence's rows wait in its MtpSeq (`pending`, for consecutive target positions) until the head takes them in. The
  head takes them in when it proposes (one batched catch-up forward over every proposing sequence's rows, whose last
  row gives the first guess), or, to bound what waits, in `observe` once a sequence holds more than `max_pending`
  rows (a long prompt's chunks, a sequence that has not proposed for a while).
- Head position m is target position `base + m`: `base` is where the rows started (0, or the end of a prefix-cache
  hit, whose positions the target never computed: the head then attends from there on). Rows of positions the head
  already took in (a preempted sequence computing again) are the ones it has and are skipped (a verified position's
  row never changes); a gap after the rows held starts the head over there.
- Guess r > 1 feeds the head's own output for the previous one. After verification only the head's positions fed by
  the target's rows stay (`exact`): the guesses' KV is rolled back, and the rows of rejected positions are dropped
  (rows of positions up to the verified length - 2 are the target's own, valid).
- The head is attention-only: the target's recurrent state is rolled back by the engine as for any proposal.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..model.attention import AttentionMetadata, allocate_kv_cache
from ..model.attention_backends import choose_backend
from ..model.qwen3_5_mtp import load_mtp_head
from .block_manager import BlockManager
from .config import EngineConfig
from .grammar import step_masks
from .scheduler import ScheduledSeq
from .sequence import Sequence
from .spec_draft import ProposalView, sample_draft

log = logging.getLogger(__name__)


class MtpSeq:
    """The head's view of one request."""

    def __init__(self, base: int):
        self.base = base  # the target position of head position 0
        self.exact = 0  # head positions [0, exact) hold KV made from the target's own rows
        self.drafted = 0  # positions past them holding the last proposal's guesses
        self.pending: list[torch.Tensor] = []  # target rows for target positions base + exact onwards
        self.block_ids: list[int] = []
        self.block_hashes: list[int] = []  # stays empty (no prefix cache)

    @property
    def hidden_from(self) -> int:
        return self.base + self.exact

    @property
    def num_pending(self) -> int:
        return sum(r.shape[0] for r in self.pending)

    def keep_pending(self, n: int) -> None:
        out, left = [], n
        for rows in self.pending:
            if left <= 0:
                break
            out.append(rows[:left])
            left -= rows.shape[0]
        self.pending = out


class MtpDraft:
    """The Speculator's draft (the interface of llmd.engine.spec_draft.DraftModel): propose, rollback, release."""

    def __init__(self, loaded, engine_config: EngineConfig, num_blocks: int, target_runner):
        self.loaded = loaded
        self.target = loaded.model
        self.head = load_mtp_head(loaded)
        c = self.head.config
        self.device, self.dtype = loaded.device, loaded.dtype
        self.block_size = engine_config.block_size
        self.attention = choose_backend(self.device, c, self.dtype, engine_config.kv_cache_dtype)
        self.kv_cache = allocate_kv_cache(1, num_blocks + 1, self.block_size, c.num_key_value_heads, c.head_dim,
                                          dtype=self.dtype, device=self.device,
                                          kv_cache_dtype=engine_config.kv_cache_dtype)[0]
        self.bm = BlockManager(num_blocks, self.block_size, enable_prefix_caching=False)
        self.max_pending = max(256, engine_config.max_num_batched_tokens or 0)
        self.states: dict[str, MtpSeq] = {}
        target_runner.hidden_observer = self.observe
        log.info("speculative decoding: the model's MTP head, KV pool of %d blocks", num_blocks)

    # ---- the target's rows -----------------------------------------------------------------------------------
    def observe(self, scheduled: list[ScheduledSeq], hidden: torch.Tensor) -> None:
        """After a target forward: keep each generating sequence's rows (see the module docstring)."""
        first, full = 0, []
        for s in scheduled:
            rows, first = hidden[first : first + s.num_tokens], first + s.num_tokens
            seq = s.seq
            if seq.embed is not None:
                continue
            st = self.states.get(seq.request_id)
            if st is None:
                st = self.states[seq.request_id] = MtpSeq(seq.num_computed_tokens)
            self._add_rows(st, seq.num_computed_tokens, rows.clone())
            if st.num_pending > self.max_pending:
                full.append((seq, st))
        taken, rows_taken = [], 0
        for seq, st in sorted(full, key=lambda item: -item[1].num_pending):
            if rows_taken >= self.max_pending:  # one forward of about a chunk: the rest wait for the next step
                break
            self._drop_guesses(st)  # this step verifies them; the engine's rollback follows
            taken.append((seq, st, seq.num_tokens - 2))  # positions whose next token is known: all but the newest
            rows_taken += st.num_pending
        if taken:
            self._catch_up(taken)

    def _add_rows(self, st: MtpSeq, start: int, rows: torch.Tensor) -> None:
        if start > st.hidden_from + st.num_pending:  # a gap: the head starts over there
            self._restart(st, start)
        elif start < st.hidden_from:  # positions the head took in, computed again: their rows are the ones it has
            rows, start = rows[st.hidden_from - start :], st.hidden_from
        st.keep_pending(start - st.hidden_from)  # rows from `start` on are replaced
        if rows.shape[0]:
            st.pending.append(rows)

    def _restart(self, st: MtpSeq, base: int) -> None:
        if st.block_ids:
            self.bm.free(st.block_ids)
        st.block_ids, st.base, st.exact, st.drafted, st.pending = [], base, 0, 0, []

    def _drop_guesses(self, st: MtpSeq) -> None:
        st.drafted = 0
        self.bm.rollback(st.block_ids, st.block_hashes, st.exact)

    # ---- the head's forward ----------------------------------------------------------------------------------
    def _forward(self, batch: list[tuple[MtpSeq, list[int], torch.Tensor, int]]) -> torch.Tensor:
        """batch: (state, next tokens, target/head rows, first head position). The head's output rows, in order."""
        ids: list[int] = []
        positions: list[int] = []
        query_lens, seq_lens, tables = [], [], []
        for st, tokens, _, start in batch:
            ids.extend(tokens)
            positions.extend(range(start, start + len(tokens)))
            query_lens.append(len(tokens))
            seq_lens.append(start + len(tokens))
            tables.append(st.block_ids)
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, self.block_size, device=self.device,
                                       backend=self.attention)
        hidden = torch.cat([rows for _, _, rows, _ in batch])
        return self.head(self.target, torch.tensor(ids, dtype=torch.long, device=self.device),
                         torch.tensor(positions, dtype=torch.long, device=self.device), hidden, self.kv_cache, meta)

    @torch.inference_mode()
    def _catch_up(self, items: list[tuple[Sequence, MtpSeq, int]]) -> dict[int, torch.Tensor]:
        """Take in each state's waiting rows up to target position `last` (inclusive; its next token is known).
        Returns, by id of the state, the head's output row at `last`."""
        batch = []
        for seq, st, last in items:
            n = min(last + 1 - st.hidden_from, st.num_pending)
            if n <= 0:
                continue
            if not self.bm.grow(st.block_ids, st.exact + n):
                self._restart(st, st.hidden_from + st.num_pending)  # no room: the head starts over after them
                continue
            rows = torch.cat(st.pending)
            batch.append((st, seq.token_ids[st.hidden_from + 1 : st.hidden_from + 1 + n], rows[:n], st.exact))
            st.pending = [rows[n:]] if rows.shape[0] > n else []
        if not batch:
            return {}
        out = self._forward(batch)
        ends, last_rows = 0, {}
        for st, tokens, _, _ in batch:
            ends += len(tokens)
            st.exact += len(tokens)
            last_rows[id(st)] = out[ends - 1 : ends]
        return last_rows

    # ---- proposing -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, wants: list[tuple[Sequence, int]], vocab: int) -> dict[str, tuple[list[int], torch.Tensor | None]]:
        """wants: (target sequence, k). Returns request_id -> (proposal, draft probs [k, V] or None if greedy)."""
        items, ks = [], {}
        for seq, k in wants:
            st = self.states.get(seq.request_id)
            last = seq.num_tokens - 2  # the target's rows reach the position before the newest token
            if st is None or not st.hidden_from <= last < st.hidden_from + st.num_pending:
                continue
            st.keep_pending(last + 1 - st.hidden_from)
            self._drop_guesses(st)  # a proposal dropped before verification
            if not self.bm.grow(st.block_ids, last + 1 - st.base + k - 1):
                continue
            items.append((seq, st, last))
            ks[id(st)] = k
        prev = self._catch_up(items)
        active: list[list[Any]] = [[seq, st, ks[id(st)], [], [], prev[id(st)]] for seq, st, _ in items if id(st) in prev]
        stepped: dict[str, int] = {}  # tokens each request's grammar stepped through
        try:
            while batch := [item for item in active if len(item[3]) < item[2]]:
                if batch[0][3]:  # a guess past the first: the head's own output stands in for the target's
                    out = self._forward([(st, [proposal[-1]], h, st.exact + st.drafted)
                                         for _, st, _, proposal, _, h in batch])
                    for i, item in enumerate(batch):
                        item[1].drafted += 1
                        item[5] = out[i : i + 1]
                logits = self.target.compute_logits(torch.cat([item[5] for item in batch]))
                for (seq, _st, _k, proposal, probs, _h), row in zip(batch, logits, strict=True):
                    if seq.grammar is not None:  # propose only what the grammar allows (the state follows)
                        step_masks([(seq.grammar, [])]).apply(row.unsqueeze(0))
                    token, p = sample_draft(row, ProposalView(seq, proposal), vocab)
                    proposal.append(token)
                    if p is not None:
                        probs.append(p)
                    if seq.grammar is not None and seq.grammar.step(token):
                        stepped[seq.request_id] = stepped.get(seq.request_id, 0) + 1
        finally:  # the grammar state is the output's again
            for seq, *_ in active:
                if stepped.get(seq.request_id):
                    seq.grammar.rollback(stepped[seq.request_id])
        return {seq.request_id: (proposal, torch.stack(probs) if probs else None)
                for seq, _, _, proposal, probs, _ in active}

    # ---- after verification, and bookkeeping -----------------------------------------------------------------
    def rollback(self, request_id: str, verified_tokens: list[int]) -> None:
        """The target verified a proposal: drop the guesses' KV and the rows of rejected positions (the target's KV
        now holds the verified tokens, so its rows up to position len - 1 are its own)."""
        st = self.states.get(request_id)
        if st is None:
            return
        self._drop_guesses(st)
        st.keep_pending(max(0, len(verified_tokens) - st.hidden_from))

    def release(self, request_id: str) -> None:
        st = self.states.pop(request_id, None)
        if st is not None and st.block_ids:
            self.bm.free(st.block_ids)
            st.block_ids = []
