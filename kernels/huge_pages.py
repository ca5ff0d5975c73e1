"""Host buffers on transparent huge pages, for weights a CPU decode step streams.

Why: a batch-1 CPU decode step reads every weight once, in order. On 4 KiB pages that is a
TLB miss every 4 KiB, and the hardware prefetchers stop at each page's end; on 2 MiB pages
neither happens. Measured on the 1B-shape Q4_K_M model kept in its blocks (AMD EPYC Genoa, 2
threads, a step's 64 one-row projections and its LM head, 25 interleaved rounds, medians):
29.6 ms a step on 4 KiB pages, 25.8 ms with the same bytes copied to huge pages.

Linux only grants huge pages to memory that asks (``madvise(MADV_HUGEPAGE)`` where
``/sys/kernel/mm/transparent_hugepage/enabled`` is "madvise", the common default) and only for
whole 2 MiB ranges aligned to 2 MiB; a plain allocation of a large tensor is neither.
"""

from __future__ import annotations

import contextlib
import mmap

import torch

HUGE_PAGE = 2 << 20
"""The huge page size asked for (x86-64's PMD size)."""


def huge_page_zeros(nbytes: int) -> torch.Tensor:
    """A zero-filled uint8 CPU tensor of ``nbytes`` whose whole 2 MiB ranges may be backed by
    transparent huge pages: fresh anonymous memory, aligned to 2 MiB, with those ranges (and
    not the tail, which would round the resident size up by as much as 2 MiB) advised
    ``MADV_HUGEPAGE``. Nothing is resident until written. Where the platform has no such
    advice (not Linux) or ``nbytes`` < 2 MiB: ``torch.zeros``. The kernel may still refuse huge
    pages (THP "never", fragmented memory); the tensor is then on small pages, as otherwise.

    The tensor's storage is the whole mapping (2 MiB more than ``nbytes``, never touched);
    it is unmapped when the last view of it is freed.

    Raises:
        ValueError: nbytes < 0.
    """
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < HUGE_PAGE or advice is None:
        return torch.zeros(nbytes, dtype=torch.uint8)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping
    start = -whole.data_ptr() % HUGE_PAGE
    with contextlib.suppress(OSError):  # THP compiled out: small pages, as any allocation
        mapping.madvise(advice, start, nbytes // HUGE_PAGE * HUGE_PAGE)
    return whole[start : start + nbytes]
