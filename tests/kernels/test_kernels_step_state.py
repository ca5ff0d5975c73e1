"""Tests of baton.kernels.step_state: the torch references against a plain Python oracle, and
the Triton kernels compiled for Hopper and on CUDA against the references (under the Triton
interpreter: test_kernels_step_state_interpreted.py; arguments and dispatch:
test_kernels_step_state_args.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from step_state_testing import (
    _STATE,
    Case,
    _assert_same_buffers,
    _bad_entries_update,
    _clone_update,
    _gather_cases,
    _gather_oracle,
    _update_args,
    _update_cases,
    _update_oracle,
    _update_reference,
)

from baton.kernels import step_state as ks


@pytest.mark.parametrize("name", list(_gather_cases()))
@pytest.mark.parametrize("with_out", [False, True])
def test_gather_reference_matches_python_oracle(name: str, with_out: bool) -> None:
    case = _gather_cases()[name]
    tokens = case["token_rows"].shape[0]
    out = torch.full((tokens,), -7, dtype=torch.int64) if with_out else None
    got = ks.gather_input_ids_torch(case["token_ids"], case["token_rows"], case["positions"], out)
    assert got.dtype == torch.int64 and got.shape == (tokens,)
    assert got.tolist() == _gather_oracle(case)
    if with_out:
        assert got is out


@pytest.mark.parametrize("name", list(_update_cases()))
def test_update_reference_matches_python_oracle(name: str) -> None:
    case = _update_cases()[name]
    expected = _update_oracle(case)
    _assert_same_buffers(_update_reference(case), expected)
    if case["rows"].numel() > 0:
        assert not torch.equal(expected["num_tokens"], case["bases"]["num_tokens"])


def test_gather_reads_back_what_the_update_wrote() -> None:
    """The async step loop: the next input id of a row is the token the last step sampled."""
    case = _clone_update(_update_cases()["some_rows_padded"])
    ks.post_sample_update_(*_update_args(case))
    rows = case["rows"]
    positions = case["num_tokens"].index_select(0, rows) - 1
    got = ks.gather_input_ids(case["token_ids"], rows, positions)
    assert torch.equal(got, case["sampled"].to(torch.int64))
    assert torch.equal(got, case["last_sampled"].index_select(0, rows))


_HOST_READS = ("item", "tolist", "nonzero", "numpy", "__bool__", "__int__", "__index__", "__iter__")


def _forbid_host_read(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("the torch reference read a tensor value on the host")


def test_torch_references_read_no_value_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA a host read is a sync; on the CPU, catch the Python-level ones that would be."""
    gather = _gather_cases()["three_blocks_padded"]
    update = _clone_update(_update_cases()["some_rows_padded"])
    for name in _HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, _forbid_host_read)
    got = ks.gather_input_ids_torch(gather["token_ids"], gather["token_rows"], gather["positions"])
    ks.post_sample_update_torch_(*_update_args(update))
    monkeypatch.undo()
    assert got.tolist() == _gather_oracle(gather)
    _assert_same_buffers(update["bases"], _update_oracle(_update_cases()["some_rows_padded"]))


@pytest.mark.parametrize(
    ("rows", "positions"), [([0, 3], [1, 0]), ([0, 1], [5, 0])], ids=["row", "position"]
)
def test_gather_reference_raises_index_error_past_the_end(
    rows: list[int], positions: list[int]
) -> None:
    with pytest.raises(IndexError):
        ks.gather_input_ids_torch(
            torch.zeros(3, 5, dtype=torch.int64), torch.tensor(rows), torch.tensor(positions)
        )


@pytest.mark.parametrize("entry", [1, 2, 3], ids=["row", "full_row", "token"])
def test_update_reference_raises_index_error_out_of_range(entry: int) -> None:
    case = _bad_entries_update()
    case["rows"] = case["rows"][[0, entry]]
    case["sampled"] = case["sampled"][[0, entry]]
    with pytest.raises(IndexError):
        ks.post_sample_update_torch_(*_update_args(case))


@pytest.mark.skipif(not ks.HAS_TRITON or ks._INTERPRETED, reason="needs the Triton compiler")
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.parametrize("kernel", ["gather", "update_int64_counts", "update_int32_no_counts"])
def test_kernels_compile_for_hopper(
    kernel: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The interpreter accepts things the compiler rejects: build the sm_90 cubin here (no GPU
    needed), with the runtime arguments as Triton types them for a launch."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    constexprs: dict[str, Any] = {"BLOCK_SIZE": 128}
    if kernel == "gather":
        fn = ks._gather_input_ids_kernel
        pointers = {"token_ids_ptr": "*i64", "token_rows_ptr": "*i64", "positions_ptr": "*i64"}
        pointers["out_ptr"] = "*i64"
    else:
        fn = ks._post_sample_update_kernel
        counts = kernel == "update_int64_counts"
        pointers = {
            "token_ids_ptr": "*i64",
            "num_tokens_ptr": "*i64",
            "last_sampled_ptr": "*i64",
            "counts_ptr": "*i32" if counts else "constexpr",
            "rows_ptr": "*i64",
            "sampled_ptr": "*i64" if counts else "*i32",
        }
        if not counts:
            constexprs["counts_ptr"] = None
    names = fn.arg_names
    signature = {
        name: pointers.get(name, "constexpr" if name == "BLOCK_SIZE" else "i32") for name in names
    }
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    compiled = compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert compiled.asm["cubin"]
    assert compiled.metadata.shared == 0


_needs_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and ks.HAS_TRITON), reason="needs CUDA and triton"
)


def _to_cuda(case: Case) -> Case:
    clone = _clone_update(case)
    bases = {name: None if base is None else base.cuda() for name, base in clone["bases"].items()}
    moved = {**clone, "bases": bases, "rows": clone["rows"].cuda()}
    moved["sampled"] = clone["sampled"].cuda()
    for name in _STATE:
        view = clone[name]
        if view is not None:
            moved[name] = bases[name].as_strided(view.shape, view.stride(), view.storage_offset())
    return moved


@pytest.mark.gpu
@_needs_cuda
@pytest.mark.parametrize("name", list(_gather_cases()))
def test_cuda_gather_matches_torch_reference(name: str) -> None:
    case = _gather_cases()[name]
    args = [case[key].cuda() for key in ("token_ids", "token_rows", "positions")]
    out = None if case["out"] is None else case["out"].cuda()
    torch.cuda.set_sync_debug_mode("error")
    try:
        expected = ks.gather_input_ids_torch(*args)
        got = ks.gather_input_ids_triton(*args, out, block_size=case["block_size"])
        dispatched = ks.gather_input_ids(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert got.is_cuda and torch.equal(got, expected) and torch.equal(dispatched, expected)
    assert got.tolist() == _gather_oracle(case)
    if out is not None:
        assert got is out


@pytest.mark.gpu
@_needs_cuda
@pytest.mark.parametrize("name", list(_update_cases()))
def test_cuda_update_matches_torch_reference(name: str) -> None:
    case = _update_cases()[name]
    triton_case, torch_case, dispatch_case = _to_cuda(case), _to_cuda(case), _to_cuda(case)
    torch.cuda.set_sync_debug_mode("error")  # the torch reference must queue without a sync too
    try:
        ks.post_sample_update_torch_(*_update_args(torch_case))
        ks.post_sample_update_triton_(
            *_update_args(triton_case), block_size=triton_case["block_size"]
        )
        ks.post_sample_update_(*_update_args(dispatch_case))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    expected = _update_oracle(case)
    _assert_same_buffers(torch_case["bases"], expected)
    _assert_same_buffers(triton_case["bases"], expected)
    _assert_same_buffers(dispatch_case["bases"], expected)


@pytest.mark.gpu
@_needs_cuda
def test_cuda_kernels_skip_out_of_range_entries(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def spy(kernel: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            calls.append(kernel.__name__)
            return kernel(*args, **kwargs)

        return run

    monkeypatch.setattr(ks, "gather_input_ids_triton", spy(ks.gather_input_ids_triton))
    monkeypatch.setattr(ks, "post_sample_update_triton_", spy(ks.post_sample_update_triton_))
    token_ids = torch.arange(15, device="cuda").reshape(3, 5)
    rows = torch.tensor([0, 3, -1, 2, 1, 2], device="cuda")
    positions = torch.tensor([1, 0, 0, 5, -1, 4], device="cuda")
    assert ks.gather_input_ids(token_ids, rows, positions).tolist() == [1, -1, -1, -1, -1, 14]
    bad = {name: value.cuda() for name, value in _bad_entries_update().items()}
    ks.post_sample_update_(*_update_args(bad))
    assert calls == ["gather_input_ids_triton", "post_sample_update_triton_"]
    assert bad["num_tokens"].tolist() == [1, 3, 3, 1]
    assert bad["last_sampled"].tolist() == [4, 9, 6, 9]
    assert int(bad["output_counts"].sum()) == 1 and int(bad["output_counts"][0, 4]) == 1
