"""Tests of baton.kernels.invariant_matmul: the Triton kernel against its torch reference (under
the Triton interpreter, compiled for Hopper, and on CUDA), the batch-invariance property (a row's
bits the same alone and among 1-70 other rows), a negative control that the property check
catches a kernel whose K step follows M, the tile rule and argument validation."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from kernel_testing import hopper_cubin

from baton.kernels import invariant_matmul as im

if TYPE_CHECKING:
    from conftest import InterpreterRun

# The interpreter is chosen when baton.kernels.invariant_matmul is imported, so the kernel runs
# in a fresh Python (the run_interpreted fixture); the comparisons happen here. "bad" is the
# negative control: the kernel launched with a K step picked by M (16 below 4 rows, else 32).
_INTERPRETER_RUNNER = """
import sys, torch
from baton.kernels import invariant_matmul as im
assert im._INTERPRETED, "TRITON_INTERPRET=1 did not select the interpreter"
payload = torch.load(sys.argv[1])

def by_m(x, w, b):
    return im._launch(x, w, b, im.TileConfig(64, 16 if x.shape[0] < 4 else 32))

out = {"cases": {n: im.invariant_matmul(c["x"], c["w"], c["b"])
                 for n, c in payload["cases"].items()}}
for name, p in payload["invariance"].items():
    for label, fn in (("kernel", im.invariant_matmul), ("bad", by_m)):
        if label == "bad" and not p["control"]:
            continue
        out[(name, label, "alone")] = [fn(r.unsqueeze(0), p["w"], p["b"]) for r in p["probes"]]
        out[(name, label, "batches")] = [fn(x, p["w"], p["b"]) for x in p["batches"]]
torch.save(out, sys.argv[2])
"""

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Row counts of the property (70: a probe in the second BLOCK_M tile).
_BATCH_ROWS = (1, 2, 3, 7, 16, 33, 64, 70)
_PROBES = 3


def _cases() -> dict[str, dict[str, Any]]:
    """N and K off the tiles' multiples (K below one K step too), rows in a second tile, with
    and without a bias, each dtype; an empty batch; a weight that is a row slice of a wider one
    (a row stride). One row alone is `_invariance`'s."""
    gen = torch.Generator().manual_seed(0)
    cases: dict[str, dict[str, Any]] = {}
    for dtype in _DTYPES:
        for m, n, k, biased in ((5, 130, 200, False), (70, 40, 33, True)):
            x = torch.randn(m, k, generator=gen).to(dtype)
            w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
            b = torch.randn(n, generator=gen).to(dtype) if biased else None
            name = f"{str(dtype)[6:]}_{m}x{n}x{k}{'_bias' if biased else ''}"
            cases[name] = {"x": x, "w": w, "b": b}
    cases["float32_empty"] = {"x": torch.ones(0, 16), "w": torch.ones(8, 16), "b": None}
    wide = torch.randn(96, 64, generator=gen)
    cases["float32_weight_slice"] = {
        "x": torch.randn(3, 64, generator=gen),
        "w": wide[8:40],
        "b": None,
    }
    return cases


def _invariance() -> dict[str, dict[str, Any]]:
    """Per dtype (with or without a bias): a weight, ``_PROBES`` probe rows, and one batch per
    row count in ``_BATCH_ROWS`` of fresh random rows holding the probes at the last, first and
    middle places. Rows spread over orders of magnitude, so that float32 sums round (a
    reordering shows). ``control``: also run the negative control (float32)."""
    gen = torch.Generator().manual_seed(1)
    payload = {}
    for dtype, biased in ((torch.float32, False), (torch.bfloat16, True)):
        n, k = 64, 100  # one tile of columns: the interpreter's time goes by programs

        def rows(count: int, dtype: torch.dtype = dtype, k: int = k) -> torch.Tensor:
            spread = torch.exp(2 * torch.randn(count, k, generator=gen))
            return (torch.randn(count, k, generator=gen) * spread).to(dtype)

        w = torch.randn(n, k, generator=gen).to(dtype)
        b = torch.randn(n, generator=gen).to(dtype) if biased else None
        probes = rows(_PROBES)
        batches = []
        for m in _BATCH_ROWS:
            x = rows(m)
            for p, place in enumerate(_places(m)):
                x[place] = probes[p]
            batches.append(x)
        name = f"{str(dtype)[6:]}{'_bias' if biased else ''}"
        control = dtype == torch.float32 and not biased
        payload[name] = {"w": w, "b": b, "probes": probes, "batches": batches, "control": control}
    return payload


def _places(m: int) -> list[int]:
    """Where the probes sit in a batch of ``m`` rows: last, first, middle (as many as fit)."""
    return list(dict.fromkeys((m - 1, 0, m // 2)))[:_PROBES]


@pytest.fixture(scope="module")
def interpreted(
    tmp_path_factory: pytest.TempPathFactory, run_interpreted: InterpreterRun
) -> dict[Any, Any]:
    folder = tmp_path_factory.mktemp("invariant_matmul_interpreter")
    return run_interpreted(
        _INTERPRETER_RUNNER, {"cases": _cases(), "invariance": _invariance()}, folder
    )


def _assert_matches_reference(got: torch.Tensor, case: dict[str, Any], interpreted: bool) -> None:
    x, w, b = case["x"], case["w"], case["b"]
    want = im.invariant_matmul_reference(x, w, b)
    assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
    # Another summation order than the reference's: float32 agrees to a few roundings of the
    # sum of magnitudes; 16-bit results to one rounding of the dtype, plus one more under the
    # interpreter, which truncates its bfloat16 conversions (compiled kernels round to nearest).
    size = (x.float().abs() @ w.float().abs().T + (0 if b is None else b.float().abs())).abs()
    rel = {torch.float32: 2e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}[got.dtype]
    if interpreted and got.dtype == torch.bfloat16:
        rel = 2**-6
    err = (got.float() - want.float()).abs()
    assert bool((err <= rel * want.float().abs() + 2e-6 * size + 1e-30).all()), err.max()


@pytest.mark.parametrize("name", list(_cases()))
def test_interpreted_kernel_matches_torch_reference(name: str, interpreted: dict[Any, Any]) -> None:
    _assert_matches_reference(interpreted["cases"][name], _cases()[name], interpreted=True)


def _differing_rows(results: dict[Any, Any], name: str, label: str) -> list[tuple[int, int]]:
    """(row count, probe) of every probe whose row in a batch has other bits than alone."""
    alone = results[(name, label, "alone")]
    differing = []
    for m, batch in zip(_BATCH_ROWS, results[(name, label, "batches")], strict=True):
        for p, place in enumerate(_places(m)):
            if not torch.equal(batch[place : place + 1], alone[p]):
                differing.append((m, p))
    return differing


@pytest.mark.parametrize("name", list(_invariance()))
def test_a_row_has_the_same_bits_alone_and_in_any_batch(
    name: str, interpreted: dict[Any, Any]
) -> None:
    assert _differing_rows(interpreted, name, "kernel") == []
    # ... and the rows are right, not just stable.
    p = _invariance()[name]
    for batch, got in zip(p["batches"], interpreted[(name, "kernel", "batches")], strict=True):
        _assert_matches_reference(got, {"x": batch, "w": p["w"], "b": p["b"]}, interpreted=True)


def test_the_check_catches_a_kernel_whose_k_step_follows_m(interpreted: dict[Any, Any]) -> None:
    """Negative control: the same property check fails for a launch whose BLOCK_K is chosen
    by M, so the test above can fail."""
    differing = _differing_rows(interpreted, "float32", "bad")
    # Below 4 rows the bad launch takes the lone row's K step, so only larger batches differ.
    assert differing and all(m >= 4 for m, _ in differing), differing


def test_the_tile_rule_does_not_take_m() -> None:
    assert list(inspect.signature(im.tile_config).parameters) == ["n", "k", "dtype"]
    assert im.tile_config(576, 576, torch.bfloat16) == im.TileConfig(64, 64)
    assert im.tile_config(49152, 576, torch.bfloat16) == im.TileConfig(128, 64)
    assert im.tile_config(576, 1536, torch.float32) == im.TileConfig(64, 32)


_BAD = [
    ({"x": torch.ones(8)}, "x"),
    ({"x": torch.ones(2, 8, dtype=torch.int32)}, "x"),
    ({"weight": torch.ones(4, 7)}, "weight"),
    ({"weight": torch.ones(4, 8, dtype=torch.bfloat16)}, "weight"),
    ({"weight": torch.ones(4, 8, device="meta")}, "weight"),
    ({"bias": torch.ones(5)}, "bias"),
    ({"bias": torch.ones(4, 1)}, "bias"),
    ({"bias": torch.ones(4, dtype=torch.float16)}, "bias"),
]


@pytest.mark.parametrize("fn", [im.invariant_matmul_reference, im.invariant_matmul])
@pytest.mark.parametrize(("change", "named"), _BAD)
def test_bad_arguments_raise_value_error_naming_them(fn: Any, change: dict, named: str) -> None:
    if fn is im.invariant_matmul and not im.HAS_TRITON:
        pytest.skip("triton is not installed")
    args = {"x": torch.ones(2, 8), "weight": torch.ones(4, 8), "bias": None, **change}
    with pytest.raises(ValueError, match=named):
        fn(args["x"], args["weight"], args["bias"])


@pytest.mark.skipif(not im.HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("named", ["x", "weight"])
def test_strided_rows_are_refused(named: str) -> None:
    args = {"x": torch.ones(2, 8), "weight": torch.ones(4, 8)}
    args[named] = torch.ones(8, args[named].shape[0]).T
    with pytest.raises(ValueError, match=f"{named} must have contiguous rows"):
        im.invariant_matmul(args["x"], args["weight"])


@pytest.mark.skipif(not im.HAS_TRITON or im._INTERPRETED, reason="needs the Triton compiler")
def test_triton_refuses_cpu_tensors_outside_the_interpreter() -> None:
    with pytest.raises(ValueError, match="CUDA device"):
        im.invariant_matmul(torch.ones(2, 8), torch.ones(4, 8))


@pytest.mark.skipif(not im.HAS_TRITON or im._INTERPRETED, reason="needs the Triton compiler")
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.parametrize(
    ("dtype", "n"),
    [(torch.float32, 576), (torch.float16, 576), (torch.bfloat16, 576), (torch.bfloat16, 49152)],
)
def test_kernel_compiles_for_hopper(
    dtype: torch.dtype, n: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sm_90 cubin of every tile `tile_config` gives builds here (no GPU needed), the
    16-bit ones on tensor cores."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    config = im.tile_config(n, 576, dtype)
    constexprs = {
        "HAS_BIAS": True,
        "BLOCK_M": im.BLOCK_M,
        "BLOCK_N": config.block_n,
        "BLOCK_K": config.block_k,
        "GROUP_M": im._GROUP_M,
        "DOT_DTYPE": im._dot_dtype(dtype),
    }
    pointer = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16"}[dtype]
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    ptx = hopper_cubin(im._invariant_matmul_kernel, pointer, constexprs, options=options, asm="ptx")
    if dtype != torch.float32:
        assert "mma" in ptx


@pytest.mark.gpu
@pytest.mark.skipif(
    not (torch.cuda.is_available() and im.HAS_TRITON), reason="needs CUDA and triton"
)
@pytest.mark.parametrize("name", list(_invariance()))
def test_cuda_rows_have_the_same_bits_alone_and_in_any_batch(name: str) -> None:
    p = _invariance()[name]
    w, b = p["w"].cuda(), None if p["b"] is None else p["b"].cuda()
    alone = [im.invariant_matmul(r.unsqueeze(0).cuda(), w, b).cpu() for r in p["probes"]]
    for m, x in zip(_BATCH_ROWS, p["batches"], strict=True):
        got = im.invariant_matmul(x.cuda(), w, b).cpu()
        _assert_matches_reference(got, {"x": x, "w": p["w"], "b": p["b"]}, interpreted=False)
        for i, place in enumerate(_places(m)):
            assert torch.equal(got[place : place + 1], alone[i]), (m, i)
