"""Helpers of baton.kernels.step_state's tests (tests/kernels/test_kernels_step_state*.py): the
gather and update cases, a plain Python oracle, the torch references, buffer comparison."""

from __future__ import annotations

import functools
from typing import Any

import torch

from baton.kernels import step_state as ks

Case = dict[str, Any]

_STATE = ("token_ids", "num_tokens", "last_sampled", "output_counts")


def _gather_case(
    seed: int,
    *,
    rows: int,
    row_len: int,
    tokens: int,
    pad: int = 0,
    strided: bool = False,
    with_out: bool = False,
    block_size: int = 16,
) -> Case:
    """Random token ids [rows, row_len] (a view into a buffer `pad` columns wider) and `tokens`
    random in-range (row, position) pairs; `strided` makes the index tensors every other entry
    of a longer one."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 50_000, (rows, row_len + pad), generator=gen)
    step = 2 if strided else 1
    token_rows = torch.randint(0, rows, (tokens * step,), generator=gen)[::step]
    positions = torch.randint(0, row_len, (tokens * step,), generator=gen)[::step]
    return {
        "token_ids": base[:, :row_len],
        "token_rows": token_rows,
        "positions": positions,
        "out": torch.full((tokens,), -7, dtype=torch.int64) if with_out else None,
        "block_size": block_size,
    }


def _update_case(
    seed: int,
    *,
    rows: int,
    row_len: int,
    vocab: int,
    sampled: int,
    counts: bool = True,
    sampled_dtype: torch.dtype = torch.int64,
    pad: int = 0,
    transposed_counts: bool = False,
    block_size: int = 16,
) -> Case:
    """Random per-row state with room for one more token in every row and `sampled` tokens for
    distinct random rows. `pad` widens the token and count buffers past the views the functions
    see and `transposed_counts` stores the counts column-major; `bases` holds the buffers."""
    gen = torch.Generator().manual_seed(seed)
    token_base = torch.randint(0, vocab, (rows, row_len + pad), generator=gen)
    bases: dict[str, torch.Tensor | None] = {
        "token_ids": token_base,
        "num_tokens": torch.randint(0, row_len, (rows,), generator=gen),
        "last_sampled": torch.randint(0, vocab, (rows,), generator=gen),
        "output_counts": None,
    }
    counts_view = None
    if counts:
        shape = (vocab + pad, rows) if transposed_counts else (rows, vocab + pad)
        counts_base = torch.randint(0, 4, shape, generator=gen, dtype=torch.int32)
        bases["output_counts"] = counts_base
        counts_view = (counts_base.t() if transposed_counts else counts_base)[:, :vocab]
    return {
        "token_ids": token_base[:, :row_len],
        "num_tokens": bases["num_tokens"],
        "last_sampled": bases["last_sampled"],
        "output_counts": counts_view,
        "rows": torch.randperm(rows, generator=gen)[:sampled],
        "sampled": torch.randint(0, vocab, (sampled,), generator=gen).to(sampled_dtype),
        "block_size": block_size,
        "bases": bases,
    }


@functools.cache
def _gather_cases() -> dict[str, Case]:
    """The shared gather inputs; callers must clone before writing."""
    return {
        "one_row_no_tokens": _gather_case(1, rows=1, row_len=5, tokens=0),
        "one_row_no_tokens_out": _gather_case(2, rows=1, row_len=5, tokens=0, with_out=True),
        "one_row": _gather_case(3, rows=1, row_len=5, tokens=7),
        "one_token": _gather_case(4, rows=3, row_len=4, tokens=1, with_out=True),
        "three_blocks_padded": _gather_case(5, rows=6, row_len=20, tokens=40, pad=3),
        "strided_out_block32": _gather_case(
            6, rows=9, row_len=33, tokens=50, strided=True, with_out=True, block_size=32
        ),
    }


@functools.cache
def _update_cases() -> dict[str, Case]:
    """The shared update inputs; callers must clone before writing (see `_clone_update`)."""
    return {
        "nothing_sampled": _update_case(1, rows=4, row_len=6, vocab=10, sampled=0),
        "nothing_sampled_no_counts": _update_case(
            2, rows=4, row_len=6, vocab=10, sampled=0, counts=False
        ),
        "one_row_length_one": _update_case(3, rows=1, row_len=1, vocab=3, sampled=1),
        "one_row_no_counts_int32": _update_case(
            4, rows=1, row_len=5, vocab=7, sampled=1, counts=False, sampled_dtype=torch.int32
        ),
        "some_rows_padded": _update_case(5, rows=9, row_len=12, vocab=30, sampled=5, pad=4),
        "all_rows_three_blocks_int32": _update_case(
            6, rows=40, row_len=8, vocab=50, sampled=40, sampled_dtype=torch.int32
        ),
        "transposed_counts_block32": _update_case(
            7, rows=37, row_len=10, vocab=20, sampled=35, transposed_counts=True, block_size=32
        ),
        "all_rows_no_counts": _update_case(
            8, rows=20, row_len=5, vocab=1000, sampled=20, counts=False
        ),
    }


def _clone_update(case: Case) -> Case:
    """A deep copy of an update case whose views share the copied buffers as the originals do."""
    bases = {name: None if base is None else base.clone() for name, base in case["bases"].items()}
    clone = {**case, "bases": bases, "rows": case["rows"].clone()}
    clone["sampled"] = case["sampled"].clone()
    for name in _STATE:
        view = case[name]
        if view is not None:
            clone[name] = bases[name].as_strided(view.shape, view.stride(), view.storage_offset())
    return clone


def _update_args(case: Case) -> tuple[Any, ...]:
    return tuple(case[name] for name in (*_STATE, "rows", "sampled"))


def _gather_oracle(case: Case) -> list[int]:
    table = case["token_ids"].tolist()
    return [
        table[row][pos]
        for row, pos in zip(case["token_rows"].tolist(), case["positions"].tolist(), strict=True)
    ]


def _update_oracle(case: Case) -> dict[str, torch.Tensor | None]:
    """The case's buffers after the update, entry by entry in plain Python."""
    view = _clone_update(case)
    token_ids, num_tokens = view["token_ids"], view["num_tokens"]
    for row, token in zip(view["rows"].tolist(), view["sampled"].tolist(), strict=True):
        pos = int(num_tokens[row])
        token_ids[row, pos] = token
        num_tokens[row] = pos + 1
        view["last_sampled"][row] = token
        if view["output_counts"] is not None:
            view["output_counts"][row, token] += 1
    return view["bases"]


def _gather_reference(case: Case) -> torch.Tensor:
    return ks.gather_input_ids_torch(case["token_ids"], case["token_rows"], case["positions"])


def _update_reference(case: Case) -> dict[str, torch.Tensor | None]:
    clone = _clone_update(case)
    ks.post_sample_update_torch_(*_update_args(clone))
    return clone["bases"]


def _assert_same_buffers(
    got: dict[str, torch.Tensor | None], expected: dict[str, torch.Tensor | None]
) -> None:
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        if tensor is None:
            assert got[name] is None, name
        else:
            assert got[name] is not None and got[name].dtype == tensor.dtype, name
            assert torch.equal(got[name].cpu(), tensor.cpu()), name


def _bad_entries_update() -> Case:
    """Four rows of length 3: row 1 is full; the second entry names row 7, the third the full
    row and the fourth a token past the vocabulary of 5."""
    return {
        "token_ids": torch.arange(12).reshape(4, 3),
        "num_tokens": torch.tensor([0, 3, 2, 1]),
        "last_sampled": torch.tensor([9, 9, 9, 9]),
        "output_counts": torch.zeros(4, 5, dtype=torch.int32),
        "rows": torch.tensor([0, 7, 1, 2]),
        "sampled": torch.tensor([4, 1, 2, 6]),
    }
