"""Tests of baton.kernels.rms_norm: the torch reference against the model's original form, the
Triton kernel against the reference (under the Triton interpreter, compiled for Hopper, and on
CUDA), argument validation and the dispatch."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from kernel_testing import hopper_cubin

from baton.kernels import rms_norm as rn

if TYPE_CHECKING:
    from conftest import InterpreterRun

EPS = 1e-5

_INTERPRETER_RUNNER = """
import sys, torch
from baton.kernels import rms_norm as rn
assert rn._INTERPRETED, "TRITON_INTERPRET=1 did not select the interpreter"
cases = torch.load(sys.argv[1])
torch.save({n: rn.rms_norm_triton(c["x"], c["w"], c["eps"], c["r"]) for n, c in cases.items()},
           sys.argv[2])
"""


def _cases() -> dict[str, dict[str, Any]]:
    """Hidden sizes that are and are not powers of two (576: SmolLM2), each dtype, with and
    without a residual, values spread over a few orders of magnitude."""
    gen = torch.Generator().manual_seed(0)
    cases = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for rows, hidden in ((1, 64), (5, 576), (3, 1000)):
            for with_residual in (False, True):
                scale = torch.exp(torch.randn(rows, 1, generator=gen))
                x = (torch.randn(rows, hidden, generator=gen) * scale).to(dtype)
                r = torch.randn(rows, hidden, generator=gen).to(dtype) if with_residual else None
                w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
                name = f"{str(dtype)[6:]}_{rows}x{hidden}{'_res' if with_residual else ''}"
                cases[name] = {"x": x, "w": w, "eps": EPS, "r": r}
    return cases


def _model_form(x: torch.Tensor, w: torch.Tensor, r: torch.Tensor | None) -> torch.Tensor:
    """The model's RMSNorm as written before the kernel (``x + residual`` first)."""
    h = x if r is None else x + r
    h32 = h.float()
    return w * (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + EPS)).to(h.dtype)


@pytest.mark.parametrize("name", list(_cases()))
def test_reference_is_the_models_form_bit_for_bit(name: str) -> None:
    c = _cases()[name]
    out, summed = rn.rms_norm_torch(c["x"], c["w"], EPS, c["r"])
    assert torch.equal(out, _model_form(c["x"], c["w"], c["r"]))
    if c["r"] is None:
        assert summed is None
    else:
        assert torch.equal(summed, c["x"] + c["r"])


@pytest.fixture(scope="module")
def interpreted(
    tmp_path_factory: pytest.TempPathFactory, run_interpreted: InterpreterRun
) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("rms_norm_interpreter")
    return run_interpreted(_INTERPRETER_RUNNER, _cases(), folder)


def _assert_matches_reference(
    got: tuple[Any, Any], case: dict[str, Any], interpreted: bool = False
) -> None:
    out, summed = got
    ref_out, ref_sum = rn.rms_norm_torch(case["x"], case["w"], EPS, case["r"])
    assert out.dtype == ref_out.dtype and out.shape == ref_out.shape
    # Another reduction order: at most a last-bit difference in the dtype. The interpreter
    # emulates bfloat16 by truncating every conversion (numpy has no bfloat16), which costs a
    # few more ulps there; compiled kernels round to nearest.
    ulp = {torch.float32: 2e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}[out.dtype]
    if interpreted and out.dtype == torch.bfloat16:
        ulp = 3e-2
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=ulp, atol=ulp)
    if ref_sum is None:
        assert summed is None
    elif interpreted and out.dtype == torch.bfloat16:
        torch.testing.assert_close(summed.float(), ref_sum.float(), rtol=2**-7, atol=2**-7)
    else:
        assert torch.equal(summed, ref_sum)  # one rounding, as torch's


@pytest.mark.parametrize("name", list(_cases()))
def test_interpreted_kernel_matches_torch_reference(name: str, interpreted: dict[str, Any]) -> None:
    _assert_matches_reference(interpreted[name], _cases()[name], interpreted=True)


_X = torch.ones(2, 8)
_BAD = [
    ({"x": torch.ones(8)}, "x"),
    ({"x": torch.ones(2, 8, dtype=torch.int32)}, "x"),
    ({"weight": torch.ones(7)}, "weight"),
    ({"weight": torch.ones(8, dtype=torch.bfloat16)}, "weight"),
    ({"residual": torch.ones(2, 7)}, "residual"),
    ({"residual": torch.ones(2, 8, dtype=torch.float16)}, "residual"),
    ({"residual": torch.ones(2, 8, device="meta")}, "residual"),
    ({"eps": float("nan")}, "eps"),
    ({"eps": -1.0}, "eps"),
]


@pytest.mark.parametrize("norm", [rn.rms_norm_torch, rn.rms_norm_triton])
@pytest.mark.parametrize(("change", "named"), _BAD)
def test_bad_arguments_raise_value_error_naming_them(norm: Any, change: dict, named: str) -> None:
    if norm is rn.rms_norm_triton and not rn.HAS_TRITON:
        pytest.skip("triton is not installed")
    args = {"x": _X, "weight": torch.ones(8), "eps": EPS, "residual": None, **change}
    with pytest.raises(ValueError, match=named):
        norm(args["x"], args["weight"], args["eps"], args["residual"])


@pytest.mark.skipif(not rn.HAS_TRITON or rn._INTERPRETED, reason="needs the Triton compiler")
def test_triton_refuses_cpu_tensors_outside_the_interpreter() -> None:
    with pytest.raises(ValueError, match="CUDA device"):
        rn.rms_norm_triton(_X, torch.ones(8), EPS)


def test_dispatcher_uses_the_torch_reference_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbid(*args: Any) -> Any:
        raise AssertionError("the dispatcher used the Triton kernel on CPU tensors")

    monkeypatch.setattr(rn, "rms_norm_triton", forbid)
    c = _cases()["bfloat16_5x576_res"]
    got = rn.rms_norm(c["x"], c["w"], EPS, c["r"])
    want = rn.rms_norm_torch(c["x"], c["w"], EPS, c["r"])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.skipif(not rn.HAS_TRITON or rn._INTERPRETED, reason="needs the Triton compiler")
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.parametrize("dtype", ["*bf16", "*fp32"])
@pytest.mark.parametrize("residual", [False, True])
def test_kernel_compiles_for_hopper(
    dtype: str, residual: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sm_90 cubin builds here (no GPU needed)."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    cubin = hopper_cubin(
        rn._rms_norm_kernel,
        dtype,
        {"HAS_RESIDUAL": residual, "BLOCK": 1024},
        scalar_types={"eps": "fp32"},
        num_warps=4,
    )
    assert cubin


@pytest.mark.gpu
@pytest.mark.skipif(
    not (torch.cuda.is_available() and rn.HAS_TRITON), reason="needs CUDA and triton"
)
@pytest.mark.parametrize("name", list(_cases()))
def test_cuda_kernel_matches_torch_reference(name: str) -> None:
    case = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in _cases()[name].items()}
    got = rn.rms_norm(case["x"], case["w"], EPS, case["r"])
    cpu = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in case.items()}
    _assert_matches_reference(
        tuple(None if t is None else t.cpu() for t in got),  # type: ignore[arg-type]
        cpu,
    )
