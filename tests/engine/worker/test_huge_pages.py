"""kernels/huge_pages.py: weight buffers advised for transparent huge pages."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pytest
import torch

from baton.kernels.huge_pages import HUGE_PAGE, huge_page_zeros
from baton.kernels.quant_formats import FORMATS, repack
from baton.kernels.quant_linear import available_isas, repack_native

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _huge_page_share(tensor: torch.Tensor) -> float:
    """The share of ``tensor``'s bytes the process's page tables map with huge pages (Linux,
    ``/proc/self/smaps``: the ``AnonHugePages`` of the mappings it lies in, over their size;
    so an estimate where a mapping holds more than the tensor). 0.0 where unknown."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    try:
        with open("/proc/self/smaps") as f:
            lines = f.read().splitlines()
    except OSError:
        return 0.0
    huge = size = 0
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo < end and start < hi
            if inside:
                size += hi - lo
        elif inside and head == "AnonHugePages:":
            huge += int(line.split()[1]) * 1024
    return huge / size if size else 0.0


def _thp_mode() -> str | None:
    try:
        text = THP.read_text()
    except OSError:
        return None
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else None


@pytest.mark.parametrize("nbytes", [0, 1, HUGE_PAGE - 1, HUGE_PAGE, 3 * HUGE_PAGE + 4097])
def test_zeros_of_the_size_asked_and_writable(nbytes: int) -> None:
    t = huge_page_zeros(nbytes)
    assert t.dtype == torch.uint8 and t.dim() == 1 and t.numel() == nbytes and t.is_contiguous()
    assert not t.any()
    t.fill_(1)
    assert int(t.sum()) == nbytes


def test_large_buffers_start_on_a_huge_page_boundary() -> None:
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        pytest.skip("this platform has no MADV_HUGEPAGE")
    for nbytes in (HUGE_PAGE, 5 * HUGE_PAGE + 123):
        assert huge_page_zeros(nbytes).data_ptr() % HUGE_PAGE == 0


def test_negative_size_is_refused() -> None:
    with pytest.raises(ValueError, match="nbytes must be >= 0"):
        huge_page_zeros(-1)


def test_the_kernel_grants_huge_pages_where_asked() -> None:
    if not hasattr(mmap, "MADV_HUGEPAGE") or _thp_mode() not in ("always", "madvise"):
        pytest.skip(f"transparent huge pages not granted on request here ({_thp_mode()})")
    t = huge_page_zeros(8 * HUGE_PAGE)
    t.fill_(1)  # resident only once written
    assert _huge_page_share(t) > 0.0
    if _thp_mode() == "madvise":
        # A fresh anonymous mapping never advised, not a torch tensor: torch's allocator may
        # reuse heap memory some earlier test (or library) advised, which then holds huge
        # pages (CI saw 0.30 of a plain torch.ones so).
        plain_map = mmap.mmap(-1, 8 * HUGE_PAGE)
        plain = torch.frombuffer(plain_map, dtype=torch.uint8)
        plain.fill_(1)
        share = _huge_page_share(plain)
        del plain
        plain_map.close()
        assert share == 0.0


@pytest.mark.skipif(not available_isas(), reason="the C++ kernels need an x86-64 CPU")
def test_native_repack_of_a_large_weight_writes_the_numpy_bytes_on_huge_page_memory() -> None:
    fmt = FORMATS["Q4_0"]
    n, k = 2048 + 3, 2048  # > 2 MiB packed, and a partial last tile (its padding stays zero)
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(n, k // fmt.block_weights * fmt.block_bytes), dtype=np.uint8)
    expected = repack(raw, "Q4_0").data
    got = repack_native(raw, "Q4_0").data
    assert got.numel() == fmt.packed_nbytes(n, k) == expected.numel() > HUGE_PAGE
    assert torch.equal(got, expected)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert got.data_ptr() % HUGE_PAGE == 0


def test_shared_buffer_release_frees_whole_pages_of_a_range_and_keeps_the_rest() -> None:
    from baton.engine.worker.shared_memory import SharedBuffer, TensorLayout, pack_layouts

    page = mmap.PAGESIZE
    layouts, total = pack_layouts(
        {"a": (torch.uint8, (3 * page + 100,)), "b": (torch.uint8, (5 * page,))}
    )
    buf = SharedBuffer.create(total, "baton-test")
    a, b = buf.tensor(layouts["a"]), buf.tensor(layouts["b"])
    a.fill_(1)
    b.fill_(2)
    buf.release(layouts["b"])
    if hasattr(mmap, "MADV_REMOVE"):  # b's whole pages read back as zeros
        start = layouts["b"].offset
        first = -(-start // page) * page - start
        last = (start + layouts["b"].nbytes) // page * page - start
        assert not b[first:last].any()
        assert bool((b[:first] == 2).all()) and bool((b[last:] == 2).all())
    assert bool((a == 1).all())  # a's bytes, its last page shared with b's first included
    with pytest.raises(ValueError, match="past the buffer's end"):
        buf.release(TensorLayout(layouts["b"].offset, torch.uint8, (total,)))
    buf.close()


def test_page_mover_moves_largest_first_in_slices_and_releases_each_once() -> None:
    from baton.engine.worker import weight_pages
    from baton.engine.worker.weight_pages import WeightPageMover

    small = torch.arange(1000, dtype=torch.int64).to(torch.uint8)
    big = (torch.arange(2 * weight_pages.SLICE_BYTES + 5) % 251).to(torch.uint8)
    expected = {id(small): small.clone(), id(big): big.clone()}
    holders = {"small": small, "big": big}  # other holders of the same tensor objects
    released: list[str] = []
    mover = WeightPageMover(
        [(small, lambda: released.append("small")), (big, lambda: released.append("big"))]
    )
    old_big = big.data_ptr()
    assert mover.pending == 2
    mover.move_slice()
    mover.move_slice()
    assert big.data_ptr() == old_big and not released  # two of big's three slices
    mover.move_slice()
    assert big.data_ptr() != old_big and released == ["big"] and mover.pending == 1
    mover.move_slice()
    assert released == ["big", "small"] and mover.pending == 0 and mover.moved == 2
    mover.move_slice()  # nothing left: a no-op
    for t in holders.values():
        assert torch.equal(t, expected[id(t)])
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert big.data_ptr() % HUGE_PAGE == 0


def test_page_mover_refuses_what_it_cannot_move() -> None:
    from baton.engine.worker.weight_pages import WeightPageMover

    with pytest.raises(ValueError, match="contiguous 1-D uint8"):
        WeightPageMover([(torch.zeros(4, 4, dtype=torch.uint8), lambda: None)])
    with pytest.raises(ValueError, match="contiguous 1-D uint8"):
        WeightPageMover([(torch.zeros(4), lambda: None)])
