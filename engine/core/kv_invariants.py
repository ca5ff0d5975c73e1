"""The KV cache manager's per-request bookkeeping checked against the pool's blocks
(``KVCacheManager.check_invariants``: tests and fuzzers call it after every step)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from baton.engine.core.block_pool import NULL_BLOCK_ID, BlockHash, KVCacheBlock


@dataclass(frozen=True)
class RequestBlocks:
    """What the manager holds per request: block lists per group, how many leading blocks
    each group released, how many leading blocks are registered, and the block hashes
    (None without prefix caching)."""

    num_blocks: int
    num_groups: int
    blocks: Mapping[str, list[list[KVCacheBlock]]]
    released: Mapping[str, list[int]]
    num_cached: Mapping[str, int]
    hashes: Mapping[str, list[BlockHash]] | None


def check_request_blocks(held: RequestBlocks, pool_blocks: Sequence[KVCacheBlock]) -> None:
    """Raises AssertionError naming the first disagreement between the requests' lists and
    the pool: request maps, group and slot counts, released slots still listed, a block held
    twice or the null block held, cache progress, and every block's reference count."""
    refs = [0] * held.num_blocks
    assert held.blocks.keys() == held.num_cached.keys(), "request maps disagree"
    assert held.blocks.keys() == held.released.keys(), "request maps disagree"
    for request_id, groups in held.blocks.items():
        assert len(groups) == held.num_groups, f"request {request_id!r}: groups"
        assert len({len(blocks) for blocks in groups}) == 1, f"request {request_id!r}: slots"
        ids = []
        for blocks, released in zip(groups, held.released[request_id], strict=True):
            assert all(b.block_id == NULL_BLOCK_ID for b in blocks[:released]), (
                f"request {request_id!r}: a released block is still listed"
            )
            ids += [b.block_id for b in blocks[released:]]
        assert len(set(ids)) == len(ids), f"request {request_id!r} holds a block twice"
        assert NULL_BLOCK_ID not in ids, f"request {request_id!r} holds the null block"
        num_cached = held.num_cached[request_id]
        assert 0 <= num_cached <= len(groups[0]), f"request {request_id!r} cache progress"
        if held.hashes is not None:
            assert len(held.hashes.get(request_id, ())) >= num_cached
        for block_id in ids:
            refs[block_id] += 1
    for block in pool_blocks:
        assert block.ref_cnt == refs[block.block_id], (
            f"block {block.block_id}: ref_cnt {block.ref_cnt}, held by {refs[block.block_id]}"
        )
