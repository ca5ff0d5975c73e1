"""Tests of baton.kernels.step_state: the torch references against a plain Python oracle, the
Triton kernels against the references (under the Triton interpreter, compiled for Hopper, and on
CUDA), argument validation and the dispatch between the two."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

from baton.kernels import step_state as ks

if TYPE_CHECKING:
    from conftest import InterpreterRun

Case = dict[str, Any]

_STATE = ("token_ids", "num_tokens", "last_sampled", "output_counts")

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


@pytest.mark.parametrize("entry", [1, 2, 3], ids=["row", "full_row", "token"])
def test_update_reference_raises_index_error_out_of_range(entry: int) -> None:
    case = _bad_entries_update()
    case["rows"] = case["rows"][[0, entry]]
    case["sampled"] = case["sampled"][[0, entry]]
    with pytest.raises(IndexError):
        ks.post_sample_update_torch_(*_update_args(case))


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
