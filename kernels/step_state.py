"""Read and write the model runner's persistent per-request device state: Triton kernels and their
torch references.

The state lives in fixed rows on the device: ``token_ids`` int64 ``[R, L]`` (prompt and sampled
tokens of each row), ``num_tokens`` int64 ``[R]`` (valid entries per row), ``last_sampled`` int64
``[R]`` and the dense penalty counts ``output_counts`` int32 ``[R, V]``. Under async scheduling the
next step's input ids come from this state, so nothing here reads a tensor value on the host:
`gather_input_ids` builds a step's input ids and `post_sample_update_` records the sampled tokens.
"""

from __future__ import annotations

import torch

from baton.kernels.checks import check_power_of_two, check_tensor, check_triton_device

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install can still use the torch references
    triton = None

_DEFAULT_GATHER_BLOCK_SIZE = 1024
_DEFAULT_UPDATE_BLOCK_SIZE = 128
_MIN_BLOCK_SIZE = 16

HAS_TRITON: bool = triton is not None
"""True when triton is importable, i.e. the ``*_triton`` functions can run."""


def gather_input_ids_torch(
    token_ids: torch.Tensor,
    token_rows: torch.Tensor,
    positions: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Return the step's input ids, ``out[i] = token_ids[token_rows[i], positions[i]]``, with
    torch ops (any device).

    Writes into `out` when given (and returns it), else allocates. Row and position values are
    not checked (that would read them on the host): one past the end raises IndexError on the CPU
    (a device-side assert on CUDA) and a negative one counts from the end, as torch indexing does.

    Raises:
        ValueError: if `token_ids` is not a 2-D int64 tensor, `token_rows` or `positions` not 1-D
            int64 tensors of equal length, `out` not a 1-D int64 tensor of that length, or the
            tensors are not all on one device.
        IndexError: on the CPU, for a row or position past the end (see above).
    """
    _check_gather(token_ids, token_rows, positions, out)
    ids = token_ids[token_rows, positions]
    if out is None:
        return ids
    return out.copy_(ids)


def gather_input_ids_triton(
    token_ids: torch.Tensor,
    token_rows: torch.Tensor,
    positions: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    block_size: int = _DEFAULT_GATHER_BLOCK_SIZE,
) -> torch.Tensor:
    """Return the step's input ids, ``out[i] = token_ids[token_rows[i], positions[i]]``, with one
    Triton kernel launch (none when there are no tokens).

    Same semantics and validation as `gather_input_ids_torch`, except for out-of-range values,
    which are not checked either (no device sync): a row outside ``[0, R)`` or a position outside
    ``[0, L)`` reads nothing and yields -1, which no vocabulary holds, so the caller's bug shows up
    downstream instead of as a plausible token. Runs on CPU tensors only under the Triton
    interpreter (TRITON_INTERPRET=1 set before this module is imported).

    Raises:
        ValueError: as `gather_input_ids_torch`; also if the tensors are not on a CUDA device
            (outside the interpreter) or `block_size` is not a power of two >= 16.
        ImportError: if triton is not installed.
    """
    if not HAS_TRITON:
        raise ImportError("gather_input_ids_triton needs triton, which is not installed")
    check_power_of_two("block_size", block_size, _MIN_BLOCK_SIZE)
    _check_gather(token_ids, token_rows, positions, out)
    check_triton_device("token_ids", token_ids, _INTERPRETED)
    num_tokens = token_rows.shape[0]
    if out is None:
        out = torch.empty(num_tokens, dtype=torch.int64, device=token_ids.device)
    if num_tokens == 0:
        return out
    _gather_input_ids_kernel[(triton.cdiv(num_tokens, block_size),)](
        token_ids,
        token_rows,
        positions,
        out,
        num_tokens,
        token_ids.shape[0],
        token_ids.shape[1],
        token_ids.stride(0),
        token_ids.stride(1),
        token_rows.stride(0),
        positions.stride(0),
        out.stride(0),
        BLOCK_SIZE=block_size,
        num_warps=4,
    )
    return out


def gather_input_ids(
    token_ids: torch.Tensor,
    token_rows: torch.Tensor,
    positions: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Return the step's input ids, ``out[i] = token_ids[token_rows[i], positions[i]]``.

    CUDA tensors go through `gather_input_ids_triton` when triton is installed, anything else
    through `gather_input_ids_torch`; neither reads a value on the host. Writes into `out` when
    given (and returns it). Out-of-range rows or positions are the caller's bug and behave as the
    chosen function documents.

    Raises:
        ValueError: if `token_ids` is not a 2-D int64 tensor, `token_rows` or `positions` not 1-D
            int64 tensors of equal length, `out` not a 1-D int64 tensor of that length, or the
            tensors are not all on one device.
    """
    if HAS_TRITON and isinstance(token_ids, torch.Tensor) and token_ids.is_cuda:
        return gather_input_ids_triton(token_ids, token_rows, positions, out)
    return gather_input_ids_torch(token_ids, token_rows, positions, out)


def post_sample_update_torch_(
    token_ids: torch.Tensor,
    num_tokens: torch.Tensor,
    last_sampled: torch.Tensor,
    output_counts: torch.Tensor | None,
    rows: torch.Tensor,
    sampled: torch.Tensor,
) -> None:
    """Record the sampled tokens in the per-row state, in place, with vectorised torch ops.

    For each i, with ``r = rows[i]`` and ``p = num_tokens[r]``: ``token_ids[r, p] = sampled[i]``,
    ``num_tokens[r] = p + 1``, ``last_sampled[r] = sampled[i]`` and, unless `output_counts` is
    None, ``output_counts[r, sampled[i]] += 1``. Rows must be distinct. No value is read on the
    host, so on CUDA this queues work without a sync; in exchange nothing is checked: a row, full
    row (p == L) or token out of range raises IndexError on the CPU (a device-side assert on CUDA),
    possibly after some of the state was written; negative values count from the end; repeated
    rows leave the state undefined.

    Raises:
        ValueError: if `token_ids` is not a 2-D int64 tensor [R, L], `num_tokens` or
            `last_sampled` not 1-D int64 [R], `output_counts` not None or 2-D int32 [R, V], `rows`
            not 1-D int64 [N], `sampled` not 1-D int64 or int32 [N], or the tensors are not all
            on one device.
        IndexError: on the CPU, for out-of-range values (see above).
    """
    _check_update(token_ids, num_tokens, last_sampled, output_counts, rows, sampled)
    tokens = sampled.to(torch.int64)
    positions = num_tokens.index_select(0, rows)
    token_ids.index_put_((rows, positions), tokens)
    num_tokens.index_copy_(0, rows, positions + 1)
    last_sampled.index_copy_(0, rows, tokens)
    if output_counts is not None:
        # Distinct rows make the (row, token) pairs distinct, so read-add-write is the += 1; it
        # avoids index_put_'s accumulate path, which sorts the indices.
        counts = output_counts[rows, tokens] + 1
        output_counts.index_put_((rows, tokens), counts)


def post_sample_update_triton_(
    token_ids: torch.Tensor,
    num_tokens: torch.Tensor,
    last_sampled: torch.Tensor,
    output_counts: torch.Tensor | None,
    rows: torch.Tensor,
    sampled: torch.Tensor,
    *,
    block_size: int = _DEFAULT_UPDATE_BLOCK_SIZE,
) -> None:
    """Record the sampled tokens in the per-row state, in place, with one Triton kernel launch
    (none when nothing was sampled).

    Same semantics and validation as `post_sample_update_torch_`, except for out-of-range values,
    which are not checked either (no device sync) but never write out of bounds: an entry whose
    row is outside ``[0, R)`` or whose row is full (``num_tokens[r]`` outside ``[0, L)``) is
    skipped entirely, and a token outside ``[0, V)`` skips only its count. Repeated rows still
    leave the state undefined. Runs on CPU tensors only under the Triton interpreter
    (TRITON_INTERPRET=1 set before this module is imported).

    Raises:
        ValueError: as `post_sample_update_torch_`; also if the tensors are not on a CUDA device
            (outside the interpreter) or `block_size` is not a power of two >= 16.
        ImportError: if triton is not installed.
    """
    if not HAS_TRITON:
        raise ImportError("post_sample_update_triton_ needs triton, which is not installed")
    check_power_of_two("block_size", block_size, _MIN_BLOCK_SIZE)
    _check_update(token_ids, num_tokens, last_sampled, output_counts, rows, sampled)
    check_triton_device("token_ids", token_ids, _INTERPRETED)
    num_sampled = rows.shape[0]
    if num_sampled == 0:
        return
    counts_strides = (0, 0) if output_counts is None else output_counts.stride()
    _post_sample_update_kernel[(triton.cdiv(num_sampled, block_size),)](
        token_ids,
        num_tokens,
        last_sampled,
        output_counts,
        rows,
        sampled,
        num_sampled,
        token_ids.shape[0],
        token_ids.shape[1],
        0 if output_counts is None else output_counts.shape[1],
        token_ids.stride(0),
        token_ids.stride(1),
        num_tokens.stride(0),
        last_sampled.stride(0),
        counts_strides[0],
        counts_strides[1],
        rows.stride(0),
        sampled.stride(0),
        BLOCK_SIZE=block_size,
        num_warps=4,
    )


def post_sample_update_(
    token_ids: torch.Tensor,
    num_tokens: torch.Tensor,
    last_sampled: torch.Tensor,
    output_counts: torch.Tensor | None,
    rows: torch.Tensor,
    sampled: torch.Tensor,
) -> None:
    """Record the sampled tokens in the per-row state, in place.

    For each i, with ``r = rows[i]`` and ``p = num_tokens[r]``: ``token_ids[r, p] = sampled[i]``,
    ``num_tokens[r] = p + 1``, ``last_sampled[r] = sampled[i]`` and, unless `output_counts` is
    None, ``output_counts[r, sampled[i]] += 1``. Rows must be distinct. CUDA tensors go through
    `post_sample_update_triton_` when triton is installed, anything else through
    `post_sample_update_torch_`; neither reads a value on the host. Out-of-range values are the
    caller's bug and behave as the chosen function documents.

    Raises:
        ValueError: if `token_ids` is not a 2-D int64 tensor [R, L], `num_tokens` or
            `last_sampled` not 1-D int64 [R], `output_counts` not None or 2-D int32 [R, V], `rows`
            not 1-D int64 [N], `sampled` not 1-D int64 or int32 [N], or the tensors are not all
            on one device.
    """
    if HAS_TRITON and isinstance(token_ids, torch.Tensor) and token_ids.is_cuda:
        post_sample_update_triton_(
            token_ids, num_tokens, last_sampled, output_counts, rows, sampled
        )
    else:
        post_sample_update_torch_(token_ids, num_tokens, last_sampled, output_counts, rows, sampled)


if HAS_TRITON:
    # Triton reads parameter annotations as types (constexpr, i32, pointers), so the runtime
    # arguments carry none: Triton specialises them on the values passed.
    @triton.jit
    def _gather_input_ids_kernel(
        token_ids_ptr,
        token_rows_ptr,
        positions_ptr,
        out_ptr,
        num_tokens,
        num_rows,
        row_len,
        token_ids_row_stride,
        token_ids_col_stride,
        token_rows_stride,
        positions_stride,
        out_stride,
        BLOCK_SIZE: tl.constexpr,
    ) -> None:
        """Program b: the input ids of flat tokens [b * BLOCK_SIZE, (b + 1) * BLOCK_SIZE)."""
        tokens = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        live = tokens < num_tokens
        row = tl.load(token_rows_ptr + tokens * token_rows_stride, mask=live, other=0)
        pos = tl.load(positions_ptr + tokens * positions_stride, mask=live, other=0)
        # Unchecked device values must not read out of bounds: a bad entry yields -1 instead.
        in_range = live & (row >= 0) & (row < num_rows) & (pos >= 0) & (pos < row_len)
        ids = tl.load(
            token_ids_ptr + row * token_ids_row_stride + pos * token_ids_col_stride,
            mask=in_range,
            other=-1,
        )
        tl.store(out_ptr + tokens * out_stride, ids, mask=live)

    @triton.jit
    def _post_sample_update_kernel(
        token_ids_ptr,
        num_tokens_ptr,
        last_sampled_ptr,
        counts_ptr,
        rows_ptr,
        sampled_ptr,
        num_sampled,
        num_rows,
        row_len,
        vocab_size,
        token_ids_row_stride,
        token_ids_col_stride,
        num_tokens_stride,
        last_sampled_stride,
        counts_row_stride,
        counts_col_stride,
        rows_stride,
        sampled_stride,
        BLOCK_SIZE: tl.constexpr,
    ) -> None:
        """Program b: record sampled entries [b * BLOCK_SIZE, (b + 1) * BLOCK_SIZE). Rows are
        distinct, so no two lanes touch the same state and plain loads and stores suffice."""
        entries = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        live = entries < num_sampled
        row = tl.load(rows_ptr + entries * rows_stride, mask=live, other=0)
        token = tl.load(sampled_ptr + entries * sampled_stride, mask=live, other=0).to(tl.int64)
        # Unchecked device values must not write out of bounds: bad entries are skipped.
        row_ok = live & (row >= 0) & (row < num_rows)
        pos = tl.load(num_tokens_ptr + row * num_tokens_stride, mask=row_ok, other=0)
        ok = row_ok & (pos >= 0) & (pos < row_len)
        tl.store(
            token_ids_ptr + row * token_ids_row_stride + pos * token_ids_col_stride,
            token,
            mask=ok,
        )
        tl.store(num_tokens_ptr + row * num_tokens_stride, pos + 1, mask=ok)
        tl.store(last_sampled_ptr + row * last_sampled_stride, token, mask=ok)
        if counts_ptr is not None:
            count_ok = ok & (token >= 0) & (token < vocab_size)
            count_at = counts_ptr + row * counts_row_stride + token * counts_col_stride
            count = tl.load(count_at, mask=count_ok, other=0)
            tl.store(count_at, count + 1, mask=count_ok)


# triton.jit picks the interpreter or the compiler when the kernel is defined (at import, from
# TRITON_INTERPRET), so ask the kernel object which one it got, whatever the environment says now.
_INTERPRETED: bool = HAS_TRITON and type(_gather_input_ids_kernel).__name__ == "InterpretedFunction"


def _check_same_device(reference: torch.Tensor, reference_name: str, **others: object) -> None:
    for name, value in others.items():
        if isinstance(value, torch.Tensor) and value.device != reference.device:
            raise ValueError(
                f"{name} is on {value.device} but {reference_name} is on {reference.device}"
            )


def _check_gather(
    token_ids: torch.Tensor,
    token_rows: torch.Tensor,
    positions: torch.Tensor,
    out: torch.Tensor | None,
) -> None:
    check_tensor("token_ids", token_ids, 2, (torch.int64,), "a 2-D int64 tensor [R, L]")
    check_tensor("token_rows", token_rows, 1, (torch.int64,), "a 1-D int64 tensor [T]")
    check_tensor("positions", positions, 1, (torch.int64,), "a 1-D int64 tensor [T]")
    num_tokens = token_rows.shape[0]
    if positions.shape[0] != num_tokens:
        raise ValueError(
            f"positions has {positions.shape[0]} entries but token_rows has {num_tokens}"
        )
    if out is not None:
        check_tensor("out", out, 1, (torch.int64,), f"None or a 1-D int64 tensor [{num_tokens}]")
        if out.shape[0] != num_tokens:
            raise ValueError(f"out has {out.shape[0]} entries but token_rows has {num_tokens}")
    _check_same_device(token_ids, "token_ids", token_rows=token_rows, positions=positions, out=out)


def _check_update(
    token_ids: torch.Tensor,
    num_tokens: torch.Tensor,
    last_sampled: torch.Tensor,
    output_counts: torch.Tensor | None,
    rows: torch.Tensor,
    sampled: torch.Tensor,
) -> None:
    check_tensor("token_ids", token_ids, 2, (torch.int64,), "a 2-D int64 tensor [R, L]")
    num_rows = token_ids.shape[0]
    for name, value in (("num_tokens", num_tokens), ("last_sampled", last_sampled)):
        check_tensor(name, value, 1, (torch.int64,), f"a 1-D int64 tensor [{num_rows}]")
        if value.shape[0] != num_rows:
            raise ValueError(
                f"{name} has {value.shape[0]} entries but token_ids has {num_rows} rows"
            )
    if output_counts is not None:
        check_tensor(
            "output_counts",
            output_counts,
            2,
            (torch.int32,),
            f"None or a 2-D int32 tensor [{num_rows}, V]",
        )
        if output_counts.shape[0] != num_rows:
            raise ValueError(
                f"output_counts has {output_counts.shape[0]} rows but token_ids has {num_rows}"
            )
    check_tensor("rows", rows, 1, (torch.int64,), "a 1-D int64 tensor [N]")
    num_sampled = rows.shape[0]
    check_tensor(
        "sampled",
        sampled,
        1,
        (torch.int64, torch.int32),
        f"a 1-D int64 or int32 tensor [{num_sampled}]",
    )
    if sampled.shape[0] != num_sampled:
        raise ValueError(f"sampled has {sampled.shape[0]} entries but rows has {num_sampled}")
    _check_same_device(
        token_ids,
        "token_ids",
        num_tokens=num_tokens,
        last_sampled=last_sampled,
        output_counts=output_counts,
        rows=rows,
        sampled=sampled,
    )
