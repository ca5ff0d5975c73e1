"""CUDA graphs of the decode forward: one launch per step instead of one per kernel.

A small model's decode step on a GPU is bound by launching its kernels from Python, not by
the GPU (an H200 spent about 20 ms per step on SmolLM2-135M's shape at every batch from 1 to
64, `bench/gpu/gpu_check.py`). So, as vLLM and SGLang do, the runner captures the forward of a
pure-decode batch (one new token per sequence) once per batch size at startup and replays it.

A graph reads fixed device buffers: each sequence's row in the runner's token table and position
(its input id is gathered from the table inside the graph), the KV slot each token writes, each
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
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from baton.engine.models.attention import AttentionMetadata
from baton.engine.models.kv_cache import KVCache
from baton.engine.models.llama import LlamaForCausalLM
from baton.engine.worker.device_buffers import DeviceIO
from baton.kernels.step_state import gather_input_ids

log = logging.getLogger(__name__)

# The batch sizes captured, as vLLM's defaults: every size up to 8 costs a whole graph, past it
# padding to the next multiple of 8 (then 16, 32) wastes little.
_SIZES = (1, 2, 4, *range(8, 64, 8), *range(64, 128, 16), *range(128, 513, 32))
MAX_CAPTURE_SIZE = _SIZES[-1]
"""Decode steps of more sequences than this run eagerly."""

NULL_SLOT = 0
"""The KV slot pad rows write to: offset 0 of the null block."""

GRAPH_COPIES_ENV = "BATON_DECODE_GRAPH_COPIES"
"""Experimental: graphs captured per batch size, replayed in turn (default 1). On the H200 a
replay cost 8 us alone but 0.5 ms in the engine's loop; if a launch waits for the previous run
of the same graph, two copies in turn do not (``bench/gpu/gpu_profile.py`` measures both)."""


def graph_copies() -> int:
    """`GRAPH_COPIES_ENV` as an int >= 1 (1 when unset).

    Raises:
        ValueError: a value that is not an integer >= 1.
    """
    raw = os.environ.get(GRAPH_COPIES_ENV, "1")
    try:
        copies = int(raw)
    except ValueError:
        copies = 0
    if copies < 1:
        raise ValueError(f"{GRAPH_COPIES_ENV} must be an integer >= 1, got {raw!r}")
    return copies


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
        meta: ``[4 * size]``, the positions, slots, sequence lengths and token-table rows one
            after the other (the layout the graph of ``size`` reads, so that one copy fills
            them); pad rows hold 0, `NULL_SLOT`, 1 and 0.
        tables: ``[B, width]``, the sequences' block tables up to the longest one's last block
            (pad rows keep whatever their buffer rows held: valid ids, of which they read one
            key that is dropped).
    """

    size: int
    num_seqs: int
    meta: np.ndarray
    tables: np.ndarray

    @property
    def positions(self) -> np.ndarray:
        """``[size]`` positions of the new tokens."""
        return self.meta[: self.size]

    @property
    def slots(self) -> np.ndarray:
        """``[size]`` KV slots the new tokens write."""
        return self.meta[self.size : 2 * self.size]

    @property
    def seq_lens(self) -> np.ndarray:
        """``[size]`` sequence lengths after the step."""
        return self.meta[2 * self.size : 3 * self.size]

    @property
    def rows(self) -> np.ndarray:
        """``[size]`` rows of the token table the input ids are read from."""
        return self.meta[3 * self.size :]

    @classmethod
    def of(
        cls,
        sizes: Sequence[int],
        seq_lens: np.ndarray,
        block_tables: np.ndarray,
        block_size: int,
        rows: np.ndarray | None = None,
    ) -> DecodePadding | None:
        """The padded layout of a decode step whose sequence b has ``seq_lens[b]`` tokens
        after this step (its new token at position ``seq_lens[b] - 1``, read from row
        ``rows[b]`` of the token table; default: row b), for ``sizes`` in ascending order; None
        when the step has more sequences than the largest size.

        Raises:
            ValueError: no sequences, a length < 1, tables too short for the lengths, or rows
                not one per sequence.
        """
        lens = np.asarray(seq_lens, dtype=np.int64)
        tables = np.asarray(block_tables, dtype=np.int64)
        n = lens.shape[0]
        if n == 0 or (lens < 1).any():
            raise ValueError("a decode step needs at least one sequence, each of length >= 1")
        width = -(-int(lens.max()) // block_size)
        if tables.ndim != 2 or tables.shape[0] != n or tables.shape[1] < width:
            raise ValueError(f"block_tables must be [{n}, >= {width}], got {tables.shape}")
        token_rows = np.arange(n) if rows is None else np.asarray(rows, dtype=np.int64)
        if token_rows.shape != (n,):
            raise ValueError(f"rows must be [{n}], got {token_rows.shape}")
        at = bisect.bisect_left(sizes, n)
        if at == len(sizes):
            return None
        size = sizes[at]
        pos = lens - 1
        slots = tables[np.arange(n), pos // block_size] * block_size + pos % block_size
        meta = np.empty(4 * size, np.int64)
        meta[:n], meta[n:size] = pos, 0
        meta[size : size + n], meta[size + n : 2 * size] = slots, NULL_SLOT
        meta[2 * size : 2 * size + n], meta[2 * size + n : 3 * size] = lens, 1
        meta[3 * size : 3 * size + n], meta[3 * size + n :] = token_rows, 0
        return cls(size=size, num_seqs=n, meta=meta, tables=tables[:, :width])


class DecodeGraphs:
    """Static decode buffers and, on CUDA, one captured forward per batch size.

    Build it with the model, its KV cache and the runner's `DeviceIO`, then `capture` once
    (after the weights are in place; the graphs read the weights and caches where they are).
    `forward` runs one padded decode step and returns the hidden states of its real rows; it is
    `load` (the step's values into the buffers) then `run` (the replay).

    The graph of size P reads its positions, slots, lengths and token-table rows from
    ``meta[:4P]`` laid out as `DecodePadding.meta`, so one host-to-device copy fills them, and
    gathers its input ids from ``token_ids`` (the runner's token table, where sampled tokens
    are written on the device) itself; block tables have a buffer of their own. Without tensor
    parallelism the graph also runs the LM head, into one float32 logits buffer all sizes share
    (`logits`): a step then launches nothing of the model but the replay.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: KVCache,
        io: DeviceIO,
        sizes: Sequence[int],
        max_blocks: int,
        block_size: int,
        token_ids: torch.Tensor,
    ) -> None:
        self.model = model
        self.token_ids = token_ids
        self.kv_caches = kv_caches
        self.io = io
        self.sizes = tuple(sorted(sizes))
        self.block_size = block_size
        top, dev = self.sizes[-1], io.device
        with io.on_stream():
            # Zero-filled; `load` and `_pad_only` (before each capture) write whole layouts.
            self._input_ids = torch.zeros(top, dtype=torch.int64, device=dev)
            self._meta = torch.zeros(4 * top, dtype=torch.int64, device=dev)
            self._tables = torch.zeros(top, max_blocks, dtype=torch.int64, device=dev)
            # One buffer for every size (one graph runs at a time); a graph's own output would
            # keep [P, vocab] alive per captured size.
            self._logits = (
                torch.empty(top, model.config.vocab_size, dtype=torch.float32, device=dev)
                if model.tp is None
                else None
            )
        self.copies = graph_copies()
        self._graphs: dict[int, list[tuple[torch.cuda.CUDAGraph, torch.Tensor]]] = {}
        self.replays = 0

    @property
    def captured(self) -> bool:
        """Whether CUDA graphs were captured (else `forward` runs the buffers eagerly)."""
        return bool(self._graphs)

    def _forward(self, size: int) -> torch.Tensor:
        positions, slots, seq_lens, rows = self._meta[: 4 * size].view(4, size)
        input_ids = gather_input_ids(self.token_ids, rows, positions, self._input_ids[:size])
        meta = AttentionMetadata.decode(slots, seq_lens, self._tables[:size])
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        if self._logits is not None:
            self.model.compute_logits(hidden, out=self._logits[:size])
        return hidden

    def _pad_only(self, size: int) -> None:
        """Fills the buffers of ``size`` rows as pad rows (null block, length 1, row 0)."""
        self._meta[:size] = 0
        self._meta[size : 2 * size] = NULL_SLOT
        self._meta[2 * size : 3 * size] = 1
        self._meta[3 * size : 4 * size] = 0

    @torch.inference_mode()
    def capture(self) -> float:
        """Captures one graph per size (`copies` of each), largest first, sharing one memory
        pool (one graph runs at a time, in stream order); returns the seconds it took. Each
        size runs twice eagerly first (Triton compiles, cuBLAS picks its kernels). Writes only
        into the null block.

        Raises:
            RuntimeError: not on a CUDA device, or a capture failed.
        """
        if self.io.stream is None:
            raise RuntimeError("CUDA graphs need a CUDA device")
        t0 = time.perf_counter()
        pool = None
        with self.io.on_stream():
            for size in reversed(self.sizes):
                self._pad_only(size)
                for _ in range(2):
                    self._forward(size)
                torch.cuda.current_stream().synchronize()
                for _ in range(self.copies):
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=self.io.stream):
                        out = self._forward(size)
                    pool = graph.pool()
                    self._graphs.setdefault(size, []).append((graph, out))
            torch.cuda.current_stream().synchronize()
        seconds = time.perf_counter() - t0
        log.info(
            "captured %d CUDA graphs of the decode forward in %.1f s",
            len(self.sizes) * self.copies,
            seconds,
        )
        return seconds

    def graph(self, size: int) -> torch.cuda.CUDAGraph:
        """The captured graph of ``size`` rows (for benchmarks that time its replay).

        Raises:
            KeyError: no graph of that size was captured.
        """
        return self._graphs[size][0][0]

    @torch.inference_mode()
    def debug_dump(self, size: int, path: Path) -> None:
        """Captures the forward of ``size`` rows once more in debug mode and writes its node
        list (``cudaGraphDebugDotPrint``) to ``path``. Writes only into the null block, as
        `capture` does.

        Raises:
            RuntimeError: not on a CUDA device.
        """
        if self.io.stream is None:
            raise RuntimeError("CUDA graphs need a CUDA device")
        with self.io.on_stream():
            self._pad_only(size)
            torch.cuda.current_stream().synchronize()
            # Kept un-instantiated: with debug mode alone the H200's torch 2.11 had destroyed
            # the graph by the time of the dump (no file written).
            graph = torch.cuda.CUDAGraph(keep_graph=True)
            graph.enable_debug_mode()
            with torch.cuda.graph(graph, stream=self.io.stream):
                self._forward(size)
            torch.cuda.current_stream().synchronize()
        graph.debug_dump(str(path))

    def load(self, pad: DecodePadding, tables: torch.Tensor) -> None:
        """Queues the copies of one decode step's values into the buffers (on the runner's
        stream, inside its ``on_stream``): ``pad.meta`` from the host, ``tables`` (``pad.tables``
        on the device) from the device."""
        self.io.copy_into(self._meta[: 4 * pad.size], pad.meta)
        self._tables[: pad.num_seqs, : tables.shape[1]].copy_(tables)

    def run(self, pad: DecodePadding) -> torch.Tensor:
        """Replays the graph of ``pad.size`` over the loaded buffers (runs them eagerly when
        nothing was captured) and returns the hidden states of the real rows
        ``[pad.num_seqs, hidden]``: a view of the graph's output, valid until the next step is
        queued (read it, as the LM head does, before that); `logits` has the LM head's
        output."""
        entries = self._graphs.get(pad.size)
        if entries is None:
            return self._forward(pad.size)[: pad.num_seqs]
        graph, out = entries[self.replays % len(entries)]
        graph.replay()
        self.replays += 1
        return out[: pad.num_seqs]

    def logits(self, pad: DecodePadding) -> torch.Tensor | None:
        """The float32 logits ``[pad.num_seqs, vocab]`` the last `run` of ``pad`` computed (a
        view of the shared buffer, valid until the next step is queued; the sampler may write
        into it), or None when the graphs do not run the LM head (tensor parallelism)."""
        return None if self._logits is None else self._logits[: pad.num_seqs]

    def forward(self, pad: DecodePadding) -> torch.Tensor:
        """`load` then `run`: one decode step from its host layout."""
        (tables,) = self.io.to_device([pad.tables])
        self.load(pad, tables)
        return self.run(pad)
