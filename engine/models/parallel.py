"""Tensor-parallel collectives of one rank, and the vocabulary-parallel embedding.

Every rank of a tensor-parallel group runs the same forward on its shard (see
``sharding.py``); they meet in ``torch.distributed`` collectives: an all-reduce after each
row-parallel projection (o_proj, down_proj) and after the embedding lookup, a gather of the LM
head's vocabulary slices to rank 0 (the only rank that samples), and a broadcast of rank 0's
sampled tokens (every rank keeps the request rows whose last token is the next input).
Collectives block until every rank has called them, in the same order, so every rank must run
the same steps: they all see the same ``SchedulerOutput``.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


class TensorParallel:
    """One rank's view of its group: who it is, and the collectives the model calls.

    Args:
        rank: this process's rank in the group (0 samples).
        size: ranks in the group (>= 2; a single rank needs no ``TensorParallel``).
        group: the ``torch.distributed`` process group; None = the default group, which must
            be initialised.

    ``collective_seconds`` accumulates the wall time spent inside collectives (waiting for the
    other ranks included), for measuring their share of a step.
    """

    def __init__(self, rank: int, size: int, group: Any = None) -> None:
        if size < 2 or not 0 <= rank < size:
            raise ValueError(f"need size >= 2 and 0 <= rank < size, got rank {rank} of {size}")
        self.rank, self.size, self.group = rank, size, group
        self.collective_seconds = 0.0

    @property
    def is_driver(self) -> bool:
        """Whether this rank samples (and answers the engine)."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums ``x`` over the ranks, in place; returns it."""
        t0 = time.perf_counter()
        dist.all_reduce(x, group=self.group)
        self.collective_seconds += time.perf_counter() - t0
        return x

    def gather_logits(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """The ranks' vocabulary slices ``[N, ceil(V / size)]`` joined into ``[N, V]`` on rank 0;
        other ranks get their own slice back (they send it and use nothing)."""
        t0 = time.perf_counter()
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)] if self.is_driver else None
        dist.gather(local, parts, dst=0, group=self.group)
        self.collective_seconds += time.perf_counter() - t0
        if parts is None:
            return local
        return torch.cat(parts, dim=1)[:, :vocab_size]

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` written into every rank's ``x`` (same shape and dtype); returns it."""
        t0 = time.perf_counter()
        dist.broadcast(x, src=0, group=self.group)
        self.collective_seconds += time.perf_counter() - t0
        return x


class VocabParallelEmbedding(nn.Embedding):
    """An embedding that holds rows ``[rank * rows, (rank + 1) * rows)`` of the vocabulary:
    each rank looks up the ids it holds (zeros for the others) and the all-reduce completes
    every row."""

    def __init__(self, rows: int, dim: int, tp: TensorParallel) -> None:
        super().__init__(rows, dim)
        self.tp = tp
        self.start = tp.rank * rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = super().forward(local.masked_fill(outside, 0))
        out.masked_fill_(outside[:, None], 0)
        return self.tp.all_reduce(out)
