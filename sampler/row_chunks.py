"""How many rows of a ``[rows, vocab]`` tensor the CPU sampler handles per pass.

A whole batch's temporaries (64 rows x 49152 tokens: 12.5 MB in float32, 25 MB in float64)
are allocated and freed every step, and glibc serves allocations that big with fresh
mappings whose pages fault in again each time; a float64 CDF of that size took 12.8 ms, four
rows at a time 1.7 ms (AMX Xeon). Chunks of about 1.5 MB stay on the heap and in the cache.
The sampler's per-row work is independent of the other rows (no cross-row reductions), so
chunking never changes a value. On CUDA everything runs in one pass.
"""

from __future__ import annotations

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
