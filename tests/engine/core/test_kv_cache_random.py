"""Random operations on the KV cache block manager, with the KV contents simulated: every
prefix hit (whole blocks and the copied part of a block) holds the request's own tokens."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from baton.engine.core.kv_cache_manager import KVCacheManager

BS = 4


class KVCacheMachine(RuleBasedStateMachine):
    """A toy scheduler over a small cache that also simulates the KV contents.

    ``content[block_id][slot]`` stands for the KV a "device" wrote there: the token and all
    tokens before it (a KV entry depends on its whole prefix), so every prefix hit can be
    checked against the request's actual tokens.
    """

    NUM_BLOCKS = 11

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(self.NUM_BLOCKS, BS)
        self.content: dict[int, list[tuple[int, ...] | None]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.running: set[str] = set()
        self.next_id = 0

    def _write(self, rid: str, start: int, end: int) -> None:
        ids = self.kv.get_block_ids(rid)
        for pos in range(start, end):
            slot = self.content.setdefault(ids[pos // BS], [None] * BS)
            slot[pos % BS] = tuple(self.tokens[rid][: pos + 1])

    def _check_prefix(self, rid: str, num_tokens: int) -> None:
        ids = self.kv.get_block_ids(rid)
        for pos in range(num_tokens):
            assert self.content[ids[pos // BS]][pos % BS] == tuple(self.tokens[rid][: pos + 1])

    @rule(
        # Few distinct prompts and a tiny alphabet, so prefixes are shared and blocks repeat.
        base=st.sampled_from(
            [(), (1, 2, 3, 4, 5, 6, 7, 8, 9), (1, 2, 3, 4, 1, 2, 3, 4), (5, 1, 2, 3, 4)]
        ),
        suffix=st.lists(st.integers(0, 2), max_size=10),
    )
    def add(self, base: tuple[int, ...], suffix: list[int]) -> None:
        tokens = list(base) + suffix
        if tokens:
            rid = f"r{self.next_id}"
            self.next_id += 1
            self.tokens[rid] = tokens
            self.computed[rid] = 0

    @precondition(lambda self: len(self.running) < len(self.tokens))
    @rule(data=st.data(), lookahead=st.integers(0, 2), use_hits=st.sampled_from([0, 1, 2]))
    def admit(self, data: st.DataObject, lookahead: int, use_hits: int) -> None:
        rid = data.draw(st.sampled_from(sorted(set(self.tokens) - self.running)))
        tokens = self.tokens[rid]
        hit = self.kv.get_computed_blocks(rid, tokens)
        assert hit < len(tokens)
        take = (0, hit // BS * BS, hit)[use_hits]  # none, full blocks only, or everything
        chunk = data.draw(st.integers(1, len(tokens) - take))
        free_before = self.kv.num_free_blocks
        new = self.kv.allocate_slots(rid, take + chunk + lookahead, take)
        if new is None:
            assert self.kv.num_free_blocks == free_before
            assert self.kv.get_block_ids(rid) == []
            return
        self.running.add(rid)
        # the step's copies run before its forward (the writes below)
        for src, dst in self.kv.take_block_copies():
            self.content[dst] = list(self.content[src])
        self._check_prefix(rid, take)
        self._write(rid, take, take + chunk)
        self.computed[rid] = take + chunk
        self.kv.cache_blocks(rid, tokens, self.computed[rid])

    @precondition(lambda self: self.running)
    @rule(data=st.data(), lookahead=st.integers(0, 2), placeholders=st.integers(0, 1))
    def step(self, data: st.DataObject, lookahead: int, placeholders: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
        tokens = self.tokens[rid]
        if self.computed[rid] == len(tokens):
            tokens.append(data.draw(st.integers(0, 3)))  # a sampled token
        chunk = data.draw(st.integers(1, len(tokens) - self.computed[rid]))
        end = self.computed[rid] + chunk
        new = self.kv.allocate_slots(rid, end + lookahead)
        if new is None:  # preempt by recompute
            self.kv.free(rid)
            self.running.discard(rid)
            self.computed[rid] = 0
            return
        self._write(rid, self.computed[rid], end)
        self.computed[rid] = end
        known = max(end - placeholders, 0)
        self.kv.cache_blocks(rid, tokens, known)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.kv.free(rid)
        self.running.discard(rid)
        del self.tokens[rid], self.computed[rid]

    @rule()
    def reset(self) -> None:
        assert self.kv.reset_prefix_cache() is (not self.running)

    @invariant()
    def consistent(self) -> None:
        self.kv.check_invariants()
        held = {b for rid in self.running for b in self.kv.get_block_ids(rid)}
        assert self.kv.num_used_blocks == len(held)
        assert self.kv.num_free_blocks == self.NUM_BLOCKS - 1 - len(held)

    def teardown(self) -> None:
        for rid in list(self.tokens):
            self.kv.free(rid)
        self.kv.check_invariants()
        assert self.kv.num_used_blocks == 0
        assert self.kv.num_free_blocks == self.NUM_BLOCKS - 1
        assert self.kv.usage == 0.0


KVCacheMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_kv_cache_random_operations = KVCacheMachine.TestCase
