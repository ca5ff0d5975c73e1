"""Which KV cache blocks each request owns, with prefix caching, per KV cache group.

This is the bookkeeping half of the paged KV cache; the device tensors (per layer, or per
slot with groups, ``[num_blocks, block_size, num_kv_heads, head_dim]``) live in the runner. Block id
``NULL_BLOCK_ID`` (0) is reserved as the null/pad block: block tables are padded with it and
it is never allocated, so a request's blocks are always in ``1 .. num_blocks-1``.

Prefix caching: a block completely filled with known tokens gets a hash chained over its
parent, ``sha256(parent_hash + int64 token bytes)``, so equal hashes mean equal token
prefixes (sha256, not Python's ``hash``, so colliding prompts cannot be crafted). A request
about to start looks its prompt up with ``get_computed_blocks`` and takes the hits with the
first ``allocate_slots``. Released blocks keep their hash in an LRU of evictable blocks until
the space is needed.

Past the last full block found, the lookup also reuses part of a block: a cached block under
the same parent whose first tokens equal the prompt's next ones (a shared system prompt that
ends inside a block, a conversation's earlier turn). The request gets a new block and the
runner copies that block's KV into it before the step's forward (``take_block_copies``, the
step's ``SchedulerOutput.kv_block_copies``), so those tokens are not computed again. The
source is not held: a block evicted and reused in the same step is written only by that
step's forward, after the copy, and earlier steps' writes came before it.

Call protocol (the scheduler's side):

1. admitting a request (new, or resumed after preemption):
   ``n = get_computed_blocks(rid, tokens)`` then
   ``allocate_slots(rid, n + num_new_tokens [+ lookahead], num_new_computed_tokens=n)``,
   back to back. The lookup only records what it found; the blocks are taken (ref count +1)
   by that first ``allocate_slots``. Passing a smaller multiple of ``block_size`` (or 0)
   takes only that many hit blocks (and no partial block). If ``allocate_slots`` returns
   None the lookup stays recorded, so the call can be retried. The copies the allocations
   asked for go into the step with ``take_block_copies``.
2. every step: ``allocate_slots(rid, num_computed + num_new_tokens [+ lookahead])``, then,
   once tokens are known, ``cache_blocks(rid, tokens, num_known_tokens)``.
3. finishing, aborting or preempting: ``free(rid)``; it also forgets the request's lookup and
   hashes.

A request's token ids must only grow (append-only) between admission and ``free``: the
block hashes computed for it are kept and extended incrementally.

KV cache groups (``group_windows``, ``engine/kv_layout.py``; docs/design.md, "KV cache
groups"): one block list per layer kind for every request, all from one pool, index-aligned;
ids are listed interleaved by group (entry ``i * num_groups + g``).
"""

from __future__ import annotations

from collections.abc import Sequence

from baton.engine.core.block_pool import (
    NULL_BLOCK_ID,
    BlockHash,
    BlockPool,
    KVCacheBlock,
    group_key,
    hash_block_tokens,
)
from baton.engine.core.kv_invariants import RequestBlocks, check_request_blocks

__all__ = ["NULL_BLOCK_ID", "BlockHash", "KVCacheManager", "hash_block_tokens"]

Blocks = list[list[KVCacheBlock]]  # a request's blocks per group


def _stale(request_id: str, why: str) -> ValueError:
    return ValueError(
        f"the prefix-cache lookup of request {request_id!r} is stale ({why}); call "
        "get_computed_blocks right before allocate_slots"
    )


def _check_count(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")


class KVCacheManager:
    """Allocates KV cache blocks to requests and shares full blocks through prefix caching.

    ``sliding_window``: every layer's window (one group); ``group_windows``: each KV cache
    group's window (None: full attention), for a model that mixes kinds (``sliding_window``
    then must be None).

    Raises:
        ValueError: ``num_blocks`` not an int >= 2 (block 0 is reserved), ``block_size`` not
            an int >= 1, a window not an int, or both ``sliding_window`` and ``group_windows``.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        sliding_window: int | None = None,
        group_windows: tuple[int | None, ...] | None = None,
    ) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        if group_windows is not None and sliding_window is not None:
            raise ValueError("give sliding_window (one group) or group_windows, not both")
        windows = group_windows or (sliding_window,)
        for window in windows:
            if window is not None and (isinstance(window, bool) or not isinstance(window, int)):
                raise ValueError(f"sliding_window must be an int or None, got {window!r}")
        self.group_windows: tuple[int | None, ...] = tuple(
            w if w and w > 0 else None for w in windows
        )
        self.num_groups = len(self.group_windows)
        # Every layer's attention window (None: some layer sees every token).
        self.sliding_window = self.group_windows[0] if self.num_groups == 1 else None
        # Whether ``release_outside_window`` can release anything (some group is windowed).
        self.releases_blocks = any(w is not None for w in self.group_windows)
        self._pool = BlockPool(num_blocks)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._req_blocks: dict[str, Blocks] = {}
        # How many leading blocks of the request are already registered (or were hits).
        self._req_num_cached: dict[str, int] = {}
        self._req_hashes: dict[str, list[BlockHash]] = {}
        # How many leading blocks of the request each group released past its window (they
        # stay in its list as the null block, so that positions keep their index).
        self._req_released: dict[str, list[int]] = {}
        # Number of hit blocks recorded by the last lookup, until allocate_slots takes them,
        # and the cached block whose first tokens the lookup reuses past them (and how many).
        self._pending_hits: dict[str, int] = {}
        self._pending_partial: dict[str, tuple[BlockHash, int]] = {}
        # (source, destination) block ids the runner copies before the next step's forward.
        self._copies: list[tuple[int, int]] = []
        # Prompt tokens looked up by get_computed_blocks so far, and those found (read-only).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # --- accounting -------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now: free plus evictable cached blocks."""
        return self._pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one request (0 once every request is freed)."""
        return self._pool.num_used_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks currently findable by prefix-cache lookups (held or evictable)."""
        return self._pool.num_cached_blocks

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks (all but the null block) held by requests."""
        return self._pool.num_used_blocks / self._pool.num_usable_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hit tokens / queried tokens over all lookups (0.0 before the first lookup); a
        waiting request that is looked up again every step counts every time."""
        queried = self.prefix_cache_queries
        return self.prefix_cache_hits / queried if queried else 0.0

    def num_blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens (ceil division)."""
        return -(-num_tokens // self.block_size)

    def get_block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's block ids in sequence order, interleaved by group (entry
        ``i * num_groups + g`` is group g's block i); [] for an unknown id."""
        groups = self._req_blocks.get(request_id)
        if not groups:
            return []
        if len(groups) == 1:
            return [b.block_id for b in groups[0]]
        return [b.block_id for row in zip(*groups, strict=True) for b in row]

    def get_group_block_ids(self, request_id: str) -> list[list[int]]:
        """A copy of the request's block ids per group, each in sequence order (released
        or unneeded slots of a windowed group hold ``NULL_BLOCK_ID``); [] for an unknown id."""
        return [[b.block_id for b in g] for g in self._req_blocks.get(request_id, ())]

    # --- the protocol -----------------------------------------------------------------

    def get_computed_blocks(self, request_id: str, token_ids: Sequence[int]) -> int:
        """Looks up the longest cached chain of full blocks prefixing ``token_ids``, then
        the cached block after it that shares the most leading tokens with the prompt.

        Returns the number of tokens found (full blocks, plus the shared part of the next
        block), never covering the last token (one token must be computed to have logits to
        sample). Takes no block: it records the hits for the request's next
        ``allocate_slots`` and replaces any earlier lookup. Counts queried and hit tokens
        for the metrics. Returns 0 (and counts nothing) with prefix caching disabled.

        Raises:
            ValueError: if the request already holds blocks (look up only before the first
                allocation after admission or preemption).
        """
        if any(self._req_blocks.get(request_id, ())):
            raise ValueError(
                f"request {request_id!r} already holds blocks; free it before a new lookup"
            )
        self._pending_hits.pop(request_id, None)
        self._pending_partial.pop(request_id, None)
        if not self.enable_prefix_caching:
            return 0
        max_blocks = (len(token_ids) - 1) // self.block_size if token_ids else 0
        # The groups that need every block of a hit: the full-attention ones (one group: it).
        whole = [g for g, w in enumerate(self.group_windows) if w is None] or [0]
        num_hits = 0
        while num_hits < max_blocks:
            block_hash = self._block_hash(request_id, token_ids, num_hits)
            if any(self._cached(block_hash, g) is None for g in whole):
                break
            num_hits += 1
        if self.num_groups > 1:
            while num_hits and not self._window_hit(request_id, num_hits):
                num_hits -= 1
        self._pending_hits[request_id] = num_hits
        found = num_hits * self.block_size
        partial = (
            self._partial_hit(request_id, token_ids, num_hits) if self.num_groups == 1 else None
        )
        if partial is not None:
            self._pending_partial[request_id] = partial
            found += partial[1]
        self.prefix_cache_queries += len(token_ids)
        self.prefix_cache_hits += found
        return found

    def _window_hit(self, request_id: str, num_hits: int) -> bool:
        """Whether every windowed group still caches the blocks of the first ``num_hits`` that
        the window of the position after them reaches."""
        hashes = self._req_hashes[request_id]
        for g, window in enumerate(self.group_windows):
            if window is None:
                continue
            first = self._first_in_window(window, num_hits * self.block_size)
            if any(self._cached(h, g) is None for h in hashes[first:num_hits]):
                return False
        return True

    def _first_in_window(self, window: int, position: int) -> int:
        """The first block that a query at ``position`` sees through ``window``."""
        return max(0, position - window + 1) // self.block_size

    def _cached(self, block_hash: BlockHash, group: int) -> KVCacheBlock | None:
        """Group ``group``'s cached block of this hash (group 0's key is the hash itself)."""
        return self._pool.get_cached_block(group_key(block_hash, group))

    def _partial_hit(
        self, request_id: str, token_ids: Sequence[int], num_hits: int
    ) -> tuple[BlockHash, int] | None:
        """The cached block under the last hit that shares the most leading tokens with
        the prompt's next block (the oldest of equals), and how many; None if none does.
        Leaves the last prompt token to compute."""
        start = num_hits * self.block_size
        limit = min(self.block_size, len(token_ids) - 1 - start)
        if limit <= 0:
            return None
        parent = self._req_hashes[request_id][num_hits - 1] if num_hits else None
        wanted = token_ids[start : start + limit]
        best: tuple[BlockHash, int] | None = None
        for block in self._pool.children(parent, wanted[0]):
            shared = 0
            for mine, theirs in zip(wanted, block.token_ids, strict=False):
                if mine != theirs:
                    break
                shared += 1
            if best is None or shared > best[1]:
                assert block.block_hash is not None
                best = (block.block_hash, shared)
        return best

    def allocate_slots(
        self, request_id: str, num_tokens: int, num_new_computed_tokens: int = 0
    ) -> list[int] | None:
        """Makes the request own enough blocks to hold ``num_tokens`` tokens in total.

        ``num_tokens`` counts everything the request's blocks must hold after this step:
        computed tokens (cache hits included), the tokens to compute now, and any
        lookahead. ``num_new_computed_tokens`` (only on the first allocation after
        ``get_computed_blocks``) is how many of the found tokens to take; those blocks get
        one more reference and leave the evictable LRU. Taking every token found takes the
        shared part of a partial block too: the first new block receives it by a copy
        (``take_block_copies``). New blocks come from the free list, then by evicting the
        least recently freed cached blocks.

        Every group gets as many new blocks; in a windowed group of several, hit blocks that
        the window of the first position to compute does not reach are not taken (their slots
        hold the null block).

        Returns the ids of the newly allocated blocks, interleaved by group (hit blocks not
        included; [] if the request already holds enough), or None when too few blocks are
        free, in which case nothing changes (all or nothing).

        Raises:
            ValueError: for negative counts; ``num_new_computed_tokens`` that is neither a
                multiple of ``block_size`` nor everything the lookup found, exceeds what it
                found, exceeds ``num_tokens``, or is given for a request that already holds
                blocks; or a lookup gone stale (a hit block evicted between lookup and
                allocation).
        """
        groups = self._req_blocks.get(request_id)
        if (
            groups is not None
            and num_new_computed_tokens == 0
            and type(num_tokens) is int
            and 0 <= num_tokens <= len(groups[0]) * self.block_size
        ):
            # Most decode steps: the blocks held already have room (the general path below
            # gives the same answer, at about 4 us a request a step).
            self._pending_hits.pop(request_id, None)
            return []
        _check_count("num_tokens", num_tokens)
        _check_count("num_new_computed_tokens", num_new_computed_tokens)
        if num_new_computed_tokens > num_tokens:
            raise ValueError(
                f"num_new_computed_tokens ({num_new_computed_tokens}) exceeds "
                f"num_tokens ({num_tokens})"
            )
        holds = bool(groups and groups[0])
        hits, skipped, source = self._take_hits(request_id, holds, num_new_computed_tokens)
        num_hits = skipped[0] + len(hits[0])  # slots the hits fill, in every group
        num_new = self.num_blocks_needed(num_tokens) - len(groups[0] if groups else ()) - num_hits
        num_new = max(num_new, 0)
        # Hit blocks nobody holds sit in the evictable LRU, so taking them costs free space.
        taken = [b for group_hits in hits for b in group_hits]
        num_revived = sum(1 for b in taken if b.ref_cnt == 0)
        if num_new * self.num_groups + num_revived > self._pool.num_free_blocks:
            return None
        self._pool.touch(taken)
        new_blocks = self._pool.allocate(num_new * self.num_groups)
        if groups is None:
            groups = self._req_blocks[request_id] = [[] for _ in self.group_windows]
            self._req_num_cached[request_id] = 0
            self._req_released[request_id] = [0] * self.num_groups
        if num_hits:
            null = self._pool.blocks[NULL_BLOCK_ID]
            for g, blocks in enumerate(groups):
                blocks.extend([null] * skipped[g])
                blocks.extend(hits[g])
            self._req_released[request_id] = list(skipped)
            self._req_num_cached[request_id] = num_hits
        for g, blocks in enumerate(groups):
            blocks.extend(new_blocks[g * num_new : (g + 1) * num_new])
        if source is not None and new_blocks:
            self._copies.append((source.block_id, new_blocks[0].block_id))
        self._pending_hits.pop(request_id, None)
        self._pending_partial.pop(request_id, None)
        if self.num_groups == 1:
            return [b.block_id for b in new_blocks]
        return [
            new_blocks[g * num_new + i].block_id
            for i in range(num_new)
            for g in range(self.num_groups)
        ]

    def take_block_copies(self) -> tuple[tuple[int, int], ...]:
        """The (source, destination) block copies that allocations since the last call
        asked for, in order, and forgets them: the step being planned carries them, and the
        runner applies them before its forward (see the module docstring for why the source
        needs no hold)."""
        copies = tuple(self._copies)
        self._copies.clear()
        return copies

    def release_outside_window(self, request_id: str, next_position: int) -> int:
        """In each group with a window W (``sliding_window``, or a windowed group of
        ``group_windows``): releases the request's leading blocks that hold only positions
        before ``next_position - W + 1``, which no query from ``next_position`` on sees (the
        lowest position the request may compute again, rewinds included). They stay in its
        block list as the null block (its table keeps its layout; attention masks those
        positions). With prefix caching only registered blocks go, and stay findable at ref
        count 0; a block another request holds stays its. Returns how many blocks it released
        (0 without a window, for an unknown request, or when none left the window since the
        last call)."""
        groups = self._req_blocks.get(request_id)
        if not self.releases_blocks or not groups or not groups[0]:
            return 0
        done = self._req_released[request_id]
        count = 0
        for g, window in enumerate(self.group_windows):
            if window is None:
                continue
            end = self._first_in_window(window, next_position)
            if self.enable_prefix_caching:
                end = min(end, self._req_num_cached[request_id])
            start = done[g]
            if end <= start:
                continue
            blocks = groups[g]
            released = blocks[start:end]
            blocks[start:end] = [self._pool.blocks[NULL_BLOCK_ID]] * (end - start)
            self._pool.release(reversed(released))
            done[g] = end
            count += end - start
        return count

    def fills_new_block(self, request_id: str, num_known_tokens: int) -> bool:
        """Whether ``cache_blocks`` with ``num_known_tokens`` has a block to register: False
        while none of the request's blocks filled up since the last call (most decode steps),
        so a caller can skip building the token list; True for an unknown request (then
        ``cache_blocks`` raises). Always False with prefix caching disabled."""
        if not self.enable_prefix_caching:
            return False
        cached = self._req_num_cached.get(request_id)
        return cached is None or num_known_tokens // self.block_size > cached

    def cache_blocks(
        self, request_id: str, token_ids: Sequence[int], num_known_tokens: int
    ) -> None:
        """Registers the request's blocks that are now full of known tokens for reuse.

        Blocks covering ``token_ids[:num_known_tokens]`` completely get their hash
        (``num_known_tokens`` is computed minus in-flight placeholders under async
        scheduling). Incremental and idempotent: blocks registered by an earlier call are
        skipped, and a smaller ``num_known_tokens`` than before does nothing. A block whose
        hash another block already carries stays unhashed (the existing mapping is kept).
        No-op with prefix caching disabled.

        Raises:
            ValueError: for an unknown request, ``num_known_tokens`` outside
                ``0 .. len(token_ids)``, or known full blocks beyond the blocks the request
                holds.
        """
        if not self.enable_prefix_caching:
            return
        groups = self._req_blocks.get(request_id)
        if groups is None:
            raise ValueError(f"request {request_id!r} holds no blocks; allocate_slots first")
        if (
            type(num_known_tokens) is int
            and 0 <= num_known_tokens <= len(token_ids)
            and num_known_tokens // self.block_size <= self._req_num_cached[request_id]
        ):
            return  # no block filled up since the last call: most decode steps
        _check_count("num_known_tokens", num_known_tokens)
        if num_known_tokens > len(token_ids):
            raise ValueError(
                f"num_known_tokens ({num_known_tokens}) exceeds len(token_ids) ({len(token_ids)})"
            )
        num_full = num_known_tokens // self.block_size
        if num_full > len(groups[0]):
            raise ValueError(
                f"request {request_id!r} has {num_full} full blocks of known tokens but holds "
                f"only {len(groups[0])} blocks"
            )
        start = self._req_num_cached[request_id]
        bs = self.block_size
        for i in range(start, num_full):
            block_hash = self._block_hash(request_id, token_ids, i)
            parent = self._req_hashes[request_id][i - 1] if i else None
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            for g, blocks in enumerate(groups):
                key = group_key(block_hash, g)
                self._pool.cache_block(
                    blocks[i], key, None if parent is None else group_key(parent, g), tokens
                )
        if num_full > start:
            self._req_num_cached[request_id] = num_full

    def truncate(self, request_id: str, num_tokens: int) -> int:
        """Releases the request's tail blocks beyond those that hold ``num_tokens`` tokens
        (its slots past a rejected draft), tail first, in every group; returns how many block
        ids ``get_block_ids`` lists for it now.

        Released blocks were never full of known tokens, so none carries a prefix-cache hash.

        Raises:
            ValueError: for an unknown request, or ``num_tokens`` fewer than its registered
                (hashed) blocks hold.
        """
        _check_count("num_tokens", num_tokens)
        groups = self._req_blocks.get(request_id)
        if groups is None:
            raise ValueError(f"request {request_id!r} holds no blocks")
        keep = self.num_blocks_needed(num_tokens)
        if keep < self._req_num_cached[request_id]:
            raise ValueError(
                f"cannot truncate request {request_id!r} to {num_tokens} tokens: its first "
                f"{self._req_num_cached[request_id]} blocks are registered in the prefix cache"
            )
        released = max(self._req_released[request_id])
        if keep < released:
            raise ValueError(
                f"cannot truncate request {request_id!r} to {num_tokens} tokens: its first "
                f"{released} blocks were released past its window"
            )
        for blocks in groups:
            if keep < len(blocks):
                tail = blocks[keep:]
                del blocks[keep:]
                self._pool.release(reversed(tail))
        return len(groups[0]) * self.num_groups

    def free(self, request_id: str) -> None:
        """Releases the request's blocks and forgets its lookup and hashes.

        Blocks are released tail first, so a sequence's tail is evicted before its head;
        hashed blocks at ref count 0 stay findable until evicted. Unknown ids are a no-op.
        """
        self._pending_hits.pop(request_id, None)
        self._pending_partial.pop(request_id, None)
        self._req_hashes.pop(request_id, None)
        self._req_num_cached.pop(request_id, None)
        released = self._req_released.pop(request_id, None)
        groups = self._req_blocks.pop(request_id, None)
        for g, blocks in enumerate(groups or ()):
            assert released is not None
            self._pool.release(reversed(blocks[released[g] :]))

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block hash (e.g. after the weights change).

        Returns False and changes nothing while any request holds a block; True once
        cleared. Lookups recorded before a reset are stale: admit with a new lookup.
        """
        return self._pool.reset_prefix_cache()

    def check_invariants(self) -> None:
        """Cross-checks the pool with the per-request lists (O(num_blocks + held blocks)).

        Raises:
            AssertionError: naming the first disagreement (ref counts, free list, LRU,
                hash map, per-request progress).
        """
        self._pool.check_invariants()
        check_request_blocks(
            RequestBlocks(
                self.num_blocks,
                self.num_groups,
                self._req_blocks,
                self._req_released,
                self._req_num_cached,
                self._req_hashes if self.enable_prefix_caching else None,
            ),
            self._pool.blocks,
        )

    # --- internals --------------------------------------------------------------------

    def _block_hash(self, request_id: str, token_ids: Sequence[int], index: int) -> BlockHash:
        """The hash of the request's block ``index``, extending its hash chain as needed."""
        hashes = self._req_hashes.setdefault(request_id, [])
        bs = self.block_size
        while len(hashes) <= index:
            i = len(hashes)
            hashes.append(
                hash_block_tokens(hashes[-1] if hashes else None, token_ids[i * bs : (i + 1) * bs])
            )
        return hashes[index]

    def _take_hits(
        self, request_id: str, holds_blocks: bool, num_new_computed_tokens: int
    ) -> tuple[Blocks, list[int], KVCacheBlock | None]:
        """Resolves the recorded lookup's first hit blocks again (without taking them): per
        group the blocks to take and how many leading ones it leaves out (a windowed group
        of several: those before the window of the first position to compute); and the
        partial block's source when every token found is taken."""
        skipped = [0] * self.num_groups
        if not num_new_computed_tokens:
            return [[] for _ in self.group_windows], skipped, None
        if holds_blocks:
            raise ValueError(
                f"request {request_id!r} already holds blocks; num_new_computed_tokens is only "
                "for the first allocation after get_computed_blocks"
            )
        num_found = self._pending_hits.get(request_id, 0)
        partial = self._pending_partial.get(request_id)
        found = num_found * self.block_size + (partial[1] if partial else 0)
        num_hits, shared = divmod(num_new_computed_tokens, self.block_size)
        if num_new_computed_tokens > found:
            raise ValueError(
                f"num_new_computed_tokens ({num_new_computed_tokens}) exceeds the {found} "
                f"tokens get_computed_blocks found for request {request_id!r}"
            )
        if shared and num_new_computed_tokens != found:
            raise ValueError(
                f"num_new_computed_tokens ({num_new_computed_tokens}) must be a multiple of "
                f"block_size ({self.block_size}) or all {found} tokens found"
            )
        hits: Blocks = []
        hashes = self._req_hashes.get(request_id, [])[:num_hits]
        for g, window in enumerate(self.group_windows):
            if window is not None and self.num_groups > 1:
                skipped[g] = self._first_in_window(window, num_hits * self.block_size)
            group_hits = []
            for block_hash in hashes[skipped[g] :]:
                block = self._cached(block_hash, g)
                if block is None:
                    raise _stale(request_id, "a hit block was evicted since")
                group_hits.append(block)
            hits.append(group_hits)
        source = None
        if shared:
            assert partial is not None
            source = self._pool.get_cached_block(partial[0])
            if source is None:
                raise _stale(request_id, "the block it shares tokens with was evicted since")
        return hits, skipped, source
