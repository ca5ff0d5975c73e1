"""CUDA graphs of the decode forward: one launch per step instead of one per kernel.

A small model's decode step on a GPU is bound by launching its kernels from Python, not by
the GPU (an H200 spent about 20 ms per step on SmolLM2-135M's shape at every batch from 1 to
64, `bench/gpu_check.py`). So, as vLLM and SGLang do, the runner captures the forward of a
pure-decode batch (one new token per sequence) once per batch size at startup and replays it.

A graph reads fixed device buffers: input ids, positions, the KV slot each token writes, each
sequence's length and block table. A step of B sequences takes the smallest captured size
P >= B; its P - B pad rows write their keys and values into the null block (block 0, never
handed out: ``core/block_pool.py``) and attend to one key there, and their outputs are
dropped. Attention runs over the block tables (`AttentionMetadata.decode`), whose shapes do not
depend on the sequences' lengths, so one graph serves every context length.

Everything about a step's padding is host arithmetic (`DecodePadding.of`), tested on the CPU;
until `DecodeGraphs.capture` has run (never, without CUDA) it runs the same buffers eagerly.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from baton.engine.models.attention import AttentionMetadata
from baton.engine.models.llama import KVCache, LlamaForCausalLM
from baton.engine.worker.device_buffers import DeviceIO

log = logging.getLogger(__name__)

# The batch sizes captured, as vLLM's defaults: every size up to 8 costs a whole graph, past it
# padding to the next multiple of 8 (then 16, 32) wastes little.
_SIZES = (1, 2, 4, *range(8, 64, 8), *range(64, 128, 16), *range(128, 513, 32))
MAX_CAPTURE_SIZE = _SIZES[-1]
"""Decode steps of more sequences than this run eagerly."""

NULL_SLOT = 0
"""The KV slot pad rows write to: offset 0 of the null block."""


def capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The batch sizes to capture for an engine of ``max_num_seqs``: the default sizes up to
    the first one that holds ``max_num_seqs`` (so every decode step has a graph when
    ``max_num_seqs`` <= `MAX_CAPTURE_SIZE`).

    Raises:
        ValueError: ``max_num_seqs`` < 1.
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    top = next((s for s in _SIZES if s >= max_num_seqs), MAX_CAPTURE_SIZE)
    return tuple(s for s in _SIZES if s <= top)


@dataclass(frozen=True)
class DecodePadding:
    """A pure-decode step laid out for the graph of ``size`` rows (host arrays, int64).

    Attributes:
        size: the captured batch size used (>= the step's sequences).
        num_seqs: the step's sequences B; rows B.. are padding.
        positions, slots, seq_lens: ``[size]``; pad rows hold 0, `NULL_SLOT` and 1.
        tables: ``[B, width]``, the sequences' block tables up to the longest one's last block
            (pad rows keep whatever their buffer rows held: valid ids, of which they read one
            key that is dropped).
    """

    size: int
    num_seqs: int
    positions: np.ndarray
    slots: np.ndarray
    seq_lens: np.ndarray
    tables: np.ndarray

    @classmethod
    def of(
        cls,
        sizes: Sequence[int],
        seq_lens: np.ndarray,
        block_tables: np.ndarray,
        block_size: int,
    ) -> DecodePadding | None:
        """The padded layout of a decode step whose sequence b has ``seq_lens[b]`` tokens
        after this step (its new token at position ``seq_lens[b] - 1``), for ``sizes`` in
        ascending order; None when the step has more sequences than the largest size.

        Raises:
            ValueError: no sequences, a length < 1, or tables too short for the lengths.
        """
        lens = np.asarray(seq_lens, dtype=np.int64)
        tables = np.asarray(block_tables, dtype=np.int64)
        n = lens.shape[0]
        if n == 0 or (lens < 1).any():
            raise ValueError("a decode step needs at least one sequence, each of length >= 1")
        width = -(-int(lens.max()) // block_size)
        if tables.ndim != 2 or tables.shape[0] != n or tables.shape[1] < width:
            raise ValueError(f"block_tables must be [{n}, >= {width}], got {tables.shape}")
        at = bisect.bisect_left(sizes, n)
        if at == len(sizes):
            return None
        size = sizes[at]
        pos = lens - 1
        slots = tables[np.arange(n), pos // block_size] * block_size + pos % block_size
        pad = size - n
        return cls(
            size=size,
            num_seqs=n,
            positions=np.concatenate([pos, np.zeros(pad, np.int64)]),
            slots=np.concatenate([slots, np.full(pad, NULL_SLOT, np.int64)]),
            seq_lens=np.concatenate([lens, np.ones(pad, np.int64)]),
            tables=np.ascontiguousarray(tables[:, :width]),
        )


class DecodeGraphs:
    """Static decode buffers and, on CUDA, one captured forward per batch size.

    Build it with the model, its KV cache and the runner's `DeviceIO`, then `capture` once
    (after the weights are in place; the graphs read the weights and caches where they are).
    `forward` runs one padded decode step and returns the hidden states of its real rows.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: KVCache,
        io: DeviceIO,
        sizes: Sequence[int],
        max_blocks: int,
        block_size: int,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.io = io
        self.sizes = tuple(sorted(sizes))
        self.block_size = block_size
        top, dev = self.sizes[-1], io.device
        with io.on_stream():
            # Zero-filled: every pad row starts as a valid token in the null block.
            self._input_ids = torch.zeros(top, dtype=torch.int64, device=dev)
            self._positions = torch.zeros(top, dtype=torch.int64, device=dev)
            self._slots = torch.full((top,), NULL_SLOT, dtype=torch.int64, device=dev)
            self._seq_lens = torch.ones(top, dtype=torch.int64, device=dev)
            self._tables = torch.zeros(top, max_blocks, dtype=torch.int64, device=dev)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0

    @property
    def captured(self) -> bool:
        """Whether CUDA graphs were captured (else `forward` runs the buffers eagerly)."""
        return bool(self._graphs)

    def _forward(self, size: int) -> torch.Tensor:
        meta = AttentionMetadata.decode(
            self._slots[:size], self._seq_lens[:size], self._tables[:size]
        )
        return self.model(self._input_ids[:size], self._positions[:size], self.kv_caches, meta)

    @torch.inference_mode()
    def capture(self) -> float:
        """Captures one graph per size, largest first, sharing one memory pool; returns the
        seconds it took. Each size runs twice eagerly first (Triton compiles, cuBLAS picks its
        kernels). Writes only into the null block.

        Raises:
            RuntimeError: not on a CUDA device, or a capture failed.
        """
        if self.io.stream is None:
            raise RuntimeError("CUDA graphs need a CUDA device")
        t0 = time.perf_counter()
        pool = None
        with self.io.on_stream():
            for size in reversed(self.sizes):
                for _ in range(2):
                    self._forward(size)
                torch.cuda.current_stream().synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=self.io.stream):
                    out = self._forward(size)
                pool = graph.pool()
                self._graphs[size] = (graph, out)
            torch.cuda.current_stream().synchronize()
        seconds = time.perf_counter() - t0
        log.info(
            "captured %d CUDA graphs of the decode forward in %.1f s", len(self.sizes), seconds
        )
        return seconds

    def forward(self, pad: DecodePadding, input_ids: torch.Tensor) -> torch.Tensor:
        """Runs one decode step (queued on the runner's stream, inside its ``on_stream``):
        copies the step's values into the buffers, replays the graph of ``pad.size`` (or runs
        the buffers eagerly when nothing was captured) and returns the hidden states of the
        real rows ``[pad.num_seqs, hidden]``, a tensor of their own (the graph's output buffer
        is reused by the next step).

        Args:
            pad: the step's layout, from `DecodePadding.of` over ``self.sizes``.
            input_ids: the step's ``[pad.num_seqs]`` input ids, on the device.
        """
        n, size = pad.num_seqs, pad.size
        positions, slots, seq_lens, tables = self.io.to_device(
            [pad.positions, pad.slots, pad.seq_lens, pad.tables]
        )
        self._input_ids[:n].copy_(input_ids)
        self._positions[:size].copy_(positions)
        self._slots[:size].copy_(slots)
        self._seq_lens[:size].copy_(seq_lens)
        self._tables[:n, : tables.shape[1]].copy_(tables)
        entry = self._graphs.get(size)
        if entry is None:
            return self._forward(size)[:n].clone()
        graph, out = entry
        graph.replay()
        self.replays += 1
        return out[:n].clone()
