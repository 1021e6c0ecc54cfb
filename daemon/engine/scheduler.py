"""Continuous-batching scheduler: picks, every step, which tokens of which sequences go into one forward.

Order within a step, under the token budget `max_num_batched_tokens`:
  1. running sequences that decode (one token each), interactive before batch, oldest first;
  2. running sequences still prefilling (their next chunk);
  3. waiting sequences, admitted head-first (interactive queue before batch queue, FCFS within each) while there
     is budget, a free sequence slot, and KV blocks for the whole prompt (reserved at admission, so admitted
     prompts never stall mid-prefill for lack of blocks).
With a sliding window over every layer (BlockManager.window), a sequence holds only the blocks its window still
reaches: admission reserves its first chunk's blocks, each later chunk reserves its own as it is scheduled (a
sequence's peak is then its window plus one chunk, not its whole prompt), and the engine drops the blocks the
window has passed after every step. A model that mixes window and global layers has a second KV group, the window
layers' (`window_bm`): every reservation, preemption and release covers both, and a prefix hit is cut back to where
both groups hold its blocks (llmd.engine.block_manager).
When a running sequence needs a new block and none is free, the lowest-priority, newest running sequence is
preempted by recompute: its blocks are freed (full ones stay in the prefix cache, which makes recompute cheap) and
it goes back to the head of its waiting queue.

A hybrid model's recurrent layers keep a state per sequence (`state_pool`, llmd.engine.state_pool): admission
takes a slot, finishing or preemption gives it back, and at most the pool's slots run at once. A prefix hit must
restore a state too: it is cut back to the newest checkpoint at or before its end (`_state_hit`), and a prompt's
prefill chunks end at the checkpoint positions (`state_boundary`) so that the engine can save the state there.

Speculation is part of the plan: after the decodes have their one slot each (and before prefill chunks spend the
budget), a `Proposer` (engine/speculative.py) may guess k tokens for some of them. A guess gets KV slots only from
free blocks or the ones its sequence already holds (`_reserve(..., may_preempt=False)`): nobody is preempted for a
guess. The step's ScheduledSeq then carries the proposal (`spec`), and the engine verifies it in the same forward.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from .block_manager import BlockManager, PrefixMatch
from .sequence import BlockTable, Sequence, SeqStatus
from .state_pool import StatePool
from .types import Priority

if TYPE_CHECKING:
    import torch


@dataclass
class Proposal:
    """A speculative guess of the next tokens of one decoding sequence."""

    tokens: list[int]
    draft_probs: "torch.Tensor | None" = None  # [k, V] for sampled requests with a draft model; None = point mass


class Proposer(Protocol):
    def propose(self, decodes: list[Sequence], budget: int, load: int) -> dict[str, Proposal]:
        """Proposals (by request id, at most `budget` tokens in all) for decodes that have their slot this step;
        load: the requests in the engine (running and waiting)."""


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens of seq.token_ids[num_computed_tokens:] processed this step
    spec: list[int] = field(default_factory=list)  # proposed tokens fed after them (a decode), verified this step
    draft_probs: "torch.Tensor | None" = None  # the proposal's draft distributions [k, V]; None = point mass
    hidden: "torch.Tensor | None" = None  # an embedding chunk's final hidden states [n, hidden], set by the runner
    state_backup: int | None = None  # a hybrid's verify: the slot holding its state before the step (the runner's)

    @property
    def completes(self) -> bool:
        """Whether this chunk reaches the end of the token list."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens

    @property
    def samples(self) -> bool:
        """Whether the step yields a new token for this chunk (it completes the list of a generating sequence)."""
        return self.seq.embed is None and self.completes

    @property
    def pools(self) -> bool:
        """Whether the forward's hidden states of this chunk are kept: an embedding request's chunk."""
        return self.seq.embed is not None

    @property
    def num_tokens(self) -> int:
        """Positions this step's forward runs for the sequence: its new tokens plus the proposal."""
        return self.num_new_tokens + len(self.spec)

    @property
    def num_logits(self) -> int:
        """Trailing positions whose logits are needed when the chunk samples: 1 + k to verify k proposals."""
        return 1 + len(self.spec)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 proposer: Proposer | None = None, window_bm: BlockManager | None = None,
                 state_pool: StatePool | None = None, checkpoint_interval: int = 0, max_verifies: int | None = None):
        self.bm = block_manager
        self.wbm = window_bm  # the window layers' KV group, in a model that mixes window and global layers
        self.proposer = proposer
        self.states = state_pool  # a hybrid model's recurrent state slots
        # tokens between a prompt's state checkpoints (a multiple of the block size; 0: only the prompt's last block)
        self.checkpoint_interval = checkpoint_interval
        self.max_verifies = max_verifies  # proposals verified per step at most (a hybrid's state backups); None: any
        if state_pool is not None:
            max_num_seqs = min(max_num_seqs, state_pool.num_slots)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: dict[Priority, deque[Sequence]] = {p: deque() for p in Priority}
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # ---- queue management -------------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self.waiting.values())

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def free_slots(self) -> int:
        """Running places left (max_num_seqs): requests added now take these before any of them has to wait."""
        return max(0, self.max_num_seqs - len(self.running))

    def has_work(self) -> bool:
        return bool(self.running) or self.num_waiting > 0

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting[seq.priority].append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of whatever queue it is in and release its blocks."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            try:
                self.waiting[seq.priority].remove(seq)
            except ValueError:
                pass
        self.release(seq)
        seq.status = SeqStatus.FINISHED

    def release(self, seq: Sequence) -> None:
        if seq.block_ids:
            self.bm.free(seq.block_ids[seq.num_dropped_blocks :])
        seq.block_ids = []
        seq.num_dropped_blocks = 0
        if self.wbm is not None and seq.window_blocks.ids:
            self.wbm.free(seq.window_blocks.held)
        seq.window_blocks = BlockTable()
        if seq.state_slot is not None:
            self.states.free(seq.state_slot)
            seq.state_slot = None

    def drop_out_of_window(self, seq: Sequence) -> None:
        """Release the blocks of seq that its sliding windows have passed (none without a window)."""
        if self.bm.window is not None and seq.block_ids:
            seq.num_dropped_blocks = self.bm.drop_out_of_window(seq.block_ids, seq.num_dropped_blocks,
                                                                seq.num_computed_tokens)
        w = seq.window_blocks
        if self.wbm is not None and w.ids:
            w.num_dropped = self.wbm.drop_out_of_window(w.ids, w.num_dropped, seq.num_computed_tokens)

    def _needs(self, seq: Sequence, num_tokens: int) -> tuple[int, int]:
        """Blocks seq lacks to cover num_tokens, in the global group and in the window group."""
        need = self.bm.blocks_needed(num_tokens) - len(seq.block_ids)
        if self.wbm is None:
            return need, 0
        return need, self.wbm.blocks_needed(num_tokens) - len(seq.window_blocks.ids)

    def _fits(self, needs: tuple[int, int]) -> bool:
        need, wneed = needs
        return (need <= 0 or self.bm.can_allocate(need)) and (wneed <= 0 or self.wbm.can_allocate(wneed))

    def _slots_held(self, seq: Sequence) -> int:
        """Token positions seq's block tables cover (the shorter table, in a model with two KV groups)."""
        n = len(seq.block_ids)
        if self.wbm is not None:
            n = min(n, len(seq.window_blocks.ids))
        return n * self.bm.block_size

    # ---- scheduling -------------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        load = len(self.running) + self.num_waiting
        self.running.sort(key=lambda s: s.sort_key)
        decodes = [s for s in self.running if not s.is_prefilling]
        prefills = [s for s in self.running if s.is_prefilling]
        scheduled: set[int] = set()
        budget = self._schedule_running(decodes, budget, out, scheduled)
        if self.proposer is not None and budget > 0:
            budget = self._add_proposals(out, budget, load)
        budget = self._schedule_running(prefills, budget, out, scheduled)
        if not out.preempted:  # admitting right after preempting would only thrash
            budget = self._admit(out, budget)
        return out

    def _schedule_running(self, seqs: list[Sequence], budget: int, out: SchedulerOutput, scheduled: set[int]) -> int:
        for seq in seqs:
            if budget <= 0:
                break
            if seq.status is not SeqStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = self._chunk(seq, budget)
            if not self._reserve(seq, seq.num_computed_tokens + n, out, scheduled):
                continue  # seq itself was preempted
            out.scheduled.append(ScheduledSeq(seq, n))
            scheduled.add(id(seq))
            budget -= n
        return budget

    def _add_proposals(self, out: SchedulerOutput, budget: int, load: int) -> int:
        """Ask the proposer for guesses for this step's decodes and give each the KV slots it can have for free."""
        decodes = [s for s in out.scheduled if s.num_new_tokens == 1 and s.samples]
        if not decodes:
            return budget
        proposals = self.proposer.propose([s.seq for s in decodes], budget, load)
        verifies = 0
        for s in decodes:
            prop = proposals.get(s.seq.request_id)
            if prop is None or budget <= 0 or verifies == self.max_verifies:
                continue
            seq = s.seq
            k = min(len(prop.tokens), budget)
            if not self._reserve(seq, seq.num_computed_tokens + 1 + k, out, set(), may_preempt=False):
                k = min(k, self._slots_held(seq) - seq.num_computed_tokens - 1)
            if k <= 0:
                continue
            s.spec = prop.tokens[:k]
            s.draft_probs = None if prop.draft_probs is None else prop.draft_probs[:k]
            budget -= k
            verifies += 1
        return budget

    def _reserve(self, seq: Sequence, num_tokens: int, out: SchedulerOutput, scheduled: set[int],
                 may_preempt: bool = True) -> bool:
        """Make seq's block table cover num_tokens, preempting newer/lower-priority sequences if needed.

        Victims come from the end of `running` (sorted: lowest priority, newest last), skipping sequences already
        scheduled in this step; when none is left, seq itself is preempted. With may_preempt=False (a speculative
        guess) nothing is preempted: False when the free blocks do not suffice.
        """
        needs = self._needs(seq, num_tokens)
        if not may_preempt and not self._fits(needs):
            return False
        while not self._fits(needs):
            victim = next((s for s in reversed(self.running) if id(s) not in scheduled), seq)
            self._preempt(victim, out)
            if victim is seq:
                return False
        need, wneed = needs
        if need > 0:
            seq.block_ids.extend(self.bm.allocate(need))
        if wneed > 0:
            seq.window_blocks.ids.extend(self.wbm.allocate(wneed))
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.release(seq)
        seq.reset_for_recompute()
        seq.timings.num_preemptions += 1
        self.waiting[seq.priority].appendleft(seq)
        self.num_preemptions += 1
        out.preempted.append(seq)

    def _admit(self, out: SchedulerOutput, budget: int) -> int:
        for prio in Priority:
            queue = self.waiting[prio]
            while queue and budget > 0 and len(self.running) < self.max_num_seqs:
                seq = queue[0]
                if not self._allocate_for_admission(seq, budget):
                    return budget  # head-of-line waits for blocks: FCFS, no overtaking
                queue.popleft()
                seq.status = SeqStatus.RUNNING
                self.running.append(seq)
                n = self._chunk(seq, budget)
                out.scheduled.append(ScheduledSeq(seq, n))
                budget -= n
        return budget

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens of seq to compute this step: what is left, within the budget, ending at a state checkpoint."""
        done = seq.num_computed_tokens
        n = min(seq.num_uncomputed, budget)
        boundary = self.state_boundary(seq) if self.states is not None else None
        if boundary is not None:
            n = min(n, boundary - done)
        image = seq.bidirectional_span(done + n) if seq.images else None
        if image is not None and image.start < done + n:  # never split an image whose tokens see each other
            n = image.start - done if image.start > done else image.end - done
        return n

    def state_boundary(self, seq: Sequence) -> int | None:
        """The next position after seq's computed tokens where its state is checkpointed for the prefix cache
        (None: none left): every checkpoint_interval tokens of the prompt, and the last block boundary before its
        last token (where a longer prompt sharing this one, such as the next turn of a chat, would hit)."""
        if self.states is None or self.states.num_checkpoints == 0 or seq.embed is not None:
            return None
        bs, done = self.bm.block_size, seq.num_computed_tokens
        last = (seq.num_prompt_tokens - 1) // bs * bs
        if done >= last:
            return None
        step = self.checkpoint_interval
        nxt = (done // step + 1) * step if step else last
        return min(nxt, last)

    def is_state_boundary(self, seq: Sequence) -> bool:
        """Whether seq's computed tokens end at a checkpoint position (its state there is worth saving)."""
        done, bs = seq.num_computed_tokens, self.bm.block_size
        if self.states is None or self.states.num_checkpoints == 0 or seq.embed is not None or done == 0 \
                or done % bs:
            return False
        last = (seq.num_prompt_tokens - 1) // bs * bs
        return done == last or (done < last and self.checkpoint_interval > 0 and done % self.checkpoint_interval == 0)

    def _state_hit(self, match: PrefixMatch) -> PrefixMatch:
        """Cut a KV hit back to its longest prefix whose recurrent state is checkpointed. Changes nothing."""
        for n in range(match.num_blocks, 0, -1):
            if self.states.checkpoint(match.hashes[n - 1]) is not None:
                return PrefixMatch(match.block_ids[:n], match.hashes[:n])
        return PrefixMatch()

    def _allocate_for_admission(self, seq: Sequence, budget: int) -> bool:
        """Reuse cached prefix blocks and reserve blocks for every remaining token of seq (with a sliding window:
        for its first chunk of at most `budget` tokens, and none of the hit's blocks the window has passed)."""
        bm, wbm = self.bm, self.wbm
        # Leave at least one token to compute: its forward yields the logits of the next token. An embedding
        # request computes every position (mean pooling needs them all), so it takes nothing from the cache.
        match = bm.match_prefix(seq.key_ids, seq.num_tokens - 1) if seq.embed is None else PrefixMatch()
        window = BlockTable()
        if wbm is not None:
            match, window = self._window_hit(seq, match)
        if self.states is not None and match.num_blocks:
            match = self._state_hit(match)
        computed = match.num_blocks * bm.block_size
        windowed = bm.window is not None or wbm is not None
        reach = min(seq.num_tokens, computed + budget) if windowed else seq.num_tokens
        dropped = bm.first_needed_block(computed)
        held = match.block_ids[dropped:]  # the hit's blocks the sequence reads
        fresh = bm.blocks_needed(reach) - match.num_blocks
        if fresh > bm.num_free_blocks - bm.num_evictable_in(held):
            return False
        if wbm is not None:
            wfresh = wbm.blocks_needed(reach) - match.num_blocks
            if wfresh > wbm.num_free_blocks - wbm.num_evictable_in(window.held):
                return False
            wbm.claim(window.held)
            window.ids += wbm.allocate(wfresh)
            seq.window_blocks = window
        bm.claim(held)
        if self.states is not None:
            seq.state_slot = self.states.allocate()
            seq.restore_from = self.states.use_checkpoint(match.hashes[-1]) if match.num_blocks else None
        seq.block_ids = match.block_ids + bm.allocate(fresh)
        seq.num_dropped_blocks = dropped
        seq.block_hashes = list(match.hashes)
        seq.num_computed_tokens = computed
        if seq.embed is None:
            bm.record_query(seq.num_tokens, seq.num_computed_tokens)
        if not seq.admitted_once:
            seq.timings.num_cached_tokens = seq.num_computed_tokens
            seq.admitted_once = True
        return True

    def _window_hit(self, seq: Sequence, match: PrefixMatch) -> tuple[PrefixMatch, BlockTable]:
        """Cut a global-group hit back to its longest prefix whose window-group blocks (from the first one its
        window reads) are all still cached; returns that hit and the window group's table for it (the blocks
        before the window as placeholders: never read)."""
        wbm = self.wbm
        for n in range(match.num_blocks, 0, -1):
            first = wbm.first_needed_block(n * wbm.block_size)
            ids = wbm.lookup_blocks(seq.key_ids, match.hashes[first:n], first)
            if ids is not None:
                hit = PrefixMatch(match.block_ids[:n], match.hashes[:n])
                return hit, BlockTable([0] * first + ids, first, list(match.hashes[:n]))
        return PrefixMatch(), BlockTable()
