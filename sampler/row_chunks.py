"""How many rows of a ``[rows, vocab]`` tensor the CPU sampler handles per pass.

A whole batch's temporaries (64 rows x 49152 tokens: 12.5 MB in float32, 25 MB in float64)
are allocated and freed every step, and glibc serves allocations that big with fresh
mappings whose pages fault in again each time; a float64 CDF of that size took 12.8 ms, four
rows at a time 1.7 ms (AMX Xeon). Chunks of about 1.5 MB stay on the heap and in the cache.
The sampler's per-row work is independent of the other rows (no cross-row reductions), so
chunking never changes a value. On CUDA everything runs in one pass.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

CHUNK_BYTES = 3 << 19


def rows_per_pass(tensor: torch.Tensor, itemsize: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Rows of ``tensor`` (``[rows, vocab]``) to handle per pass when each of its values takes
    ``itemsize`` bytes in the temporaries, about ``chunk_bytes`` a pass: all of them on
    CUDA."""
    rows, vocab = tensor.shape
    if tensor.is_cuda:
        return max(rows, 1)
    return max(1, chunk_bytes // (itemsize * max(vocab, 1)))


def row_slices(tensor: torch.Tensor, itemsize: int, chunk_bytes: int = CHUNK_BYTES) -> list[slice]:
    """The row ranges of ``tensor`` to handle one pass each (``rows_per_pass`` rows): a single
    range over every row where one pass holds them all (always on CUDA)."""
    step = rows_per_pass(tensor, itemsize, chunk_bytes)
    return [slice(i, i + step) for i in range(0, max(tensor.shape[0], 1), step)]


def cat_row_chunks(
    fn: Callable[[slice], torch.Tensor],
    tensor: torch.Tensor,
    itemsize: int,
    chunk_bytes: int = CHUNK_BYTES,
) -> torch.Tensor:
    """``fn`` (which takes a row range of ``tensor``) over each range of ``row_slices``, the
    results concatenated; one call with every row (``slice(None)``) where one pass holds
    them all."""
    parts = row_slices(tensor, itemsize, chunk_bytes)
    if len(parts) == 1:
        return fn(slice(None))
    return torch.cat([fn(part) for part in parts])
