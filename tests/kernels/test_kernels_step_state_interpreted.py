"""Tests of baton.kernels.step_state: the Triton kernels under the Triton interpreter (a fresh
process) against the torch references, out-of-range entries skipped."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
import torch
from step_state_testing import (
    _STATE,
    _assert_same_buffers,
    _bad_entries_update,
    _clone_update,
    _gather_cases,
    _gather_reference,
    _update_cases,
    _update_reference,
)

if TYPE_CHECKING:
    from conftest import InterpreterRun

# The interpreter is chosen when triton.jit runs, i.e. when baton.kernels.step_state is imported,
# and this process may already have imported it without the variable: the interpreted runs happen
# in a fresh interpreter. It only loads the inputs, runs the kernels and saves what they wrote;
# the comparisons happen here.
_INTERPRETER_RUNNER = """
import sys, time, torch
from baton.kernels import step_state as ks
assert ks._INTERPRETED, "TRITON_INTERPRET=1 did not select the interpreter"
gathers, updates = torch.load(sys.argv[1])
start = time.perf_counter()
gathered = {}
for name, case in gathers.items():
    out = None if case["out"] is None else case["out"].clone()
    got = ks.gather_input_ids_triton(
        case["token_ids"], case["token_rows"], case["positions"], out,
        block_size=case["block_size"],
    )
    gathered[name] = (got, out)
updated = {}
for name, case in updates.items():
    ks.post_sample_update_triton_(
        case["token_ids"], case["num_tokens"], case["last_sampled"], case["output_counts"],
        case["rows"], case["sampled"], block_size=case["block_size"],
    )
    updated[name] = case["bases"]
print(f"kernel time {time.perf_counter() - start:.3f}s")
torch.save((gathered, updated), sys.argv[2])
"""


@pytest.fixture(scope="module")
def interpreted(
    tmp_path_factory: pytest.TempPathFactory, run_interpreted: InterpreterRun
) -> tuple[dict[str, Any], ...]:
    """(gather name -> (returned ids, out), update name -> buffers) after the Triton kernels ran
    on the cases under TRITON_INTERPRET=1; the out-of-range cases are named "bad_entries"."""
    folder = tmp_path_factory.mktemp("step_state_interpreter")
    gathers = dict(_gather_cases())
    gathers["bad_entries"] = {
        "token_ids": torch.arange(15).reshape(3, 5),
        "token_rows": torch.tensor([0, 3, -1, 2, 1, 2]),
        "positions": torch.tensor([1, 0, 0, 5, -1, 4]),
        "out": None,
        "block_size": 16,
    }
    updates = {name: _clone_update(case) for name, case in _update_cases().items()}
    bad = _bad_entries_update()
    bad["bases"] = {name: bad[name] for name in _STATE}
    updates["bad_entries"] = {**bad, "block_size": 16}
    return run_interpreted(_INTERPRETER_RUNNER, (gathers, updates), folder)


@pytest.mark.parametrize("name", list(_gather_cases()))
def test_interpreted_gather_matches_torch_reference(
    name: str, interpreted: tuple[dict[str, Any], ...]
) -> None:
    case = _gather_cases()[name]
    got, out = interpreted[0][name]
    assert got.dtype == torch.int64
    assert torch.equal(got, _gather_reference(case))
    if case["out"] is not None:
        assert torch.equal(out, got)


@pytest.mark.parametrize("name", list(_update_cases()))
def test_interpreted_update_matches_torch_reference(
    name: str, interpreted: tuple[dict[str, Any], ...]
) -> None:
    _assert_same_buffers(interpreted[1][name], _update_reference(_update_cases()[name]))


def test_interpreted_kernels_skip_out_of_range_entries(
    interpreted: tuple[dict[str, Any], ...],
) -> None:
    got, _ = interpreted[0]["bad_entries"]
    assert got.tolist() == [1, -1, -1, -1, -1, 14]
    state = interpreted[1]["bad_entries"]
    before = _bad_entries_update()
    expected_ids = before["token_ids"].clone()
    expected_ids[0, 0] = 4
    expected_ids[2, 2] = 6  # past the vocabulary skips only the count
    assert torch.equal(state["token_ids"], expected_ids)
    assert state["num_tokens"].tolist() == [1, 3, 3, 1]
    assert state["last_sampled"].tolist() == [4, 9, 6, 9]
    expected_counts = torch.zeros(4, 5, dtype=torch.int32)
    expected_counts[0, 4] = 1
    assert torch.equal(state["output_counts"], expected_counts)
