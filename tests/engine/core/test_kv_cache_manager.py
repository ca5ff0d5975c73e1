"""Tests of the KV cache block manager and its block pool (pure Python, fast)."""

from __future__ import annotations

import pytest

from baton.engine.core.block_pool import NULL_BLOCK_ID, BlockPool
from baton.engine.core.kv_cache_manager import KVCacheManager, hash_block_tokens

BS = 4


def make(num_blocks: int = 11, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, enable_prefix_caching=caching)


def admit(kv: KVCacheManager, rid: str, tokens: list[int], extra: int = 0) -> tuple[int, list[int]]:
    """Lookup + first allocation for the whole prompt; caches the prompt's full blocks."""
    hit = kv.get_computed_blocks(rid, tokens)
    new = kv.allocate_slots(rid, len(tokens) + extra, hit)
    assert new is not None
    kv.cache_blocks(rid, tokens, len(tokens))
    return hit, new


# --- construction and accounting ------------------------------------------------------


@pytest.mark.parametrize(
    ("num_blocks", "block_size"), [(1, 4), (0, 4), (8, 0), (8, -1), (True, 4), (8, 2.0)]
)
def test_bad_sizes_raise(num_blocks: object, block_size: object) -> None:
    with pytest.raises(ValueError):
        KVCacheManager(num_blocks, block_size)  # type: ignore[arg-type]


def test_fresh_manager_reserves_null_block() -> None:
    kv = make(11)
    assert kv.num_blocks == 11 and kv.block_size == BS
    assert kv.num_free_blocks == 10
    assert kv.num_used_blocks == 0 and kv.usage == 0.0
    ids = kv.allocate_slots("a", 10 * BS)
    assert ids is not None and sorted(ids) == list(range(1, 11))
    assert NULL_BLOCK_ID not in ids
    assert kv.usage == 1.0
    kv.check_invariants()


def test_allocation_and_free_accounting() -> None:
    kv = make(11)
    assert kv.allocate_slots("a", 5) == [1, 2]  # ceil(5 / 4)
    assert kv.allocate_slots("a", 8) == []  # still fits in two blocks
    assert kv.allocate_slots("a", 9) == [3]
    assert kv.allocate_slots("b", 1) == [4]
    assert kv.get_block_ids("a") == [1, 2, 3]
    assert kv.get_block_ids("unknown") == []
    assert kv.num_used_blocks == 4 and kv.num_free_blocks == 6
    assert kv.usage == pytest.approx(0.4)
    kv.check_invariants()
    kv.free("a")
    kv.free("a")  # unknown now: no-op
    kv.free("never-seen")
    assert kv.num_used_blocks == 1 and kv.num_free_blocks == 9
    assert kv.get_block_ids("a") == []
    kv.free("b")
    assert kv.num_used_blocks == 0 and kv.num_free_blocks == 10
    kv.check_invariants()


def test_num_blocks_needed() -> None:
    kv = make()
    assert [kv.num_blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_exhaustion_is_all_or_nothing() -> None:
    kv = make(6)  # 5 usable blocks
    assert kv.allocate_slots("a", 3 * BS) is not None
    assert kv.allocate_slots("b", 3 * BS) is None
    assert kv.get_block_ids("b") == []
    assert kv.allocate_slots("a", 6 * BS) is None
    assert len(kv.get_block_ids("a")) == 3
    assert kv.num_free_blocks == 2
    kv.check_invariants()
    assert kv.allocate_slots("a", 5 * BS) is not None
    assert kv.num_free_blocks == 0
    assert kv.allocate_slots("c", 1) is None
    kv.check_invariants()


def test_exhaustion_with_hits_changes_nothing() -> None:
    kv = make(6)
    prompt = list(range(3 * BS + 1))
    admit(kv, "a", prompt)  # 4 blocks, 3 of them cached
    kv.free("a")
    assert kv.allocate_slots("x", 1) is not None  # 1 free left + 3 evictable
    hit = kv.get_computed_blocks("b", prompt)
    assert hit == 3 * BS
    free_before = kv.num_free_blocks
    # Reviving 3 evictable hit blocks costs 3 of the 4 allocatable blocks: 2 new ones don't fit.
    assert kv.allocate_slots("b", 3 * BS + 2 * BS, hit) is None
    assert kv.num_free_blocks == free_before and kv.get_block_ids("b") == []
    assert kv.num_cached_blocks == 3
    kv.check_invariants()
    # The lookup survives a failed allocation, so a smaller retry can take the hits.
    new = kv.allocate_slots("b", 3 * BS + 1, hit)
    assert new is not None and len(new) == 1
    assert kv.num_free_blocks == 0
    kv.check_invariants()


def test_bad_arguments_raise() -> None:
    kv = make()
    with pytest.raises(ValueError, match="num_tokens"):
        kv.allocate_slots("a", -1)
    with pytest.raises(ValueError, match="exceeds num_tokens"):
        kv.allocate_slots("a", 4, 8)
    with pytest.raises(ValueError, match="exceeds the 0 tokens"):
        kv.allocate_slots("a", 9, 8)  # no lookup recorded
    with pytest.raises(ValueError, match="holds no blocks"):
        kv.cache_blocks("a", [1, 2, 3, 4], 4)
    kv.allocate_slots("a", 4)
    with pytest.raises(ValueError, match="exceeds len"):
        kv.cache_blocks("a", [1, 2, 3], 4)
    with pytest.raises(ValueError, match="holds only 1 blocks"):
        kv.cache_blocks("a", list(range(8)), 8)
    with pytest.raises(ValueError, match="already holds blocks"):
        kv.get_computed_blocks("a", list(range(9)))
    kv.check_invariants()


# --- prefix caching -------------------------------------------------------------------


def test_shared_prefix_hits_full_blocks_and_the_shared_part_of_the_next() -> None:
    kv = make(20)
    shared = list(range(100, 100 + 2 * BS + 2))  # two full blocks + two tokens of a third
    a = shared + [1, 2, 3]
    assert admit(kv, "a", a)[0] == 0
    assert kv.take_block_copies() == ()
    b = shared + [7, 8, 9, 10, 11]
    hit = kv.get_computed_blocks("b", b)
    assert hit == 2 * BS + 2  # two blocks, and two tokens of a's third block
    new = kv.allocate_slots("b", len(b), hit)
    assert new is not None and len(new) == kv.num_blocks_needed(len(b)) - 2
    assert kv.get_block_ids("b")[:2] == kv.get_block_ids("a")[:2]
    assert kv.get_block_ids("b")[2:] == new
    # b's third block is its own, filled from a's by a copy in the next step
    assert kv.take_block_copies() == ((kv.get_block_ids("a")[2], new[0]),)
    assert kv.take_block_copies() == ()
    assert kv.prefix_cache_queries == len(a) + len(b)
    assert kv.prefix_cache_hits == 2 * BS + 2
    assert kv.prefix_cache_hit_rate == pytest.approx((2 * BS + 2) / (len(a) + len(b)))
    kv.check_invariants()


def test_partial_block_reuse_picks_the_longest_shared_start_and_leaves_a_token() -> None:
    kv = make(30)
    head = list(range(50, 50 + BS))  # one full block shared by all
    admit(kv, "a", head + [1, 2, 9, 9])  # shares 2 with the prompt below
    admit(kv, "b", head + [1, 2, 3, 9])  # shares 3: the longest
    admit(kv, "c", head + [5, 2, 3, 4])  # another first token: not a candidate
    kv.take_block_copies()  # b's own partial reuse of a's block
    prompt = head + [1, 2, 3, 4, 8]
    assert kv.get_computed_blocks("d", prompt) == BS + 3
    assert kv.allocate_slots("d", len(prompt), BS + 3) is not None
    assert kv.take_block_copies() == ((kv.get_block_ids("b")[1], kv.get_block_ids("d")[1]),)
    # a prompt that ends inside the shared part keeps its last token to compute
    assert kv.get_computed_blocks("e", head + [1, 2, 3]) == BS + 2
    # the first block of a sequence has no parent: found by its first token alone
    assert kv.get_computed_blocks("f", [50, 51, 99, 99, 99]) == 2
    kv.check_invariants()


def test_taking_only_full_blocks_copies_nothing_and_other_counts_are_refused() -> None:
    kv = make(20)
    admit(kv, "a", list(range(2 * BS)))
    prompt = list(range(BS + 2)) + [99, 99]
    assert kv.get_computed_blocks("b", prompt) == BS + 2
    for bad in (BS + 1, 2 * BS):
        with pytest.raises(ValueError, match="num_new_computed_tokens"):
            kv.allocate_slots("b", len(prompt), bad)
    assert kv.allocate_slots("b", len(prompt), BS) is not None
    assert kv.take_block_copies() == ()
    kv.check_invariants()


def test_partial_lookup_goes_stale_when_its_block_is_evicted() -> None:
    kv = make(4)  # three usable blocks
    admit(kv, "a", list(range(2 * BS)))
    kv.free("a")  # both blocks evictable
    prompt = list(range(BS)) + [BS, 99, 99]
    assert kv.get_computed_blocks("b", prompt) == BS + 1
    assert kv.allocate_slots("x", 3 * BS) is not None  # evicts both cached blocks
    with pytest.raises(ValueError, match="stale"):
        kv.allocate_slots("b", len(prompt), BS + 1)
    kv.free("x")
    assert kv.get_computed_blocks("b", prompt) == 0
    kv.check_invariants()


def test_a_source_block_evicted_for_the_copy_itself_is_still_copied_first() -> None:
    kv = make(3)  # two usable blocks
    admit(kv, "a", list(range(2 * BS)))
    kv.free("a")
    prompt = list(range(BS)) + [BS, 99]
    assert kv.get_computed_blocks("b", prompt) == BS + 1
    new = kv.allocate_slots("b", len(prompt), BS + 1)
    # the only free block was the source: copying it onto itself keeps its contents
    assert new is not None and kv.take_block_copies() == ((new[0], new[0]),)
    kv.check_invariants()


def test_lookup_never_covers_last_token() -> None:
    kv = make(20)
    prompt = list(range(3 * BS))  # exactly three full blocks
    admit(kv, "a", prompt)
    assert kv.num_cached_blocks == 3
    # Same prompt: the last block would cover the last token, so two blocks hit, and all
    # but the last token of the third (copied from the cached one).
    assert kv.get_computed_blocks("b", prompt) == 3 * BS - 1
    assert kv.get_computed_blocks("c", prompt + [99]) == 3 * BS
    assert kv.get_computed_blocks("d", prompt[:1]) == 0
    assert kv.get_computed_blocks("e", []) == 0


def test_different_first_block_misses_later_blocks() -> None:
    kv = make(20)
    a = list(range(3 * BS + 1))
    admit(kv, "a", a)
    b = [999] + a[1:]  # same second/third block tokens, different parent chain
    assert kv.get_computed_blocks("b", b) == 0


def test_hit_after_free_reuses_evictable_blocks() -> None:
    kv = make(11)
    prompt = list(range(2 * BS + 3))
    admit(kv, "a", prompt)
    ids_a = kv.get_block_ids("a")
    kv.free("a")
    assert kv.num_used_blocks == 0 and kv.num_free_blocks == 10
    assert kv.num_cached_blocks == 2
    hit = kv.get_computed_blocks("a", prompt)  # e.g. resumed after preemption
    assert hit == 2 * BS
    new = kv.allocate_slots("a", len(prompt), hit)
    assert new is not None and len(new) == 1
    assert kv.get_block_ids("a")[:2] == ids_a[:2]
    assert kv.num_used_blocks == 3 and kv.num_free_blocks == 7
    kv.check_invariants()


def test_eviction_prefers_free_list_then_lru_tail_first() -> None:
    kv = make(9)  # 8 usable
    a = list(range(3 * BS + 1))  # 4 blocks, 3 cached
    b = list(range(500, 500 + 3 * BS + 1))
    admit(kv, "a", a)
    admit(kv, "b", b)
    a_ids, b_ids = kv.get_block_ids("a"), kv.get_block_ids("b")
    kv.free("a")
    kv.free("b")
    # Unhashed partial blocks go to the free list and are used before any cached block.
    assert kv.allocate_slots("x", 2 * BS) == [a_ids[3], b_ids[3]]
    assert kv.num_cached_blocks == 6
    # Then LRU: a was freed first, and within a the tail was released first.
    assert kv.allocate_slots("y", 2 * BS) == [a_ids[2], a_ids[1]]
    assert kv.num_cached_blocks == 4
    assert kv.get_computed_blocks("a2", a) == BS  # only a's head block survives
    assert kv.get_computed_blocks("b2", b) == 3 * BS
    kv.check_invariants()


def test_hit_refreshes_lru_position() -> None:
    kv = make(7)  # 6 usable
    a = list(range(2 * BS + 1))  # 3 blocks, 2 cached
    b = list(range(50, 50 + 2 * BS + 1))
    admit(kv, "a", a)
    admit(kv, "b", b)
    kv.free("a")
    kv.free("b")
    admit(kv, "a2", a)  # takes a's cached blocks back, then frees them after b's
    kv.free("a2")
    kv.allocate_slots("x", 4 * BS)  # 2 free partial blocks + the 2 least recent: b's
    assert kv.get_computed_blocks("b2", b) == 0
    assert kv.get_computed_blocks("a3", a) == 2 * BS
    kv.check_invariants()


def test_shared_blocks_ref_counts() -> None:
    kv = make(20)
    prompt = list(range(2 * BS + 1))
    admit(kv, "a", prompt)
    admit(kv, "b", prompt)
    admit(kv, "c", prompt)
    shared = kv.get_block_ids("a")[:2]
    pool_blocks = kv._pool.blocks
    assert [pool_blocks[i].ref_cnt for i in shared] == [3, 3]
    assert kv.num_used_blocks == 2 + 3  # shared prefix + one private tail each
    kv.free("a")
    kv.free("b")
    assert [pool_blocks[i].ref_cnt for i in shared] == [1, 1]
    assert kv._pool.num_evictable_blocks == 0  # still held by c
    kv.check_invariants()
    kv.free("c")
    assert kv._pool.num_evictable_blocks == 2
    assert kv.num_used_blocks == 0
    kv.check_invariants()


def test_cache_blocks_incremental_and_idempotent() -> None:
    kv = make(20)
    tokens = list(range(10, 10 + 3 * BS + 2))
    assert kv.allocate_slots("a", len(tokens)) is not None
    kv.cache_blocks("a", tokens, BS - 1)
    assert kv.num_cached_blocks == 0
    kv.cache_blocks("a", tokens, BS + 1)
    assert kv.num_cached_blocks == 1
    kv.cache_blocks("a", tokens, BS + 1)
    kv.cache_blocks("a", tokens, 0)  # progress never regresses
    assert kv.num_cached_blocks == 1
    kv.cache_blocks("a", tokens, len(tokens))
    assert kv.num_cached_blocks == 3
    kv.cache_blocks("a", tokens, len(tokens))
    assert kv.num_cached_blocks == 3
    kv.check_invariants()
    ids = kv.get_block_ids("a")
    expected = None
    for i in range(3):
        expected = hash_block_tokens(expected, tokens[i * BS : (i + 1) * BS])
        assert kv._pool.get_cached_block(expected) is kv._pool.blocks[ids[i]]


def test_cache_blocks_placeholders_not_cached() -> None:
    kv = make(20)
    tokens = list(range(2 * BS))
    kv.allocate_slots("a", 2 * BS + 1)
    # Async scheduling: the last token is a placeholder, so the second block is not known.
    kv.cache_blocks("a", tokens, 2 * BS - 1)
    assert kv.num_cached_blocks == 1
    kv.cache_blocks("a", tokens + [77], 2 * BS)
    assert kv.num_cached_blocks == 2


def test_duplicate_block_keeps_existing_mapping() -> None:
    kv = make(20)
    prompt = list(range(2 * BS + 1))
    # Both allocate before either caches, so b computes its own copy of the prefix.
    assert kv.get_computed_blocks("a", prompt) == 0
    assert kv.get_computed_blocks("b", prompt) == 0
    kv.allocate_slots("a", len(prompt))
    kv.allocate_slots("b", len(prompt))
    kv.cache_blocks("a", prompt, len(prompt))
    kv.cache_blocks("b", prompt, len(prompt))
    assert kv.num_cached_blocks == 2
    a_ids = kv.get_block_ids("a")
    kv.check_invariants()
    kv.free("b")  # b's duplicates are unhashed: back to the free list, not the LRU
    assert kv._pool.num_evictable_blocks == 0
    kv.free("a")
    assert kv._pool.num_evictable_blocks == 2
    kv.get_computed_blocks("c", prompt)
    kv.allocate_slots("c", len(prompt), 2 * BS)
    assert kv.get_block_ids("c")[:2] == a_ids[:2]
    kv.check_invariants()


def test_stale_lookup_raises() -> None:
    kv = make(4)  # 3 usable
    prompt = list(range(BS + 1))
    admit(kv, "a", prompt)
    kv.free("a")
    assert kv.get_computed_blocks("b", prompt) == BS
    kv.allocate_slots("x", 3 * BS)  # evicts the hit block
    with pytest.raises(ValueError, match="stale"):
        kv.allocate_slots("b", BS + 1, BS)
    kv.free("x")
    # A fresh lookup misses, and taking fewer hits than found (0) is allowed.
    assert kv.get_computed_blocks("b", prompt) == 0
    assert kv.allocate_slots("b", BS + 1, 0) is not None
    kv.check_invariants()


def test_taking_fewer_hits_than_found() -> None:
    kv = make(20)
    prompt = list(range(3 * BS + 1))
    admit(kv, "a", prompt)
    hit = kv.get_computed_blocks("b", prompt)
    assert hit == 3 * BS
    with pytest.raises(ValueError, match="multiple of block_size"):
        kv.allocate_slots("b", len(prompt), BS + 1)
    new = kv.allocate_slots("b", len(prompt), BS)
    assert new is not None and len(new) == 3
    assert kv.get_block_ids("b")[0] == kv.get_block_ids("a")[0]
    with pytest.raises(ValueError, match="already holds blocks"):
        kv.allocate_slots("b", len(prompt) + BS, BS)
    kv.check_invariants()


def test_prefix_caching_disabled() -> None:
    kv = make(11, caching=False)
    prompt = list(range(3 * BS + 1))
    admit(kv, "a", prompt)
    assert kv.num_cached_blocks == 0
    kv.free("a")
    assert kv.get_computed_blocks("b", prompt) == 0
    assert kv.prefix_cache_queries == 0 and kv.prefix_cache_hit_rate == 0.0
    with pytest.raises(ValueError):
        kv.allocate_slots("b", len(prompt), BS)
    assert kv.allocate_slots("b", len(prompt)) is not None
    kv.free("b")
    assert kv.num_free_blocks == 10 and kv._pool.num_evictable_blocks == 0
    kv.check_invariants()


def test_reset_prefix_cache() -> None:
    kv = make(11)
    prompt = list(range(2 * BS + 1))
    admit(kv, "a", prompt)
    assert kv.reset_prefix_cache() is False  # a holds blocks
    assert kv.num_cached_blocks == 2
    kv.free("a")
    assert kv.reset_prefix_cache() is True
    assert kv.num_cached_blocks == 0 and kv._pool.num_evictable_blocks == 0
    assert kv.num_free_blocks == 10
    assert kv.get_computed_blocks("b", prompt) == 0
    kv.check_invariants()


def test_check_invariants_catches_corruption() -> None:
    kv = make(11)
    admit(kv, "a", list(range(2 * BS + 1)))
    kv.check_invariants()
    kv._pool.blocks[kv.get_block_ids("a")[0]].ref_cnt += 1
    with pytest.raises(AssertionError):
        kv.check_invariants()


def test_block_pool_rejects_misuse() -> None:
    pool = BlockPool(4)
    (block,) = pool.allocate(1)
    with pytest.raises(ValueError):
        pool.allocate(3)
    pool.release([block])
    with pytest.raises(ValueError, match="released more often"):
        pool.release([block])
    with pytest.raises(ValueError, match="is free"):
        pool.touch([block])
    with pytest.raises(ValueError, match="null block"):
        pool.touch([pool.blocks[NULL_BLOCK_ID]])
    pool.check_invariants()


def test_fills_new_block_says_when_cache_blocks_has_work() -> None:
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    assert kv.fills_new_block("nobody", 0)  # cache_blocks then names the unknown request
    tokens = list(range(2 * BS + 1))
    kv.allocate_slots("a", len(tokens))
    assert not kv.fills_new_block("a", BS - 1)
    assert kv.fills_new_block("a", BS)
    kv.cache_blocks("a", tokens, len(tokens))  # two full blocks registered
    assert not kv.fills_new_block("a", len(tokens))
    assert kv.fills_new_block("a", 3 * BS)
    off = KVCacheManager(16, BS, enable_prefix_caching=False)
    off.allocate_slots("a", len(tokens))
    assert not off.fills_new_block("a", len(tokens))


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_release_outside_window_frees_leading_blocks(prefix_caching: bool) -> None:
    """Window 8, blocks of 4: from position 20 on, queries see positions 13.. only, so blocks
    0-2 (positions 0-11) go back to the pool and the list keeps the null block in their place;
    with prefix caching only registered blocks go, and stay findable."""
    kv = KVCacheManager(16, 4, enable_prefix_caching=prefix_caching, sliding_window=8)
    tokens = list(range(100, 124))
    assert kv.allocate_slots("r", 24) is not None
    held = kv.get_block_ids("r")
    if prefix_caching:
        kv.cache_blocks("r", tokens, 8)  # only blocks 0-1 registered yet
        assert kv.release_outside_window("r", 20) == 2
        kv.cache_blocks("r", tokens, 24)
    assert kv.release_outside_window("r", 20) == (1 if prefix_caching else 3)
    assert kv.release_outside_window("r", 20) == 0  # nothing new left the window
    assert kv.get_block_ids("r") == [NULL_BLOCK_ID] * 3 + held[3:]
    assert kv.num_used_blocks == 3
    kv.check_invariants()
    if prefix_caching:  # the released blocks are still found by a lookup
        # five blocks, and three tokens of the sixth (the last one is left to compute)
        assert kv.get_computed_blocks("other", tokens) == 23
    with pytest.raises(ValueError, match="released past its window|registered in the prefix"):
        kv.truncate("r", 8)
    kv.free("r")
    assert kv.num_used_blocks == 0
    kv.check_invariants()


def test_release_outside_window_needs_a_window() -> None:
    kv = KVCacheManager(16, 4)
    assert kv.allocate_slots("r", 24) is not None
    assert kv.release_outside_window("r", 20) == 0 and kv.num_used_blocks == 6
    assert KVCacheManager(16, 4, sliding_window=8).release_outside_window("unknown", 50) == 0
    with pytest.raises(ValueError, match="sliding_window must be an int"):
        KVCacheManager(16, 4, sliding_window=8.0)  # type: ignore[arg-type]
