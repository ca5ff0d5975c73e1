"""Whether a CPU GEMM gives a row the same bits at every row count, asked of the GEMM itself.

A request's logits must not depend on what else its step computes (the same-answer rule).
oneDNN's GEMMs, packed or not, reduce a row in one order whatever the row count from two rows
on, but a one-row call may take another kernel that reduces in another order. Measured on an
AMD EPYC Genoa (AVX512-BF16, torch 2.13, 1 and 2 threads): packed bfloat16 and float32 gave
a lone row other bits than the same row among 2-2048 rows whenever in_features exceeded 1024
(576 x 1536, 2048 x 2048, 2048 x 8192, ...), and the same bits at or below it; padded to two
rows, every shape gave every row the same bits at every row count and both thread counts.
Which kernel a shape gets depends on the CPU, the library and the thread count, so it is
asked here of each weight at load (``probe_rows``) rather than assumed, and a linear pads a
lone row to two only where the probe saw it differ (the pad, a ``torch.cat`` with a zero row,
cost 10-14 us a call here: about 0.3 ms a batch-1 step of the default model, whose down
projection alone needs it, against 2 ms for padding every linear).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

# Outputs compared per probe: a bfloat16 result rounds away most of an order change, so a
# lone row differs in only a few of its outputs (measured: 2-9 rows of 16 at 576-2048
# outputs a row); the probe compares rows enough that the outputs number about this many.
_PROBE_OUTPUTS = 65536
_MIN_PROBE_ROWS, _MAX_PROBE_ROWS = 8, 256


@dataclass(frozen=True)
class RowProbe:
    """What ``probe_rows`` saw of one GEMM.

    Attributes:
        lone_row_differs: a one-row call gave some row other bits than the same row among
            others: pad lone rows to two (``with_zero_row``).
        rows_differ: two calls with other row counts (from two rows on) or thread counts
            gave some row other bits: padding cannot make this GEMM batch-invariant.
    """

    lone_row_differs: bool
    rows_differ: bool


_probed: dict[tuple[object, ...], RowProbe] = {}


def probe_rows(
    matmul: Callable[[torch.Tensor], torch.Tensor],
    in_features: int,
    out_features: int,
    dtype: torch.dtype,
    key: tuple[object, ...],
) -> RowProbe:
    """Runs ``matmul`` (``[rows, in_features]`` -> ``[rows, out_features]``, ``dtype``) on
    seeded random rows, each alone, all together and in part, on one torch thread and on
    torch's current count (a CPU worker drops threads while the cores are busy,
    ``worker/cpu_threads.py``), and says which calls gave a row other bits. Remembered per
    ``key``, shape, dtype and thread count for the process (a model's layers share their
    probes). Logs a warning when even padding cannot help (``rows_differ``); the thread
    count is restored.
    """
    threads = torch.get_num_threads()
    full_key = (key, in_features, out_features, dtype, threads)
    if (known := _probed.get(full_key)) is not None:
        return known
    rows = max(_MIN_PROBE_ROWS, min(_MAX_PROBE_ROWS, -(-_PROBE_OUTPUTS // out_features)))
    gen = torch.Generator().manual_seed(20261207)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    half = rows // 2 + 1
    lone = rows_differ = False
    reference: torch.Tensor | None = None
    try:
        for count in sorted({1, threads}):
            torch.set_num_threads(count)
            with torch.no_grad():
                together = matmul(x)
                part = matmul(x[:half].contiguous())
                lone = lone or any(
                    not torch.equal(matmul(x[i : i + 1].contiguous()), together[i : i + 1])
                    for i in range(rows)
                )
            rows_differ = rows_differ or not torch.equal(part, together[:half])
            if reference is not None:
                rows_differ = rows_differ or not torch.equal(together, reference)
            reference = together
    finally:
        torch.set_num_threads(threads)
    if rows_differ:
        logger.warning(
            "the %s GEMM of %d -> %d features gives a row other bits at other row counts or "
            "thread counts on this CPU: a request's tokens may depend on the rest of its batch",
            dtype,
            in_features,
            out_features,
        )
    probe = RowProbe(lone_row_differs=lone, rows_differ=rows_differ)
    _probed[full_key] = probe
    return probe


def with_zero_row(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[1, in]`` with a row of zeros below it: a lone row padded so that a GEMM takes
    its many-row kernel (the caller keeps the first output row)."""
    return torch.cat((x, x.new_zeros(1, x.shape[1])))
