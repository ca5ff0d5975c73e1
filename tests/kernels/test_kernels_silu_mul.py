"""Tests of baton.kernels.silu_mul: the torch reference against the model's SwiGLU, the Triton
kernel against the reference (under the Triton interpreter, compiled for Hopper, and on CUDA),
argument validation and the dispatch."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
import torch.nn.functional as F
from kernel_testing import hopper_cubin

from baton.kernels import silu_mul as sm

if TYPE_CHECKING:
    from conftest import InterpreterRun

_INTERPRETER_RUNNER = """
import sys, torch
from baton.kernels import silu_mul as sm
assert sm._INTERPRETED, "TRITON_INTERPRET=1 did not select the interpreter"
cases = torch.load(sys.argv[1])
torch.save({n: sm.silu_mul_triton(c["gate"], c["up"]) for n, c in cases.items()}, sys.argv[2])
"""


def _cases() -> dict[str, dict[str, torch.Tensor]]:
    """SmolLM2's width (1536) and others (one past a block, under one), each dtype, as the
    halves of a fused gate/up projection the model passes, and contiguous; 0 tokens too."""
    gen = torch.Generator().manual_seed(0)
    cases = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for tokens, width in ((3, 1536), (2, 1025), (5, 40), (0, 64)):
            gate_up = (3 * torch.randn(tokens, 2 * width, generator=gen)).to(dtype)
            gate, up = gate_up.split((width, width), dim=-1)
            base = f"{str(dtype)[6:]}_{tokens}x{width}"
            cases[base + "_fused"] = {"gate": gate, "up": up}
            cases[base] = {"gate": gate.contiguous(), "up": up.contiguous()}
    return cases


def _assert_matches_reference(
    got: torch.Tensor, case: dict[str, torch.Tensor], ulps: float
) -> None:
    want = sm.silu_mul_torch(case["gate"], case["up"])
    assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
    # Another exponential than torch's: a last-bit difference in the SiLU, which the product
    # can carry into a second.
    ulp = {torch.float32: 2**-23, torch.bfloat16: 2**-7, torch.float16: 2**-10}[got.dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=ulps * ulp, atol=ulps * ulp)


@pytest.mark.parametrize("name", list(_cases()))
def test_reference_is_the_models_swiglu(name: str) -> None:
    c = _cases()[name]
    assert torch.equal(sm.silu_mul_torch(c["gate"], c["up"]), F.silu(c["gate"]) * c["up"])


@pytest.fixture(scope="module")
def interpreted(
    tmp_path_factory: pytest.TempPathFactory, run_interpreted: InterpreterRun
) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("silu_mul_interpreter")
    return run_interpreted(_INTERPRETER_RUNNER, _cases(), folder)


@pytest.mark.parametrize("name", list(_cases()))
def test_interpreted_kernel_matches_torch_reference(name: str, interpreted: dict[str, Any]) -> None:
    case = _cases()[name]
    # The interpreter emulates bfloat16 by truncating each conversion (numpy has no bfloat16):
    # two truncations, a few ulps; compiled kernels round to nearest.
    ulps = 4 if case["gate"].dtype == torch.bfloat16 else 2
    _assert_matches_reference(interpreted[name], case, ulps)


_OK = _cases()["float32_5x40"]
_BAD = [
    ({"gate": torch.ones(5)}, "gate"),
    ({"gate": torch.ones(5, 40, dtype=torch.int64)}, "gate"),
    ({"up": torch.ones(5, 41)}, "up"),
    ({"up": torch.ones(5, 40, dtype=torch.float16)}, "up"),
    ({"up": torch.ones(5, 40, device="meta")}, "up"),
]


@pytest.mark.parametrize("fn", [sm.silu_mul_torch, sm.silu_mul_triton])
@pytest.mark.parametrize(("change", "named"), _BAD)
def test_bad_arguments_raise_value_error_naming_them(fn: Any, change: dict, named: str) -> None:
    if fn is sm.silu_mul_triton and not sm.HAS_TRITON:
        pytest.skip("triton is not installed")
    a = {**_OK, **change}
    with pytest.raises(ValueError, match=named):
        fn(a["gate"], a["up"])


@pytest.mark.skipif(not sm.HAS_TRITON or sm._INTERPRETED, reason="needs the Triton compiler")
def test_triton_refuses_cpu_tensors_outside_the_interpreter() -> None:
    with pytest.raises(ValueError, match="CUDA device"):
        sm.silu_mul_triton(_OK["gate"], _OK["up"])


def test_dispatcher_uses_the_torch_reference_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbid(*args: Any) -> Any:
        raise AssertionError("the dispatcher used the Triton kernel on CPU tensors")

    monkeypatch.setattr(sm, "silu_mul_triton", forbid)
    c = _cases()["bfloat16_3x1536_fused"]
    assert torch.equal(sm.silu_mul(c["gate"], c["up"]), F.silu(c["gate"]) * c["up"])


@pytest.mark.skipif(not sm.HAS_TRITON or sm._INTERPRETED, reason="needs the Triton compiler")
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.parametrize("dtype", ["*bf16", "*fp32"])
def test_kernel_compiles_for_hopper(
    dtype: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sm_90 cubin builds here (no GPU needed)."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    assert hopper_cubin(sm._silu_mul_kernel, dtype, {"BLOCK": 1024})


@pytest.mark.gpu
@pytest.mark.skipif(
    not (torch.cuda.is_available() and sm.HAS_TRITON), reason="needs CUDA and triton"
)
@pytest.mark.parametrize("name", list(_cases()))
def test_cuda_kernel_matches_torch_reference(name: str) -> None:
    case = _cases()[name]
    got = sm.silu_mul(*(case[n].cuda() for n in ("gate", "up")))
    _assert_matches_reference(got.cpu(), case, ulps=2)
