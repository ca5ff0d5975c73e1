"""The pool of KV cache blocks: ref counts, the free list, the evictable LRU and the hash map.

This module knows blocks, not requests. Block id ``NULL_BLOCK_ID`` (0) is reserved as the
null/pad block: it is never handed out, so block tables can be padded with it and writes
through a padded slot land in a block nobody reads. Usable blocks are ``1 .. num_blocks-1``.

A usable block is in exactly one of three states:

- held: ``ref_cnt > 0`` (one count per request that owns it);
- free: ``ref_cnt == 0`` and no hash, in the free list (FIFO);
- evictable: ``ref_cnt == 0`` with a hash, in the LRU of cached blocks, still findable by
  prefix-cache lookups until it is evicted.

Allocation takes free blocks first and evicts the least recently freed cached block only
when the free list is empty, so cached prefixes survive as long as memory allows. Every
operation is O(1) per block touched.

A cached block also records its parent's hash and its token ids, indexed by (parent, first
token): a lookup whose next block is not cached can still find a cached sibling that starts
with the same tokens and reuse that part of it (``children``).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

NULL_BLOCK_ID = 0

BlockHash = bytes


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """The hash of one full block: sha256 over the parent's hash and the int64 token ids.

    Raises:
        OverflowError: for a token id outside the int64 range.
    """
    h = hashlib.sha256(parent_hash or b"")
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def group_key(block_hash: BlockHash, group: int) -> BlockHash:
    """The pool's key of a group's block of this hash: one pool holds every group's blocks,
    and equal tokens in two groups are two blocks."""
    return block_hash if group == 0 else block_hash + bytes((group,))


@dataclass(eq=False, slots=True)
class KVCacheBlock:
    """Mutable bookkeeping of one block; identity (not value) equality on purpose."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    # Set with the hash (cache_block): the parent block's hash and this block's token ids.
    parent_hash: BlockHash | None = None
    token_ids: tuple[int, ...] = ()


class BlockPool:
    """Owns every block of one KV cache group and the prefix-cache hash map.

    Raises:
        ValueError: if ``num_blocks`` is not an int >= 2 (block 0 is reserved, so fewer
            would leave nothing to allocate).
    """

    def __init__(self, num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 2:
            raise ValueError(
                f"num_blocks must be an int >= 2 (block {NULL_BLOCK_ID} is reserved), "
                f"got {num_blocks!r}"
            )
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self._free: deque[KVCacheBlock] = deque(self.blocks[1:])
        # Insertion order is the eviction order: the front is the least recently freed.
        self._evictable: OrderedDict[int, KVCacheBlock] = OrderedDict()
        # One block per hash: a second block with the same contents stays unhashed.
        self._cached: dict[BlockHash, KVCacheBlock] = {}
        # Cached blocks by (parent hash, first token id), in registration order.
        self._children: dict[tuple[BlockHash | None, int], dict[int, KVCacheBlock]] = {}

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can ever be handed out (all but the null block)."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now: free plus evictable cached blocks."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable_blocks(self) -> int:
        """Cached blocks that no request holds (still hits for lookups)."""
        return len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered under a hash, held or evictable."""
        return len(self._cached)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one request."""
        return self.num_usable_blocks - self.num_free_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block cached under ``block_hash``, or None. Changes nothing."""
        return self._cached.get(block_hash)

    def children(self, parent_hash: BlockHash | None, first_token: int) -> list[KVCacheBlock]:
        """The cached blocks (held or evictable) registered with ``cache_block`` under
        ``parent_hash`` (None: a sequence's first block) whose first token id is
        ``first_token``, oldest first. Changes nothing."""
        found = self._children.get((parent_hash, first_token))
        return list(found.values()) if found else []

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Adds one reference to each block, taking evictable ones out of the LRU.

        Raises:
            ValueError: for the null block or a block at ref count 0 without a hash (a
                free block must be obtained through ``allocate``).
        """
        for block in blocks:
            if block.block_id == NULL_BLOCK_ID:
                raise ValueError("the null block cannot be referenced")
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    raise ValueError(f"block {block.block_id} is free; allocate it instead")
                del self._evictable[block.block_id]
            block.ref_cnt += 1

    def allocate(self, num: int) -> list[KVCacheBlock]:
        """Hands out ``num`` blocks at ref count 1: free ones first, then evicts cached ones.

        Evicting drops the block's hash, so later lookups miss it.

        Raises:
            ValueError: if fewer than ``num`` blocks are allocatable (nothing changes then).
        """
        if num < 0 or num > self.num_free_blocks:
            raise ValueError(f"cannot allocate {num} blocks, {self.num_free_blocks} are free")
        out: list[KVCacheBlock] = []
        for _ in range(num):
            if self._free:
                block = self._free.popleft()
            else:
                _, block = self._evictable.popitem(last=False)
                self._forget(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def release(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drops one reference from each block, in the given order.

        A block reaching ref count 0 goes to the back of the evictable LRU if it has a hash
        (so pass a sequence tail first to have its tail evicted first), else to the free
        list.

        Raises:
            ValueError: for a block that nobody holds.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} released more often than taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self._free.append(block)
                else:
                    self._evictable[block.block_id] = block

    def cache_block(
        self,
        block: KVCacheBlock,
        block_hash: BlockHash,
        parent_hash: BlockHash | None = None,
        token_ids: tuple[int, ...] = (),
    ) -> bool:
        """Registers a held, unhashed block under ``block_hash``; with its ``token_ids``
        (non-empty) it is also listed by ``children`` under ``parent_hash``.

        Returns True if registered; False if another block is already cached under that hash
        (the existing mapping is kept and ``block`` stays unhashed, so it returns to the
        free list when released).

        Raises:
            ValueError: if the block is not held or already has a hash.
        """
        if block.ref_cnt <= 0 or block.block_hash is not None:
            raise ValueError(
                f"block {block.block_id} must be held and unhashed to be cached "
                f"(ref_cnt={block.ref_cnt}, hashed={block.block_hash is not None})"
            )
        if block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block
        if token_ids:
            block.parent_hash, block.token_ids = parent_hash, token_ids
            key = (parent_hash, token_ids[0])
            self._children.setdefault(key, {})[block.block_id] = block
        return True

    def _forget(self, block: KVCacheBlock) -> None:
        """Drops an evicted block's hash, map entry and child entry."""
        assert block.block_hash is not None
        del self._cached[block.block_hash]
        if block.token_ids:
            key = (block.parent_hash, block.token_ids[0])
            siblings = self._children[key]
            del siblings[block.block_id]
            if not siblings:
                del self._children[key]
        block.block_hash, block.parent_hash, block.token_ids = None, None, ()

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached hash, if no block is held.

        Returns False and changes nothing while any request holds a block (its blocks may
        be shared through the cache); True after clearing, when the evictable blocks have
        joined the free list.
        """
        if self.num_used_blocks:
            return False
        for block in self._evictable.values():
            block.block_hash, block.parent_hash, block.token_ids = None, None, ()
            self._free.append(block)
        self._evictable.clear()
        self._cached.clear()
        self._children.clear()
        return True

    def check_invariants(self) -> None:
        """Cross-checks ref counts, the free list, the LRU and the hash map. O(num_blocks).

        Raises:
            AssertionError: naming the first disagreement found.
        """
        null = self.blocks[NULL_BLOCK_ID]
        assert null.ref_cnt == 0 and null.block_hash is None, "null block was used"
        free_ids = [b.block_id for b in self._free]
        assert len(set(free_ids)) == len(free_ids), "duplicate block in the free list"
        free_set = set(free_ids)
        assert NULL_BLOCK_ID not in free_set and NULL_BLOCK_ID not in self._evictable
        assert not free_set & self._evictable.keys(), "block both free and evictable"
        for block_id, block in self._evictable.items():
            assert block.block_id == block_id, f"evictable entry {block_id} is misfiled"
        for block in self.blocks[1:]:
            bid = block.block_id
            assert block.ref_cnt >= 0, f"block {bid} has negative ref count"
            in_free = bid in free_set
            in_lru = bid in self._evictable
            if block.ref_cnt > 0:
                assert not in_free and not in_lru, f"held block {bid} is queued"
            elif block.block_hash is None:
                assert in_free and not in_lru, f"free block {bid} not in the free list"
            else:
                assert in_lru and not in_free, f"cached block {bid} not in the LRU"
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) is block, f"block {bid} hash unmapped"
        for block_hash, block in self._cached.items():
            assert block.block_hash == block_hash, f"hash map points to block {block.block_id}"
        listed = 0
        for (parent, first), siblings in self._children.items():
            assert siblings, "empty child entry"
            for block_id, block in siblings.items():
                assert block.block_id == block_id and block.block_hash is not None, (
                    f"child entry {block_id} is not a cached block"
                )
                assert block.parent_hash == parent and block.token_ids[0] == first, (
                    f"block {block_id} is listed under another parent or first token"
                )
            listed += len(siblings)
        with_tokens = sum(1 for b in self._cached.values() if b.token_ids)
        assert listed == with_tokens, "a cached block with tokens is not listed as a child"
