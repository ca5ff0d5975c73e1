"""Apply a grammar's token bitmask to logits: the Triton kernel on CUDA, the CPU kernel on the
CPU, the torch reference elsewhere (all in baton.kernels.bitmask)."""

from __future__ import annotations

import torch

from baton.kernels.bitmask import (
    HAS_TRITON,
    apply_token_bitmask_inplace_cpu,
    apply_token_bitmask_inplace_torch,
    apply_token_bitmask_inplace_triton,
    unpack_bitmask,
)

__all__ = ["apply_token_bitmask_", "unpack_bitmask"]


def apply_token_bitmask_(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None = None
) -> None:
    """Set the disallowed logits to -inf, in place.

    Bitmask row i applies to logits row `indices[i]` (to row i when `indices` is
    None, in which case the row counts must match); indices must be distinct. A
    token is allowed when its bit is set (see `unpack_bitmask`); logits columns
    beyond 32 * words are disallowed. Unlike xgrammar's
    `apply_token_bitmask_inplace`, `indices` names logits rows only: the bitmask
    is already compacted to the rows it covers. CUDA logits go through the Triton
    kernel when triton is installed (index values unchecked there, see
    `apply_token_bitmask_inplace_triton`), CPU logits through the CPU kernel, anything
    else through the torch reference.

    Raises:
        ValueError: if `logits` is not 2-D floating point, `bitmask` not 2-D int32
            or not on the logits' device, the row counts do not match, `indices` is
            not a 1-D integer tensor of length R, or (on the CPU) an index is out of
            range or repeated.
    """
    if HAS_TRITON and isinstance(logits, torch.Tensor) and logits.is_cuda:
        apply_token_bitmask_inplace_triton(logits, bitmask, indices)
    elif isinstance(logits, torch.Tensor) and logits.device.type == "cpu":
        apply_token_bitmask_inplace_cpu(logits, bitmask, indices)
    else:
        apply_token_bitmask_inplace_torch(logits, bitmask, indices)
