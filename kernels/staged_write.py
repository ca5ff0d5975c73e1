"""Apply staged writes to persistent device state: a Triton kernel and its torch reference.

The model runner keeps per-request state on the device and learns its changes on the CPU (a new
request's prompt token ids, its length, its last token). Writing them one small copy at a time
would cost one host-to-device transfer and one launch each; instead the CPU packs every change of
a step into one int64 buffer ``staged`` ``[2, N]`` (row 0: flat element indices into the target,
row 1: the values), copies it to the device once, and one kernel applies it:
``target[staged[0, i]] = staged[1, i]``. Several state tensors can share one target when they are
views of one flat storage. Nothing here reads a tensor value on the host.
"""

from __future__ import annotations

import torch

from baton.kernels.checks import check_power_of_two, check_triton_device, describe

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install can still use the torch reference
    triton = None

_DEFAULT_BLOCK_SIZE = 1024
_MIN_BLOCK_SIZE = 16
_TARGET_DTYPES = (torch.int64, torch.int32)

HAS_TRITON: bool = triton is not None
"""True when triton is importable, i.e. `staged_write_triton_` can run."""


def staged_write_torch_(target: torch.Tensor, staged: torch.Tensor) -> None:
    """Apply the staged writes ``target[staged[0, i]] = staged[1, i]`` in place, with one torch op
    (any device).

    Indices must be distinct (with repeats, which value lands is undefined). Values are cast to
    `target`'s dtype (int32 wraps). Indices are not checked (that would read them on the host):
    one past the end raises IndexError on the CPU (a device-side assert on CUDA) and a negative
    one counts from the end, as torch indexing does.

    Raises:
        ValueError: if `target` is not a 1-D int64 or int32 tensor, `staged` not a 2-D int64
            tensor [2, N], or the two are on different devices.
        IndexError: on the CPU, for an index past the end (see above).
    """
    _check_write(target, staged)
    if staged.shape[1] == 0:
        return
    target.index_put_((staged[0],), staged[1].to(target.dtype))


def staged_write_triton_(
    target: torch.Tensor, staged: torch.Tensor, *, block_size: int = _DEFAULT_BLOCK_SIZE
) -> None:
    """Apply the staged writes ``target[staged[0, i]] = staged[1, i]`` in place, with one Triton
    kernel launch (none when nothing is staged).

    Same semantics and validation as `staged_write_torch_`, except for out-of-range indices,
    which are not checked either (no device sync) but never write out of bounds: an entry whose
    index is outside ``[0, numel)`` is skipped. Runs on CPU tensors only under the Triton
    interpreter (TRITON_INTERPRET=1 set before this module is imported).

    Raises:
        ValueError: as `staged_write_torch_`; also if the tensors are not on a CUDA device
            (outside the interpreter) or `block_size` is not a power of two >= 16.
        ImportError: if triton is not installed.
    """
    if not HAS_TRITON:
        raise ImportError("staged_write_triton_ needs triton, which is not installed")
    check_power_of_two("block_size", block_size, _MIN_BLOCK_SIZE)
    _check_write(target, staged)
    check_triton_device("target", target, _INTERPRETED)
    num_entries = staged.shape[1]
    if num_entries == 0:
        return
    _staged_write_kernel[(triton.cdiv(num_entries, block_size),)](
        target,
        staged,
        num_entries,
        target.shape[0],
        target.stride(0),
        staged.stride(0),
        staged.stride(1),
        BLOCK_SIZE=block_size,
        num_warps=4,
    )


def staged_write_(target: torch.Tensor, staged: torch.Tensor) -> None:
    """Apply the staged writes ``target[staged[0, i]] = staged[1, i]`` in place.

    CUDA tensors go through `staged_write_triton_` when triton is installed, anything else
    through `staged_write_torch_`; neither reads a value on the host. Indices must be distinct;
    out-of-range indices are the caller's bug and behave as the chosen function documents.

    Raises:
        ValueError: if `target` is not a 1-D int64 or int32 tensor, `staged` not a 2-D int64
            tensor [2, N], or the two are on different devices.
    """
    if HAS_TRITON and isinstance(target, torch.Tensor) and target.is_cuda:
        staged_write_triton_(target, staged)
    else:
        staged_write_torch_(target, staged)


if HAS_TRITON:
    # Triton reads parameter annotations as types (constexpr, i32, pointers), so the runtime
    # arguments carry none: Triton specialises them on the values passed.
    @triton.jit
    def _staged_write_kernel(
        target_ptr,
        staged_ptr,
        num_entries,
        target_numel,
        target_stride,
        staged_row_stride,
        staged_col_stride,
        BLOCK_SIZE: tl.constexpr,
    ) -> None:
        """Program b: apply staged entries [b * BLOCK_SIZE, (b + 1) * BLOCK_SIZE). Indices are
        distinct, so no two lanes store to the same element and plain stores suffice."""
        entries = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        live = entries < num_entries
        index = tl.load(staged_ptr + entries * staged_col_stride, mask=live, other=0)
        value = tl.load(
            staged_ptr + staged_row_stride + entries * staged_col_stride, mask=live, other=0
        )
        # Unchecked device values must not write out of bounds: bad entries are skipped.
        ok = live & (index >= 0) & (index < target_numel)
        out = target_ptr + index * target_stride
        tl.store(out, value.to(out.dtype.element_ty), mask=ok)


# triton.jit picks the interpreter or the compiler when the kernel is defined (at import, from
# TRITON_INTERPRET), so ask the kernel object which one it got, whatever the environment says now.
_INTERPRETED: bool = HAS_TRITON and type(_staged_write_kernel).__name__ == "InterpretedFunction"


def _check_write(target: torch.Tensor, staged: torch.Tensor) -> None:
    if (
        not isinstance(target, torch.Tensor)
        or target.dim() != 1
        or target.dtype not in _TARGET_DTYPES
    ):
        raise ValueError(
            f"target must be a 1-D int64 or int32 tensor (a flat view of the state), "
            f"got {describe(target)}"
        )
    if (
        not isinstance(staged, torch.Tensor)
        or staged.dim() != 2
        or staged.shape[0] != 2
        or staged.dtype != torch.int64
    ):
        raise ValueError(
            f"staged must be a 2-D int64 tensor [2, N] (indices; values), got {describe(staged)}"
        )
    if staged.device != target.device:
        raise ValueError(f"staged is on {staged.device} but target is on {target.device}")
