"""The state slots of a hybrid model's recurrent layers (llmd.model.recurrent), beside the paged KV blocks.

A recurrent layer keeps one fixed-size state per sequence instead of K/V per token. The runner allocates the states
of `num_slots` sequences plus `num_checkpoints` prefix-cache checkpoints (plus one scratch slot, for padding rows);
this pool says which slot is whose:

  sequence slots   one per running sequence, taken at admission and given back when it finishes or is preempted
                   (preemption recomputes, as for KV). The scheduler runs at most num_slots sequences at once.
  checkpoints      the state of a prefix, saved when a prompt's prefill reaches a checkpoint position (a block
                   boundary: see Scheduler.state_boundary) and keyed by the chained hash of the prefix's last block,
                   as KV blocks are. A prefix hit restores the newest checkpoint at or before the hit's end (the KV
                   blocks up to there hit as usual) and recomputes from there. Kept in LRU order, the oldest evicted
                   when a new one needs its slot; a checkpoint whose KV blocks were evicted simply stops matching (the
                   lookup needs both).
"""

from __future__ import annotations

from collections import OrderedDict, deque


class StatePool:
    def __init__(self, num_slots: int, num_checkpoints: int = 0):
        if num_slots < 1:
            raise ValueError("the state pool needs at least one sequence slot")
        self.num_slots = num_slots
        self.num_checkpoints = num_checkpoints
        self._free: deque[int] = deque(range(num_slots))
        self._checkpoints: OrderedDict[int, int] = OrderedDict()  # prefix hash -> slot, LRU first
        self._free_checkpoints: deque[int] = deque(range(num_slots, num_slots + num_checkpoints))
        self.checkpoints_saved = 0
        self.checkpoint_hits = 0

    @property
    def scratch_slot(self) -> int:
        """The slot padding rows read and write (never handed out)."""
        return self.num_slots + self.num_checkpoints

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._checkpoints)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("state pool exhausted: more running sequences than slots")
        return self._free.popleft()

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise RuntimeError(f"double free of state slot {slot}")
        self._free.append(slot)

    # ---- prefix checkpoints -----------------------------------------------------------------------------------
    def checkpoint(self, prefix_hash: int) -> int | None:
        """The slot holding the state after the prefix whose last block has this key (None: not cached)."""
        return self._checkpoints.get(prefix_hash)

    def use_checkpoint(self, prefix_hash: int) -> int:
        """A hit: the checkpoint's slot, now the most recently used."""
        self._checkpoints.move_to_end(prefix_hash)
        self.checkpoint_hits += 1
        return self._checkpoints[prefix_hash]

    def slot_for_checkpoint(self, prefix_hash: int) -> int | None:
        """The slot to save the state of this prefix into (the oldest checkpoint's, when none is free); None when
        it is already saved or there are no checkpoint slots."""
        if self.num_checkpoints == 0 or prefix_hash in self._checkpoints:
            return None
        if self._free_checkpoints:
            slot = self._free_checkpoints.popleft()
        else:
            _, slot = self._checkpoints.popitem(last=False)
        self._checkpoints[prefix_hash] = slot
        self.checkpoints_saved += 1
        return slot

    def reset_checkpoints(self) -> None:
        while self._checkpoints:
            _, slot = self._checkpoints.popitem(last=False)
            self._free_checkpoints.append(slot)

    def check_idle(self) -> None:
        """Assert the no-leak invariant: with no sequences alive every sequence slot is free."""
        if len(self._free) != self.num_slots:
            held = sorted(set(range(self.num_slots)) - set(self._free))
            raise AssertionError(f"leaked state slots: {held[:20]} (of {len(held)})")
