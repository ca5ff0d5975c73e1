"""How a model's layers share the paged KV cache: KV cache groups (vLLM's hybrid layout).

A model that mixes sliding-window layers with full-attention ones (Gemma 2 and 3, gpt-oss)
would need, with one block table for every layer, the whole context's blocks in its windowed
layers too. Instead its layers go into groups of one kind (full, or one window) and equal size
``num_slots``; each group has its own block ids (its own block table per request), all drawn
from one pool. The cache holds ``num_slots`` tensors of ``num_blocks`` blocks; slot j of every
group is stored in tensor j, so a block id, owned by one group at a time, means the same rows
in each tensor. A windowed group holds only about a window and a chunk of blocks per
request (the blocks wholly before its window go back to the pool), a full one the context.

A model of one kind has one group of all its layers (``num_slots`` = its layers): the cache is
exactly the one shared block table it always was.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheLayout:
    """Which KV cache group and tensor (slot) each layer uses.

    Attributes:
        group_windows: each group's attention window (None: full attention).
        layer_groups: the group of each layer.
        layer_slots: the cache tensor of each layer (its index within its group).
        num_slots: cache tensors (the largest group's layers): a block costs this many layers'
            keys and values.
    """

    group_windows: tuple[int | None, ...]
    layer_groups: tuple[int, ...]
    layer_slots: tuple[int, ...]
    num_slots: int

    @property
    def num_groups(self) -> int:
        """KV cache groups (1 for a model whose layers are all of one kind)."""
        return len(self.group_windows)


def kv_cache_layout(layer_windows: Sequence[int | None]) -> KVCacheLayout:
    """The groups of layers with these attention windows (None: full attention).

    Layers of one kind are cut into groups of ``num_slots`` layers, ``num_slots`` being the
    count of the rarer kind (so the rarer kind is one group and no slot of it is empty); a
    kind's last group may be shorter. One kind: one group of every layer.

    Raises:
        ValueError: for no layers, or more than two kinds (two different windows).
    """
    windows = tuple(layer_windows)
    if not windows:
        raise ValueError("a KV cache layout needs at least one layer")
    kinds = list(dict.fromkeys(windows))  # in order of first appearance
    if len(kinds) > 2 or (len(kinds) == 2 and None not in kinds):
        raise ValueError(
            f"layers of more than one window are not supported: {sorted(set(windows), key=str)}"
        )
    if len(kinds) == 1:
        n = len(windows)
        return KVCacheLayout((kinds[0],), (0,) * n, tuple(range(n)), n)
    by_kind = {k: [i for i, w in enumerate(windows) if w == k] for k in kinds}
    size = min(len(by_kind[k]) for k in kinds)
    groups = [0] * len(windows)
    slots = [0] * len(windows)
    group_windows: list[int | None] = []
    for kind in (None, *(k for k in kinds if k is not None)):  # full attention is group 0
        layers = by_kind[kind]
        for start in range(0, len(layers), size):
            for slot, layer in enumerate(layers[start : start + size]):
                groups[layer] = len(group_windows)
                slots[layer] = slot
            group_windows.append(kind)
    return KVCacheLayout(tuple(group_windows), tuple(groups), tuple(slots), size)
