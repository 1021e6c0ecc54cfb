"""Paged KV block allocation with a prefix cache.

The pool holds `num_blocks` blocks of `block_size` token slots. A block is in exactly one state:
  used     ref_count > 0 (held by one or more sequences; shared prefix blocks have ref_count > 1)
  cached   ref_count == 0 but its content is registered in the prefix cache; kept in LRU order, evicted only
           when a fresh block is needed and no plain free block is left
  free     ref_count == 0, no registered content

A full block's cache key is a chained hash of (parent key, the block's token ids, a per-model salt). A hash hit is
never trusted alone: the block's stored token ids must equal the lookup's, and the block's parent must be the block
matched just before it (checked by id and allocation generation), so a hash collision can only cost a miss.

Sliding windows. When every layer of the model attends within a window (`window`, the largest of them; Mistral),
a sequence no longer needs the blocks that lie wholly before the window of its next query: `drop_out_of_window`
releases them (a full block stays registered, so it turns cached and later requests can still hit it: its K/V are
those of every layer, untouched until the block is evicted). The sequence's block table keeps the dropped ids in
their places (`Sequence.num_dropped_blocks` says how many lead it): no attention path reads them, and a block id is
only ever read through a table from the window's first block on.

A model that mixes window and global layers (Gemma 2/3) has two KV groups, each a BlockManager over its own pool:
the global layers' (no window: a sequence keeps all its blocks) and the window layers' (window set: it keeps only
the window's). Each sequence has a block table in each (`Sequence.block_ids`, `Sequence.window_blocks`); the
scheduler reserves, preempts and frees in both at once. Both pools are keyed by the same chained hashes. A prefix hit
must have its blocks in both: the whole chain in the global group, and in the window group the blocks from the
hit's first needed block on (`lookup_blocks`); where the window group has already dropped and evicted those, the hit
is cut back to where it has them, so a hit never serves K/V that a window layer no longer holds.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Sequence as Seq

NO_PARENT = (-1, -1)


def block_hash(parent_hash: int | None, token_ids: tuple[int, ...], salt: str) -> int:
    """Cache key of one full block. Module-level so tests can force collisions by replacing it."""
    return hash((parent_hash, token_ids, salt))


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    generation: int = 0  # bumped on every (re)allocation, so stale parent links are detectable
    hash: int | None = None  # set while registered in the prefix cache
    token_ids: tuple[int, ...] | None = None
    parent: tuple[int, int] = NO_PARENT  # (block_id, generation) of the block before it in its sequence


@dataclass
class PrefixMatch:
    """Result of a side-effect-free prefix lookup."""

    block_ids: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, salt: str = "",
                 window: int | None = None):
        """window: set when every layer attends within a sliding window (the largest one): blocks before it are
        dropped from sequences (see the module docstring)."""
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        if window is not None and window < 1:
            raise ValueError("a sliding window is at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.window = window
        self.enable_prefix_caching = enable_prefix_caching
        self.salt = salt
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # LRU first
        self._cache: dict[int, int] = {}  # hash -> block id
        # counters
        self.queries_tokens = 0
        self.hits_tokens = 0
        self.evictions = 0

    # ---- accounting -------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (plain free plus evictable cached)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def lru_order(self) -> list[int]:
        """Evictable cached blocks, next to be evicted first."""
        return list(self._evictable)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- sliding window ---------------------------------------------------------------------------------------
    def first_needed_block(self, num_computed_tokens: int) -> int:
        """With a window: the first block the next query (at position num_computed_tokens) reads, or an earlier
        one: the block before the partial one is kept so that a block becoming full has its parent for the prefix
        cache's chain. Without a window: 0."""
        if self.window is None:
            return 0
        bs = self.block_size
        return max(0, min((num_computed_tokens - self.window + 1) // bs, num_computed_tokens // bs - 1))

    def max_blocks_held(self, num_tokens: int, chunk: int) -> int:
        """The most blocks a sequence of num_tokens tokens holds at once, computed in steps of at most `chunk`."""
        need = self.blocks_needed(num_tokens)
        if self.window is None:
            return need
        return min(need, (self.window + chunk + self.block_size - 2) // self.block_size + 2)

    def drop_out_of_window(self, block_ids: Seq[int], num_dropped: int, num_computed_tokens: int) -> int:
        """Release a sequence's blocks before `first_needed_block` (those after num_dropped); returns the new count
        of dropped leading blocks. The ids stay in block_ids (see the module docstring)."""
        first = min(self.first_needed_block(num_computed_tokens), len(block_ids))
        if first > num_dropped:
            self.free(block_ids[num_dropped:first])
            return first
        return num_dropped

    # ---- prefix cache -----------------------------------------------------------------------------------------
    def hash_chain(self, token_ids: Seq[int], num_blocks: int, start_hashes: Seq[int] = ()) -> list[int]:
        """Chained keys of the first `num_blocks` full blocks of token_ids, reusing already-known leading keys."""
        hashes = list(start_hashes[:num_blocks])
        bs = self.block_size
        for i in range(len(hashes), num_blocks):
            parent = hashes[-1] if hashes else None
            hashes.append(block_hash(parent, tuple(token_ids[i * bs : (i + 1) * bs]), self.salt))
        return hashes

    def match_prefix(self, token_ids: Seq[int], max_tokens: int) -> PrefixMatch:
        """Longest run of cached full blocks covering at most max_tokens of token_ids. Changes nothing."""
        match = PrefixMatch()
        if not self.enable_prefix_caching:
            return match
        bs = self.block_size
        parent = NO_PARENT
        for i, key in enumerate(self.hash_chain(token_ids, max_tokens // bs)):
            block_id = self._cache.get(key)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != tuple(token_ids[i * bs : (i + 1) * bs]) or block.parent != parent:
                break  # hash collision (or stale chain): treat as a miss
            match.block_ids.append(block_id)
            match.hashes.append(key)
            parent = (block_id, block.generation)
        return match

    def lookup_blocks(self, token_ids: Seq[int], hashes: Seq[int], first: int) -> list[int] | None:
        """The cached blocks for blocks first .. first + len(hashes) - 1 of token_ids (their chained keys), each
        checked by its tokens and, after the first, by its parent link; None unless every one is there. Changes
        nothing. (A window group's hit: the blocks before `first` are not needed.)"""
        if not self.enable_prefix_caching:
            return None if hashes else []
        bs = self.block_size
        ids: list[int] = []
        parent: tuple[int, int] | None = None
        for i, key in enumerate(hashes, start=first):
            block_id = self._cache.get(key)
            if block_id is None:
                return None
            block = self.blocks[block_id]
            if block.token_ids != tuple(token_ids[i * bs : (i + 1) * bs]) or (parent is not None
                                                                             and block.parent != parent):
                return None
            ids.append(block_id)
            parent = (block_id, block.generation)
        return ids

    def record_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.queries_tokens += num_query_tokens
        self.hits_tokens += num_hit_tokens

    def num_evictable_in(self, block_ids: Seq[int]) -> int:
        """How many of these blocks would leave the evictable pool if claimed."""
        return sum(1 for b in block_ids if b in self._evictable)

    def claim(self, block_ids: Seq[int]) -> None:
        """Take a reference on cached blocks returned by match_prefix."""
        for b in block_ids:
            block = self.blocks[b]
            if block.ref_count == 0:
                self._evictable.pop(b, None)
            block.ref_count += 1

    def register_full_blocks(
        self, block_ids: Seq[int], hashes: list[int], token_ids: Seq[int], num_computed_tokens: int
    ) -> None:
        """Register each newly full and computed block of a sequence in the prefix cache.

        `hashes` is the sequence's list of keys for its already registered (or already hashed) blocks; it is
        extended in place. A block whose content is already cached under another block stays unregistered.
        """
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(num_computed_tokens // bs, len(block_ids))
        if num_full <= len(hashes):
            return
        start = len(hashes)
        hashes[:] = self.hash_chain(token_ids, num_full, hashes)
        for i in range(start, num_full):
            block = self.blocks[block_ids[i]]
            if block.hash is not None or hashes[i] in self._cache:
                continue
            prev = self.blocks[block_ids[i - 1]] if i > 0 else None
            block.hash = hashes[i]
            block.token_ids = tuple(token_ids[i * bs : (i + 1) * bs])
            block.parent = (prev.block_id, prev.generation) if prev is not None else NO_PARENT
            self._cache[hashes[i]] = block.block_id

    # ---- allocation -------------------------------------------------------------------------------------------
    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free_blocks

    def grow(self, block_ids: list[int], num_tokens: int) -> bool:
        """Extend block_ids in place to hold num_tokens from free blocks; False (nothing taken) when too few are
        free. The drafts' reservations: they never preempt."""
        need = self.blocks_needed(num_tokens) - len(block_ids)
        if need > 0 and not self.can_allocate(need):
            return False
        if need > 0:
            block_ids.extend(self.allocate(need))
        return True

    def allocate(self, n: int) -> list[int]:
        """Hand out n blocks with ref_count 1: plain free ones first, then evict least recently used cached ones."""
        if n > self.num_free_blocks:
            raise RuntimeError(f"KV pool exhausted: asked for {n} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            if self._free:
                block = self.blocks[self._free.popleft()]
            else:
                block_id, _ = self._evictable.popitem(last=False)
                block = self.blocks[block_id]
                self._uncache(block)
                self.evictions += 1
            block.generation += 1
            block.ref_count = 1
            out.append(block.block_id)
        return out

    def free(self, block_ids: Seq[int]) -> None:
        """Drop one reference on each block. Freed in reverse so a sequence's tail is evicted before its head."""
        for b in reversed(block_ids):
            block = self.blocks[b]
            if block.ref_count <= 0:
                raise RuntimeError(f"double free of KV block {b}")
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is not None:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    def free_trailing(self, block_ids: list[int], keep: int) -> None:
        """Release the blocks after the first `keep` (e.g. rolled-back speculative slots); edits block_ids."""
        if keep < len(block_ids):
            tail = block_ids[keep:]
            del block_ids[keep:]
            self.free(tail)

    def rollback(self, block_ids: list[int], hashes: list[int], num_tokens: int) -> None:
        """Shrink a sequence's KV to its first num_tokens (speculative tokens rejected): free the blocks past them
        and unregister any kept block that was full but will now be partly overwritten. Edits both lists."""
        keep_full = num_tokens // self.block_size
        for b in block_ids[keep_full : self.blocks_needed(num_tokens)]:
            block = self.blocks[b]
            if block.hash is not None and block.ref_count == 1:
                self._uncache(block)
        del hashes[keep_full:]
        self.free_trailing(block_ids, self.blocks_needed(num_tokens))

    def touch(self, block_ids: Seq[int]) -> None:
        """Mark evictable blocks as recently used (moves them to the LRU tail)."""
        for b in block_ids:
            if b in self._evictable:
                self._evictable.move_to_end(b)

    def _uncache(self, block: Block) -> None:
        if block.hash is not None and self._cache.get(block.hash) == block.block_id:
            del self._cache[block.hash]
        block.hash = None
        block.token_ids = None
        block.parent = NO_PARENT

    def reset_prefix_cache(self) -> None:
        """Forget every evictable cached block (used blocks keep their registration)."""
        while self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            self._uncache(self.blocks[block_id])
            self._free.append(block_id)

    def check_idle(self) -> None:
        """Assert the no-leak invariant: with no sequences alive every block is free or evictable cached."""
        used = [b.block_id for b in self.blocks if b.ref_count != 0]
        if used:
            raise AssertionError(f"leaked KV blocks: {used[:20]} (of {len(used)})")
        if len(self._free) + len(self._evictable) != self.num_blocks:
            raise AssertionError("free lists out of sync with block states")
