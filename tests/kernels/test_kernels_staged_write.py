"""Tests of baton.kernels.staged_write: the torch reference against a plain Python oracle, the
Triton kernel against the reference (under the Triton interpreter, compiled for Hopper, and on
CUDA), argument validation and the dispatch between the two."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

from baton.kernels import staged_write as sw

if TYPE_CHECKING:
    from conftest import InterpreterRun

Case = dict[str, Any]

# The interpreter is chosen when triton.jit runs, i.e. when baton.kernels.staged_write is
# imported, and this process may already have imported it without the variable: the interpreted
# runs happen in a fresh interpreter, which only loads the cases, runs the kernel and saves what
# it wrote; the comparisons happen here.
_INTERPRETER_RUNNER = """
import sys, torch
from baton.kernels import staged_write as sw
assert sw._INTERPRETED, "TRITON_INTERPRET=1 did not select the interpreter"
cases = torch.load(sys.argv[1])
for case in cases.values():
    sw.staged_write_triton_(case["target"], case["staged"], block_size=case["block_size"])
torch.save({name: case["base"] for name, case in cases.items()}, sys.argv[2])
"""


def _case(
    seed: int,
    *,
    numel: int,
    entries: int,
    dtype: torch.dtype = torch.int64,
    strided: bool = False,
    block_size: int = 16,
) -> Case:
    """A random target (every other element of a buffer when `strided`) and `entries` distinct
    in-range indices with random values, some of them negative or past int32."""
    gen = torch.Generator().manual_seed(seed)
    step = 2 if strided else 1
    base = torch.randint(-100, 100, (numel * step,), generator=gen, dtype=torch.int64).to(dtype)
    index = torch.randperm(numel, generator=gen)[:entries]
    values = torch.randint(-(2**40), 2**40, (entries,), generator=gen)
    if dtype == torch.int32:
        values = values % 1000 - 500
    return {
        "base": base,
        "target": base[::step],
        "staged": torch.stack((index, values)),
        "block_size": block_size,
    }


@functools.cache
def _cases() -> dict[str, Case]:
    return {
        "empty": _case(0, numel=7, entries=0),
        "one": _case(1, numel=7, entries=1),
        "three_blocks": _case(2, numel=200, entries=40, block_size=16),
        "all_elements_int32": _case(3, numel=64, entries=64, dtype=torch.int32, block_size=32),
        "strided_target": _case(4, numel=50, entries=20, strided=True),
    }


def _clone(case: Case) -> Case:
    base = case["base"].clone()
    view = case["target"]
    target = base.as_strided(view.shape, view.stride(), view.storage_offset())
    return {**case, "base": base, "target": target, "staged": case["staged"].clone()}


def _oracle(case: Case) -> torch.Tensor:
    """The buffer after the writes, one Python assignment at a time."""
    case = _clone(case)
    target = case["target"]
    for index, value in zip(*case["staged"].tolist(), strict=True):
        target[index] = value
    return case["base"]


def _reference(case: Case) -> torch.Tensor:
    case = _clone(case)
    sw.staged_write_torch_(case["target"], case["staged"])
    return case["base"]


@pytest.mark.parametrize("name", list(_cases()))
def test_reference_matches_python_oracle(name: str) -> None:
    case = _cases()[name]
    expected = _oracle(case)
    assert torch.equal(_reference(case), expected)
    if case["staged"].shape[1] > 0:
        assert not torch.equal(expected, case["base"])


def test_views_of_one_storage_are_written_by_one_call() -> None:
    """The runner's layout: token ids, lengths and last tokens are views of one flat target."""
    storage = torch.zeros(3 * 4 + 3 + 3, dtype=torch.int64)
    token_ids, num_tokens, last = storage[:12].view(3, 4), storage[12:15], storage[15:]
    row, tokens = 1, [7, 8, 9]
    index = [row * 4 + j for j in range(3)] + [12 + row, 15 + row]
    sw.staged_write_(storage, torch.tensor([index, [*tokens, 3, 9]]))
    assert token_ids[1].tolist() == [7, 8, 9, 0] and token_ids[[0, 2]].eq(0).all()
    assert num_tokens.tolist() == [0, 3, 0] and last.tolist() == [0, 9, 0]


_HOST_READS = ("item", "tolist", "nonzero", "numpy", "__bool__", "__int__", "__index__", "__iter__")


def _forbid_host_read(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("the torch reference read a tensor value on the host")


def test_reference_reads_no_value_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA a host read is a sync; on the CPU, catch the Python-level ones that would be."""
    case = _clone(_cases()["three_blocks"])
    for name in _HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, _forbid_host_read)
    sw.staged_write_torch_(case["target"], case["staged"])
    monkeypatch.undo()
    assert torch.equal(case["base"], _oracle(_cases()["three_blocks"]))


@pytest.mark.parametrize("index", [7, -9], ids=["past_the_end", "before_the_start"])
def test_reference_raises_index_error_out_of_range(index: int) -> None:
    with pytest.raises(IndexError):
        sw.staged_write_torch_(
            torch.zeros(7, dtype=torch.int64), torch.tensor([[0, index], [1, 2]])
        )


def _bad_entries() -> Case:
    """A target of 5: the second entry is past the end, the third negative."""
    base = torch.arange(5)
    return {
        "base": base,
        "target": base,
        "staged": torch.tensor([[0, 5, -1, 4], [10, 11, 12, 13]]),
        "block_size": 16,
    }


@pytest.fixture(scope="module")
def interpreted(
    tmp_path_factory: pytest.TempPathFactory, run_interpreted: InterpreterRun
) -> dict[str, torch.Tensor]:
    """Case name -> buffer after the Triton kernel ran under TRITON_INTERPRET=1; the
    out-of-range case is named "bad_entries"."""
    folder = tmp_path_factory.mktemp("staged_write_interpreter")
    cases = {name: _clone(case) for name, case in _cases().items()}
    cases["bad_entries"] = _bad_entries()
    return run_interpreted(_INTERPRETER_RUNNER, cases, folder)


@pytest.mark.parametrize("name", list(_cases()))
def test_interpreted_kernel_matches_torch_reference(
    name: str, interpreted: dict[str, torch.Tensor]
) -> None:
    got = interpreted[name]
    assert got.dtype == _cases()[name]["base"].dtype
    assert torch.equal(got, _reference(_cases()[name]))


def test_interpreted_kernel_skips_out_of_range_entries(
    interpreted: dict[str, torch.Tensor],
) -> None:
    assert interpreted["bad_entries"].tolist() == [10, 1, 2, 3, 13]


_OK: Case = {"target": torch.zeros(5, dtype=torch.int64), "staged": torch.tensor([[0], [1]])}
_BAD = [
    ("target", torch.zeros(5), "target"),
    ("target", torch.zeros(5, dtype=torch.int16), "target"),
    ("target", torch.zeros(5, 1, dtype=torch.int64), "target"),
    ("target", [0] * 5, "target"),
    ("staged", torch.tensor([[0], [1]], dtype=torch.int32), "staged"),
    ("staged", torch.tensor([0, 1]), "staged"),
    ("staged", torch.tensor([[0], [1], [2]]), "staged"),
    ("staged", torch.tensor([[0], [1]], device="meta"), "staged"),
]


@pytest.mark.parametrize(
    "write", [sw.staged_write_torch_, sw.staged_write_triton_, sw.staged_write_]
)
@pytest.mark.parametrize(("argument", "value", "named"), _BAD)
def test_bad_arguments_raise_value_error_naming_them(
    write: Any, argument: str, value: Any, named: str
) -> None:
    if write is sw.staged_write_triton_ and not sw.HAS_TRITON:
        pytest.skip("triton is not installed")
    args = {**_OK, argument: value}
    with pytest.raises(ValueError, match=f"^{named} "):
        write(args["target"], args["staged"])


@pytest.mark.skipif(not sw.HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("block_size", [0, 8, 48])
def test_triton_block_size_must_be_a_power_of_two_of_at_least_16(block_size: int) -> None:
    with pytest.raises(ValueError, match="block_size"):
        sw.staged_write_triton_(_OK["target"], _OK["staged"], block_size=block_size)


@pytest.mark.skipif(not sw.HAS_TRITON or sw._INTERPRETED, reason="needs triton, running compiled")
def test_triton_refuses_cpu_tensors_outside_the_interpreter() -> None:
    with pytest.raises(ValueError, match="CUDA device"):
        sw.staged_write_triton_(_OK["target"].clone(), _OK["staged"])


def test_triton_without_triton_raises_import_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sw, "HAS_TRITON", False)
    with pytest.raises(ImportError, match="triton"):
        sw.staged_write_triton_(_OK["target"].clone(), _OK["staged"])


def _forbid_triton(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("the dispatcher used the Triton kernel on CPU tensors")


def test_dispatcher_uses_the_torch_reference_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sw, "staged_write_triton_", _forbid_triton)
    case = _clone(_cases()["strided_target"])
    sw.staged_write_(case["target"], case["staged"])
    assert torch.equal(case["base"], _oracle(_cases()["strided_target"]))


@pytest.mark.skipif(not sw.HAS_TRITON or sw._INTERPRETED, reason="needs the Triton compiler")
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.parametrize("target", ["*i64", "*i32"])
def test_kernel_compiles_for_hopper(
    target: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The interpreter accepts things the compiler rejects: build the sm_90 cubin here (no GPU
    needed), with the runtime arguments as Triton types them for a launch."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    fn = sw._staged_write_kernel
    pointers = {"target_ptr": target, "staged_ptr": "*i64"}
    signature = {
        name: pointers.get(name, "constexpr" if name == "BLOCK_SIZE" else "i32")
        for name in fn.arg_names
    }
    source = ASTSource(fn=fn, signature=signature, constexprs={"BLOCK_SIZE": 1024})
    compiled = compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert compiled.asm["cubin"]
    assert compiled.metadata.shared == 0


_needs_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and sw.HAS_TRITON), reason="needs CUDA and triton"
)


@pytest.mark.gpu
@_needs_cuda
@pytest.mark.parametrize("name", list(_cases()))
def test_cuda_kernel_matches_torch_reference(name: str) -> None:
    case = _cases()[name]
    runs = []
    for write in (sw.staged_write_torch_, sw.staged_write_triton_, sw.staged_write_):
        clone = _clone(case)
        base = clone["base"].cuda()
        view = clone["target"]
        target = base.as_strided(view.shape, view.stride(), view.storage_offset())
        staged = clone["staged"].cuda()
        torch.cuda.set_sync_debug_mode("error")  # none of them may sync
        try:
            write(target, staged)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        runs.append(base.cpu())
    expected = _oracle(case)
    for got in runs:
        assert torch.equal(got, expected)


@pytest.mark.gpu
@_needs_cuda
def test_cuda_kernel_skips_out_of_range_entries() -> None:
    bad = _bad_entries()
    target = bad["target"].cuda()
    sw.staged_write_(target, bad["staged"].cuda())
    assert target.tolist() == [10, 1, 2, 3, 13]
