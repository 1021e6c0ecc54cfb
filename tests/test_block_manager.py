"""Block manager units: hash chain, collisions caught by the token check, LRU eviction order, shared-prefix refcounts."""

import pytest

from llmd.engine import block_manager as bm_mod
from llmd.engine.block_manager import BlockManager

BS = 4


def fill(bm: BlockManager, tokens: list[int]) -> tuple[list[int], list[int]]:
    """Simulate a sequence that computed `tokens` from scratch: allocate, then register its full blocks."""
    blocks = bm.allocate(bm.blocks_needed(len(tokens)))
    hashes: list[int] = []
    bm.register_full_blocks(blocks, hashes, tokens, len(tokens))
    return blocks, hashes


def test_hash_chain_depends_on_parent_and_salt():
    bm = BlockManager(8, BS, salt="m1")
    a = bm.hash_chain([1, 2, 3, 4, 5, 6, 7, 8], 2)
    b = bm.hash_chain([9, 9, 9, 9, 5, 6, 7, 8], 2)
    assert a[0] != b[0]
    assert a[1] != b[1], "same block tokens under a different parent must hash differently"
    assert BlockManager(8, BS, salt="m2").hash_chain([1, 2, 3, 4], 1) != a[:1]
    assert bm.hash_chain([1, 2, 3, 4, 5, 6, 7, 8], 2, start_hashes=a[:1]) == a


def test_prefix_hit_shares_blocks_and_counts_refs():
    bm = BlockManager(8, BS)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    blocks, _ = fill(bm, prompt)
    assert bm.num_used_blocks == 3
    match = bm.match_prefix(prompt[:8] + [99, 98], max_tokens=9)
    assert match.block_ids == blocks[:2]
    bm.claim(match.block_ids)
    assert [bm.blocks[b].ref_count for b in blocks] == [2, 2, 1]
    bm.free(blocks)
    assert [bm.blocks[b].ref_count for b in blocks] == [1, 1, 0]
    assert bm.num_cached_blocks == 0, "shared blocks are still in use"
    bm.free(match.block_ids)
    assert bm.num_cached_blocks == 2 and bm.num_used_blocks == 0
    bm.check_idle()
    # max_tokens limits the match to whole blocks within it
    assert bm.match_prefix(prompt, max_tokens=7).block_ids == blocks[:1]


def test_collision_is_caught_by_token_check(monkeypatch):
    monkeypatch.setattr(bm_mod, "block_hash", lambda parent, tokens, salt: 42)
    bm = BlockManager(8, BS)
    blocks, _ = fill(bm, [1, 2, 3, 4])
    bm.free(blocks)
    assert bm.match_prefix([1, 2, 3, 4, 0], 4).block_ids == blocks
    assert bm.match_prefix([5, 6, 7, 8, 0], 4).block_ids == [], "same hash, other tokens: must miss"
    # a second-level block with equal tokens but a different parent must not be served either
    a, _ = fill(bm, [1, 2, 3, 4, 5, 6, 7, 8])
    bm.free(a)
    assert bm.match_prefix([9, 9, 9, 9, 5, 6, 7, 8, 0], 8).block_ids == []


def test_stale_child_after_parent_eviction_is_not_served(monkeypatch):
    bm = BlockManager(3, BS)
    a, _ = fill(bm, [1, 2, 3, 4, 5, 6, 7, 8])
    bm.free(a)  # both cached; tail first in LRU so the child goes before its parent
    assert bm.lru_order() == [a[1], a[0]]
    # force the parent's eviction and reuse with other content
    monkeypatch.setattr(bm_mod, "block_hash", lambda parent, tokens, salt: hash(tokens))  # parent-blind hash
    bm._evictable.move_to_end(a[1])
    x = bm.allocate(2)
    assert a[0] in x
    bm.register_full_blocks(x[:1] if x[0] == a[0] else x[1:], [], [1, 2, 3, 4], 4)
    # the child still claims tokens 5..8 after a block with tokens 1..4, but its parent was reallocated
    m = bm.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 0], 8)
    assert a[1] not in m.block_ids
    bm.free(x)


def test_lru_eviction_order_and_counter():
    bm = BlockManager(4, BS)
    a, _ = fill(bm, [1, 1, 1, 1])
    b, _ = fill(bm, [2, 2, 2, 2])
    bm.free(a)
    bm.free(b)
    assert bm.lru_order() == [a[0], b[0]]
    bm.touch(a)  # a used again recently
    assert bm.lru_order() == [b[0], a[0]]
    got = bm.allocate(2)  # the two plain free blocks go first, nothing evicted
    assert bm.evictions == 0 and set(got).isdisjoint(a + b)
    got2 = bm.allocate(1)
    assert got2 == b and bm.evictions == 1
    assert bm.match_prefix([2, 2, 2, 2, 0], 4).block_ids == [], "evicted content is gone"
    assert bm.match_prefix([1, 1, 1, 1, 0], 4).block_ids == a
    bm.free(got + got2)
    bm.check_idle()


def test_duplicate_content_is_not_registered_twice():
    bm = BlockManager(4, BS)
    a, _ = fill(bm, [7, 7, 7, 7])
    b, _ = fill(bm, [7, 7, 7, 7])
    bm.free(a)
    bm.free(b)
    assert bm.num_cached_blocks == 1 and bm.num_free_blocks == 4


def test_double_free_and_exhaustion_are_errors():
    bm = BlockManager(2, BS)
    x = bm.allocate(2)
    with pytest.raises(RuntimeError, match="exhausted"):
        bm.allocate(1)
    bm.free(x)
    with pytest.raises(RuntimeError, match="double free"):
        bm.free(x[:1])


def test_free_trailing_releases_only_the_tail():
    bm = BlockManager(6, BS)
    blocks = bm.allocate(5)
    table = list(blocks)
    bm.free_trailing(table, 2)
    assert table == blocks[:2] and bm.num_used_blocks == 2
    bm.free(table)
    bm.check_idle()


def test_disabled_cache_never_hits():
    bm = BlockManager(4, BS, enable_prefix_caching=False)
    a, _ = fill(bm, [1, 2, 3, 4])
    bm.free(a)
    assert bm.match_prefix([1, 2, 3, 4, 5], 4).block_ids == []
    assert bm.num_cached_blocks == 0


def test_rollback_frees_tail_and_unregisters_rewritten_block():
    bm = BlockManager(8, BS)
    tokens = list(range(1, 11))  # 2 full blocks + 2
    blocks, hashes = fill(bm, tokens)
    assert len(hashes) == 2
    table = list(blocks)
    bm.rollback(table, hashes, 6)  # keep 6 tokens: block 0 full, block 1 partly kept (to be overwritten)
    assert table == blocks[:2] and hashes == hashes[:1] and len(hashes) == 1
    assert bm.blocks[blocks[1]].hash is None, "a block that will be rewritten must leave the cache"
    assert bm.match_prefix(tokens, 9).block_ids == blocks[:1]
    bm.free(table)
    bm.check_idle()


# ---- sliding windows -------------------------------------------------------------------------------------------
def test_window_drops_passed_blocks_and_keeps_them_cached():
    """Window 6, blocks of 4: after 14 tokens the next query (position 14) reads from position 9 (block 2), so
    blocks 0 and 1 are dropped; being full and registered they turn cached (their K/V stay valid for a later hit)."""
    bm = BlockManager(8, BS, window=6)
    assert [bm.first_needed_block(n) for n in (0, 4, 8, 9, 13, 14, 16)] == [0, 0, 0, 1, 2, 2, 2]
    tokens = list(range(14))
    blocks, hashes = fill(bm, tokens)
    dropped = bm.drop_out_of_window(blocks, 0, 14)
    assert dropped == 2 and [bm.blocks[b].ref_count for b in blocks] == [0, 0, 1, 1]
    assert bm.num_cached_blocks == 2  # full and registered: still a prefix-cache hit for a later request
    assert bm.match_prefix(tokens + [1], 14).block_ids == blocks[:3]
    assert bm.drop_out_of_window(blocks, dropped, 14) == 2  # nothing more to release
    bm.free(blocks[dropped:])
    bm.check_idle()


def test_window_smaller_than_a_block_keeps_the_parent_of_the_next_full_block():
    bm = BlockManager(8, BS, window=1)
    assert bm.first_needed_block(9) == 1  # position 9 alone is read (block 2), but block 1 stays: block 2's parent
    assert bm.first_needed_block(12) == 2  # position 12 (block 3) is read; block 2 stays as block 3's parent


def test_max_blocks_held_is_the_window_plus_a_chunk():
    assert BlockManager(64, BS).max_blocks_held(100, 8) == 25
    assert BlockManager(64, BS, window=16).max_blocks_held(100, 8) == (16 + 8 + 2) // 4 + 2
    assert BlockManager(64, BS, window=16).max_blocks_held(6, 8) == 2


def test_lookup_blocks_checks_tokens_and_links():
    """A window group's hit: blocks first..n-1 by their chained keys; any missing or mismatched one fails it."""
    bm = BlockManager(8, BS, window=8)
    tokens = list(range(16))
    blocks, hashes = fill(bm, tokens)
    assert bm.lookup_blocks(tokens, hashes[2:4], 2) == blocks[2:4]
    assert bm.lookup_blocks(tokens, [], 4) == []
    other = tokens[:8] + [99] + tokens[9:]
    assert bm.lookup_blocks(other, hashes[2:4], 2) is None  # a block's tokens differ
    bm._uncache(bm.blocks[blocks[3]])
    assert bm.lookup_blocks(tokens, hashes[2:4], 2) is None
    bm.free(blocks)
