"""The longest sequence one request can always complete alone in the paged KV cache.

A request that needs more blocks than the whole cache holds would wait for them forever: with
nothing else running the scheduler has nothing to preempt. The engine therefore lowers
``max_model_len`` to what a lone request can always hold (``lone_request_limit``), and the
scheduler refuses, with an error, a lone request that still finds no room.

The rule, per KV cache group (``kv_layout.py``), for one sequence of at most T tokens:

- a full-attention group holds every block: ``ceil(T / block_size)``;
- a windowed group (window W) holds at most the blocks spanned by the positions from the
  first one a query still sees to the end of the step's tokens. Before a step the scheduler
  releases the blocks wholly before ``p - W + 1``, p being the lowest position the request
  may compute again; the step then adds up to ``max_num_batched_tokens`` tokens (a prefill
  chunk, or a token and its drafts). Under async scheduling p trails the computed tokens by
  the tokens in flight (one, and a step's drafts), and with prefix caching only blocks
  already registered go back, which trails by a step's chunk after admission. So the group
  holds the blocks of ``span`` consecutive positions (``StepShape.window_span``), and
  ``span`` positions fall in at most ``ceil((span - 1) / block_size) + 1`` blocks; never more
  than the sequence's own ``ceil(T / block_size)``. One exception: a model of one windowed
  group takes every prefix-cache hit block at admission (they go at the next step's
  release), so a lone request whose hits do not fit is admitted without them
  (``Scheduler._allocate_alone``).

Every group draws from one pool of ``num_blocks - 1`` usable blocks (block 0 is the null
block), so a sequence of T tokens fits alone when the groups' blocks together are at most
that. A model whose every group is windowed fits any length once its window's blocks fit.
The scheduler asks a request's blocks for at most ``max_model_len`` tokens (the last token's
keys are never written, which leaves the slot a step planned ahead takes; drafts take the
slots that are left, or none).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from baton.engine.config import EngineConfig


@dataclass(frozen=True)
class StepShape:
    """What one scheduler step may add to a request's blocks, and how far releases trail.

    Attributes:
        max_num_batched_tokens: a step's token budget (a prefill chunk's largest size).
        num_speculative_tokens: drafts per step (0 without speculative decoding).
        async_scheduling: steps are planned one ahead (tokens in flight).
        prefix_caching: only registered blocks are released past a window.
    """

    max_num_batched_tokens: int
    num_speculative_tokens: int = 0
    async_scheduling: bool = False
    prefix_caching: bool = False

    @classmethod
    def of(cls, config: EngineConfig) -> StepShape:
        """The step shape of an engine built with ``config``."""
        spec = config.speculative_config
        return cls(
            config.max_num_batched_tokens,
            spec.num_speculative_tokens if spec is not None else 0,
            bool(config.async_scheduling),
            bool(config.enable_prefix_caching),
        )

    def window_span(self, window: int) -> int:
        """The most consecutive positions whose blocks a group of this window holds for one
        sequence after a step's allocation (see the module docstring)."""
        chunk = self.max_num_batched_tokens
        if not self.async_scheduling:
            return window - 1 + chunk
        # One token in flight and its step's drafts past the lowest position to compute again;
        # with prefix caching the blocks of the chunk planned before the last update stay.
        trail = window + self.num_speculative_tokens
        if self.prefix_caching:
            trail = max(trail, chunk)
        return trail + chunk


def blocks_of_span(span: int, block_size: int) -> int:
    """The most blocks that ``span`` consecutive positions fall in (1 for one position)."""
    return -(-(span - 1) // block_size) + 1


def sequence_blocks(
    group_windows: Sequence[int | None], num_tokens: int, block_size: int, step: StepShape
) -> int:
    """The most pool blocks one sequence of up to ``num_tokens`` tokens holds at once, over
    every group (``group_windows``: each group's window, None for full attention)."""
    whole = -(-num_tokens // block_size)
    total = 0
    for window in group_windows:
        if window is None:
            total += whole
        else:
            total += min(whole, blocks_of_span(step.window_span(window), block_size))
    return total


def lone_request_limit(
    group_windows: Sequence[int | None], num_blocks: int, block_size: int, step: StepShape
) -> int | None:
    """The longest sequence (tokens, a multiple of ``block_size``) that one request alone
    can always complete in ``num_blocks`` blocks (block 0 reserved): the most tokens whose
    ``sequence_blocks`` fit the pool; None when any length fits (every group windowed and
    within its window's bound). Pure arithmetic."""
    usable = num_blocks - 1
    if all(w is not None for w in group_windows):
        spans = [blocks_of_span(step.window_span(w), block_size) for w in group_windows if w]
        if sum(spans) <= usable:
            return None
    # sequence_blocks grows with the length: the longest that fits, by bisection on blocks.
    low, high = 0, usable
    while low < high:
        mid = (low + high + 1) // 2
        if sequence_blocks(group_windows, mid * block_size, block_size, step) <= usable:
            low = mid
        else:
            high = mid - 1
    return low * block_size


def refusal_message(
    request_id: str, num_tokens: int, num_blocks: int, block_size: int, max_model_len: int
) -> str:
    """The error of a request whose ``num_tokens`` tokens find no blocks while it runs alone."""
    return (
        f"the KV cache cannot hold request {request_id!r} even alone: its {num_tokens} "
        f"tokens need more than the {num_blocks - 1} usable blocks of {block_size} tokens "
        f"(max_model_len {max_model_len}); raise kv_cache_memory_bytes (or num_kv_blocks) or "
        "lower max_model_len"
    )
