"""Tests of baton.kernels.step_state: argument validation (a ValueError naming the argument), the
Triton launch's refusals, and the dispatch between the Triton kernels and the torch references."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from step_state_testing import (
    _STATE,
    Case,
    _assert_same_buffers,
    _clone_update,
    _gather_cases,
    _gather_oracle,
    _update_args,
    _update_cases,
    _update_oracle,
)

from baton.kernels import step_state as ks

_GATHER_OK: Case = {
    "token_ids": torch.zeros(3, 5, dtype=torch.int64),
    "token_rows": torch.tensor([0, 2]),
    "positions": torch.tensor([1, 4]),
    "out": None,
}
_BAD_GATHERS = [
    ("token_ids", torch.zeros(3, 5), "token_ids"),
    ("token_ids", torch.zeros(15, dtype=torch.int64), "token_ids"),
    ("token_ids", [[0] * 5] * 3, "token_ids"),
    ("token_rows", torch.tensor([0, 2], dtype=torch.int32), "token_rows"),
    ("token_rows", torch.tensor([[0, 2]]), "token_rows"),
    ("token_rows", torch.tensor([0, 2], device="meta"), "token_rows"),
    ("positions", torch.tensor([1.0, 4.0]), "positions"),
    ("positions", torch.tensor([1, 4, 0]), "positions"),
    ("out", torch.zeros(2, dtype=torch.int32), "out"),
    ("out", torch.zeros(3, dtype=torch.int64), "out"),
    ("out", torch.zeros(2, dtype=torch.int64, device="meta"), "out"),
]


@pytest.mark.parametrize(
    "gather", [ks.gather_input_ids_torch, ks.gather_input_ids_triton, ks.gather_input_ids]
)
@pytest.mark.parametrize(("argument", "value", "named"), _BAD_GATHERS)
def test_bad_gather_arguments_raise_value_error_naming_them(
    gather: Any, argument: str, value: Any, named: str
) -> None:
    if gather is ks.gather_input_ids_triton and not ks.HAS_TRITON:
        pytest.skip("triton is not installed")
    args = {**_GATHER_OK, argument: value}
    with pytest.raises(ValueError, match=f"^{named} "):
        gather(args["token_ids"], args["token_rows"], args["positions"], args["out"])


def _update_ok() -> Case:
    return {
        "token_ids": torch.zeros(3, 5, dtype=torch.int64),
        "num_tokens": torch.tensor([0, 1, 2]),
        "last_sampled": torch.zeros(3, dtype=torch.int64),
        "output_counts": torch.zeros(3, 8, dtype=torch.int32),
        "rows": torch.tensor([2, 0]),
        "sampled": torch.tensor([7, 1]),
    }


_BAD_UPDATES = [
    ("token_ids", torch.zeros(3, 5, dtype=torch.int32), "token_ids"),
    ("token_ids", torch.zeros(3, dtype=torch.int64), "token_ids"),
    ("num_tokens", torch.tensor([0, 1, 2], dtype=torch.int32), "num_tokens"),
    ("num_tokens", torch.tensor([0, 1]), "num_tokens"),
    ("last_sampled", torch.zeros(3), "last_sampled"),
    ("last_sampled", torch.zeros(4, dtype=torch.int64), "last_sampled"),
    ("output_counts", torch.zeros(3, 8, dtype=torch.int64), "output_counts"),
    ("output_counts", torch.zeros(2, 8, dtype=torch.int32), "output_counts"),
    ("output_counts", torch.zeros(3, 8, dtype=torch.int32, device="meta"), "output_counts"),
    ("rows", torch.tensor([2, 0], dtype=torch.int32), "rows"),
    ("rows", torch.tensor([[2, 0]]), "rows"),
    ("rows", torch.tensor([2, 0], device="meta"), "rows"),
    ("sampled", torch.tensor([7.0, 1.0]), "sampled"),
    ("sampled", torch.tensor([7, 1], dtype=torch.int16), "sampled"),
    ("sampled", torch.tensor([7, 1, 3]), "sampled"),
    ("sampled", (7, 1), "sampled"),
]


@pytest.mark.parametrize(
    "update",
    [ks.post_sample_update_torch_, ks.post_sample_update_triton_, ks.post_sample_update_],
)
@pytest.mark.parametrize(("argument", "value", "named"), _BAD_UPDATES)
def test_bad_update_arguments_raise_value_error_naming_them(
    update: Any, argument: str, value: Any, named: str
) -> None:
    if update is ks.post_sample_update_triton_ and not ks.HAS_TRITON:
        pytest.skip("triton is not installed")
    case = {**_update_ok(), argument: value}
    before = {name: case[name].clone() for name in _STATE if case[name].device.type != "meta"}
    with pytest.raises(ValueError, match=f"^{named} "):
        update(*_update_args(case))
    for name, tensor in before.items():
        assert torch.equal(case[name], tensor), f"{name} changed"


@pytest.mark.skipif(not ks.HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("block_size", [0, 8, 48, 1000])
def test_triton_block_size_must_be_a_power_of_two_of_at_least_16(block_size: int) -> None:
    gather = _GATHER_OK
    with pytest.raises(ValueError, match="block_size"):
        ks.gather_input_ids_triton(
            gather["token_ids"], gather["token_rows"], gather["positions"], block_size=block_size
        )
    with pytest.raises(ValueError, match="block_size"):
        ks.post_sample_update_triton_(*_update_args(_update_ok()), block_size=block_size)


@pytest.mark.skipif(not ks.HAS_TRITON or ks._INTERPRETED, reason="needs triton, running compiled")
def test_triton_refuses_cpu_tensors_outside_the_interpreter() -> None:
    gather = _GATHER_OK
    with pytest.raises(ValueError, match="CUDA"):
        ks.gather_input_ids_triton(gather["token_ids"], gather["token_rows"], gather["positions"])
    case = _update_ok()
    with pytest.raises(ValueError, match="CUDA"):
        ks.post_sample_update_triton_(*_update_args(case))
    expected = _update_ok()
    _assert_same_buffers(
        {name: case[name] for name in _STATE}, {name: expected[name] for name in _STATE}
    )


def test_triton_without_triton_raises_import_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ks, "HAS_TRITON", False)
    gather = _GATHER_OK
    with pytest.raises(ImportError, match="triton"):
        ks.gather_input_ids_triton(gather["token_ids"], gather["token_rows"], gather["positions"])
    with pytest.raises(ImportError, match="triton"):
        ks.post_sample_update_triton_(*_update_args(_update_ok()))


def _forbid_triton(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("the dispatcher used the Triton kernel on CPU tensors")


def test_dispatchers_use_the_torch_references_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ks, "gather_input_ids_triton", _forbid_triton)
    monkeypatch.setattr(ks, "post_sample_update_triton_", _forbid_triton)
    gather = _gather_cases()["three_blocks_padded"]
    out = torch.empty(gather["token_rows"].shape[0], dtype=torch.int64)
    got = ks.gather_input_ids(gather["token_ids"], gather["token_rows"], gather["positions"], out)
    assert got is out and got.tolist() == _gather_oracle(gather)
    case = _update_cases()["transposed_counts_block32"]
    clone = _clone_update(case)
    ks.post_sample_update_(*_update_args(clone))
    _assert_same_buffers(clone["bases"], _update_oracle(case))
