"""Torch reference for applying a grammar's token bitmask to logits."""

from __future__ import annotations

import torch

_BITS = 32


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Return bool [R, vocab_size]: True where the token is allowed.

    `bitmask` is int32 [R, W]; bit j of word w (little-endian within the word,
    xgrammar's layout) allows token 32*w + j. Tokens at or beyond 32*W are not
    allowed; bits beyond `vocab_size` are ignored.

    Raises:
        ValueError: if `bitmask` is not a 2-D int32 tensor or vocab_size < 0.
    """
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError(
            f"bitmask must be a 2-D int32 tensor [rows, words], got shape "
            f"{tuple(bitmask.shape)} and dtype {bitmask.dtype}"
        )
    if vocab_size < 0:
        raise ValueError(f"vocab_size must be >= 0, got {vocab_size}")
    rows, words = bitmask.shape
    shifts = torch.arange(_BITS, dtype=torch.int32, device=bitmask.device)
    # An arithmetic shift copies the sign bit, but "& 1" keeps only bit j anyway.
    bits = ((bitmask.unsqueeze(2) >> shifts) & 1).bool().reshape(rows, words * _BITS)
    if bits.shape[1] >= vocab_size:
        return bits[:, :vocab_size]
    allowed = torch.zeros((rows, vocab_size), dtype=torch.bool, device=bitmask.device)
    allowed[:, : bits.shape[1]] = bits
    return allowed


def apply_token_bitmask_(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None = None
) -> None:
    """Set the disallowed logits to -inf, in place.

    Bitmask row i applies to logits row `indices[i]` (to row i when `indices` is
    None, in which case the row counts must match); indices must be distinct. A
    token is allowed when its bit is set (see `unpack_bitmask`); logits columns
    beyond 32 * words are disallowed. Unlike xgrammar's
    `apply_token_bitmask_inplace`, `indices` names logits rows only: the bitmask
    is already compacted to the rows it covers.

    Raises:
        ValueError: if `logits` is not 2-D floating point, `bitmask` not 2-D int32,
            the row counts do not match, `indices` is not a 1-D integer tensor of
            length R, or (on the CPU) an index is out of range or repeated.
    """
    if logits.dim() != 2 or not logits.dtype.is_floating_point:
        raise ValueError(
            f"logits must be a 2-D floating-point tensor, got shape {tuple(logits.shape)} "
            f"and dtype {logits.dtype}"
        )
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError(
            f"bitmask must be a 2-D int32 tensor, got shape {tuple(bitmask.shape)} "
            f"and dtype {bitmask.dtype}"
        )
    if bitmask.device != logits.device:
        raise ValueError(f"bitmask is on {bitmask.device} but logits is on {logits.device}")
    num_rows, vocab = logits.shape
    allowed = unpack_bitmask(bitmask, vocab)
    if indices is None:
        if bitmask.shape[0] != num_rows:
            raise ValueError(
                f"bitmask has {bitmask.shape[0]} rows but logits has {num_rows}; pass indices "
                f"to map bitmask rows to logits rows"
            )
        logits.masked_fill_(~allowed, float("-inf"))
        return
    if (
        not isinstance(indices, torch.Tensor)
        or indices.dim() != 1
        or indices.dtype.is_floating_point
        or indices.dtype == torch.bool
    ):
        raise ValueError("indices must be a 1-D integer tensor of logits row numbers")
    if indices.shape[0] != bitmask.shape[0]:
        raise ValueError(
            f"indices has {indices.shape[0]} entries but bitmask has {bitmask.shape[0]} rows"
        )
    indices = indices.to(device=logits.device, dtype=torch.int64)
    if indices.numel() == 0:
        return
    # Checking values needs them on the host: free on the CPU, a sync elsewhere.
    if logits.device.type == "cpu":
        if bool((indices < 0).any()) or bool((indices >= num_rows).any()):
            raise ValueError(f"indices must be in [0, {num_rows}), got {indices.tolist()}")
        if torch.unique(indices).numel() != indices.numel():
            raise ValueError(f"indices must be distinct, got {indices.tolist()}")
    rows = logits.index_select(0, indices)
    rows.masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, indices, rows)
