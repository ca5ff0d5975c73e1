"""An engine's GGUF-kept weights moved onto huge pages while it is idle.

Why: a batch-1 CPU decode step streams every weight, and on 2 MiB pages it streams them
faster (``kernels/huge_pages.py``). Faulting fresh huge pages in can be slow: on the sandbox
VM (whose host reclaims free memory, so each fresh 2 MiB page faults in the host) repacking
the 1B-shape Q4_K_M file straight onto huge pages made ``LLM()`` take 3.8-4.9 s instead of
2.0-3.5 s, and a server took 6.4-7.3 s to be ready where it takes 4.9 s with the moves
deferred. So the loader repacks onto plain pages (a worker process gets its weights in shared
memory, which gets no huge pages where ``shmem_enabled`` is "never", the common default), and
the weights move afterwards, a slice at a time, while the engine or worker has nothing else
to do: a step never waits for more than one slice.

A moved weight's tensor is re-pointed in place (``Tensor.set_``), between steps (the CPU
kernels have returned; nothing holds its old address), so every holder of the tensor object
(the model's projections, the fused decode layers) reads the new pages from the next step
on, the same bytes. Then its old pages are released (a worker's shared ones by its callback;
in the engine's process they go with their last reference): the weight is held once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from baton.kernels.huge_pages import huge_page_zeros

logger = logging.getLogger(__name__)

SLICE_BYTES = 8 << 20
"""Bytes copied per ``move_slice`` call (about 5-20 ms here, faults included): how long a
message that arrives meanwhile may wait."""


class WeightPageMover:
    """Moves 1-D uint8 weight tensors onto memory advised for huge pages, largest first, one
    ``SLICE_BYTES`` slice per call. Each move ends by ``Tensor.set_`` onto the copy, then its
    ``release`` callback (which frees the old pages).

    Args:
        moves: (tensor, release) pairs; the tensors are contiguous 1-D uint8.

    Raises:
        ValueError: a tensor that is not contiguous 1-D uint8.
    """

    def __init__(self, moves: Sequence[tuple[torch.Tensor, Callable[[], None]]]) -> None:
        for tensor, _ in moves:
            if tensor.dtype != torch.uint8 or tensor.dim() != 1 or not tensor.is_contiguous():
                raise ValueError(
                    f"a weight to move must be contiguous 1-D uint8, got {tensor.dtype} "
                    f"{tuple(tensor.shape)}"
                )
        # largest last: popped first (the LM head's gain comes soonest)
        self._todo = sorted(moves, key=lambda m: m[0].numel())
        self._copy: torch.Tensor | None = None
        self._done_bytes = 0
        self.moved = 0

    @property
    def pending(self) -> int:
        """Weights not moved yet (the one in progress included)."""
        return len(self._todo)

    def move_slice(self) -> None:
        """Copies the next slice of the weight in progress; on its last slice re-points the
        weight at the copy and releases the old pages. A no-op when nothing is pending. Where
        the memory for a copy cannot be had, gives up moving (logged once): the weights stay
        where they are, correct as before."""
        if not self._todo:
            return
        tensor, release = self._todo[-1]
        if self._copy is None:
            try:
                self._copy = huge_page_zeros(tensor.numel())
            except (OSError, MemoryError, RuntimeError) as exc:
                logger.warning("weights stay on their pages (no memory for a copy: %s)", exc)
                self._todo.clear()
                return
            self._done_bytes = 0
        end = min(tensor.numel(), self._done_bytes + SLICE_BYTES)
        self._copy[self._done_bytes : end].copy_(tensor[self._done_bytes : end])
        self._done_bytes = end
        if end < tensor.numel():
            return
        with torch.no_grad():
            tensor.set_(self._copy)
        release()
        self._todo.pop()
        self._copy = None
        self.moved += 1
