"""The runner's persistent pinned staging (engine/worker/device_buffers.py): the ring's
offsets and fences on the CPU, the copies themselves on CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from baton.engine.worker.device_buffers import (
    DeviceIO,
    PinnedStaging,
    StagingRing,
    packed_layout,
    torch_dtype,
    unpack,
)


class _Fence:
    """A fence that passes when told to, and counts the waits for it."""

    def __init__(self, passed: bool = False) -> None:
        self.passed = passed
        self.waited = 0

    def query(self) -> bool:
        return self.passed

    def synchronize(self) -> None:
        self.waited += 1
        self.passed = True


def _ring_of_running_copies(
    capacity: int, count: int, size: int
) -> tuple[StagingRing, list[_Fence]]:
    """A ring with ``count`` regions of ``size`` bytes taken, each held by a copy still running."""
    ring = StagingRing(capacity)
    fences = []
    for _ in range(count):
        ring.take(size)
        fences.append(_Fence())
        ring.hold(fences[-1])
    return ring, fences


def test_the_ring_hands_out_consecutive_regions_and_wraps_when_the_end_is_near():
    ring = StagingRing(100)
    assert ring.take(30) == 0
    ring.hold(_Fence(passed=True))
    assert ring.take(30) == 30
    ring.hold(_Fence(passed=True))
    assert ring.take(30) == 60
    ring.hold(_Fence(passed=True))
    assert ring.take(30) == 0  # 90 + 30 > 100: back to the start
    assert ring.waits == 0


def test_a_region_is_not_handed_out_again_before_its_copy_has_passed():
    ring, fences = _ring_of_running_copies(100, 3, 30)
    # Wraps onto the first region, whose copy is still running: it waits for that one only.
    assert ring.take(20) == 0
    assert [f.waited for f in fences] == [1, 0, 0]
    assert ring.waits == 1
    # The rest of that region is free now; the next one is still held.
    ring.hold(_Fence(passed=True))
    assert ring.take(10) == 20 and ring.waits == 1
    ring.hold(_Fence(passed=True))
    assert ring.take(10) == 30 and [f.waited for f in fences] == [1, 1, 0]


def test_waiting_for_the_newest_overlapping_copy_covers_the_older_ones():
    ring, fences = _ring_of_running_copies(90, 3, 30)
    assert ring.take(50) == 0  # overlaps regions 0 and 1
    assert fences[1].waited == 1 and fences[0].waited == 0
    assert not fences[2].passed
    # The regions waited for are free: the next take needs no other wait.
    fences[2].passed = True
    assert ring.take(40) == 50 and ring.waits == 1


def test_passed_copies_are_never_waited_for():
    ring = StagingRing(64)
    for _ in range(50):
        ring.take(24)
        ring.hold(_Fence(passed=True))
    assert ring.waits == 0


def test_the_ring_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match="capacity"):
        StagingRing(0)
    ring = StagingRing(16)
    with pytest.raises(ValueError, match="17 bytes"):
        ring.take(17)
    with pytest.raises(ValueError, match="-1 bytes"):
        ring.take(-1)


def test_packed_arrays_start_64_byte_aligned_and_unpack_to_their_values():
    arrays = [
        np.arange(3, dtype=np.int32),
        np.arange(6, dtype=np.int64).reshape(2, 3),
        np.array([0.5, -1.5], dtype=np.float32),
        np.array([True, False, True]),
        torch.arange(5, dtype=torch.int32),
    ]
    offsets, total = packed_layout(arrays)
    assert offsets == [0, 64, 128, 192, 256] and total == 320
    packed = torch.zeros(total, dtype=torch.uint8)
    for a, off in zip(arrays, offsets, strict=True):
        src = a if isinstance(a, torch.Tensor) else torch.from_numpy(a)
        packed[off : off + src.nbytes].view(src.dtype).view(src.shape).copy_(src)
    for a, got in zip(arrays, unpack(packed, arrays, offsets), strict=True):
        want = a if isinstance(a, torch.Tensor) else torch.from_numpy(a)
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_torch_dtype_maps_numpy_dtypes_and_keeps_torch_ones():
    assert torch_dtype(np.dtype(np.int64)) is torch.int64
    assert torch_dtype(np.dtype(np.float32)) is torch.float32
    assert torch_dtype(torch.int32) is torch.int32


def test_cpu_io_takes_mixed_dtypes_and_tensors_without_a_copy():
    io = DeviceIO.for_device("cpu")
    a, b, t = np.arange(4, dtype=np.int64), np.ones(2, np.float32), torch.arange(3)
    ta, tb, tt = io.to_device([a, b, t])
    assert ta.data_ptr() == a.ctypes.data and tb.dtype == torch.float32 and tt is t
    dst = torch.zeros(4, dtype=torch.int64)
    io.copy_into(dst, a)
    assert dst.tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="does not match"):
        io.copy_into(torch.zeros(3, dtype=torch.int64), a)
    with pytest.raises(ValueError, match="contiguous"):
        io.copy_into(torch.zeros(4, 2, dtype=torch.int64)[:, 0], a)


# --------------------------------------------------------------------- GPU
_needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@_needs_cuda
def test_cuda_staging_round_trips_while_the_ring_wraps_behind_a_busy_stream():
    """Many transfers through a small ring while the stream is held up: every device copy
    holds the values staged for it, so a region is never rewritten before its copy ran."""
    staging = PinnedStaging(torch.device("cuda"), capacity=4096)
    stream = torch.cuda.Stream()
    got, want = [], []
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)  # tens of ms: the copies queue behind it
        for i in range(64):
            ints = np.arange(100, dtype=np.int64) + i
            floats = np.full(7, i, dtype=np.float32)
            mask = torch.full((3, 5), i, dtype=torch.int32)
            got.append(staging.to_device([ints, floats, mask]))
            want.append((ints.copy(), floats.copy(), mask.clone()))
            ints[:] = -1  # the caller may reuse its arrays at once
        dst = torch.empty(40, dtype=torch.int64, device="cuda")
        staging.copy_into(dst, np.arange(40, dtype=np.int64))
    stream.synchronize()
    assert staging.waits > 0  # the ring did wrap onto copies still queued
    for (ints, floats, mask), (di, df, dm) in zip(want, got, strict=True):
        assert di.cpu().numpy().tolist() == ints.tolist()
        assert df.cpu().numpy().tolist() == floats.tolist()
        assert torch.equal(dm.cpu(), mask)
    assert dst.cpu().tolist() == list(range(40))
    big = np.arange(1024, dtype=np.int64)  # 8 KiB: past the ring, a pinned copy of its own
    (d,) = staging.to_device([big])
    assert d.cpu().tolist() == big.tolist()
