"""Tests of baton.kernels.rope: the torch reference against the model's rotation, the Triton
kernel against the reference (under the Triton interpreter, compiled for Hopper, and on CUDA),
argument validation and the dispatch."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from kernel_testing import hopper_cubin

from baton.engine.models.layers import RotaryEmbedding
from baton.kernels import rope as rp

if TYPE_CHECKING:
    from conftest import InterpreterRun

_INTERPRETER_RUNNER = """
import sys, torch
from baton.kernels import rope as rp
assert rp._INTERPRETED, "TRITON_INTERPRET=1 did not select the interpreter"
cases = torch.load(sys.argv[1])
torch.save({n: rp.rope_triton(c["q"], c["k"], c["cos"], c["sin"]) for n, c in cases.items()},
           sys.argv[2])
"""


def _cases() -> dict[str, dict[str, torch.Tensor]]:
    """SmolLM2's heads (9 / 3, dim 64) and others, each dtype, contiguous and as the strided
    views of a fused QKV projection the model passes."""
    gen = torch.Generator().manual_seed(0)
    cases = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for tokens, heads, kv_heads, dim in ((1, 9, 3, 64), (7, 4, 2, 16), (3, 2, 1, 128)):
            rope = RotaryEmbedding(dim, 4096, 10000.0, None)
            positions = torch.randint(0, 4096, (tokens,), generator=gen)
            cos, sin = rope.cos_sin(positions, dtype)
            qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
            q, k, _ = qkv.split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)
            base = f"{str(dtype)[6:]}_{tokens}x{heads}x{kv_heads}x{dim}"
            strided = {
                "q": q.reshape(tokens, heads, dim),
                "k": k.reshape(tokens, kv_heads, dim),
                "cos": cos,
                "sin": sin,
            }
            cases[base + "_strided"] = strided
            cases[base] = {n: t.contiguous() for n, t in strided.items()}
    return cases


def _rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face's rotation, written out: ``x * cos + rotate_half(x) * sin``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * torch.cat((cos, cos), dim=-1) + rotated * torch.cat((sin, sin), dim=-1)


@pytest.mark.parametrize("name", list(_cases()))
def test_reference_is_hugging_faces_rotation(name: str) -> None:
    c = _cases()[name]
    got = rp.rope_torch(c["q"], c["k"], c["cos"], c["sin"])
    for g, x in zip(got, (c["q"], c["k"]), strict=True):
        # The same products and sums (negating is exact), in the same order.
        assert torch.equal(g, _rotate_half(x, c["cos"], c["sin"]))


@pytest.fixture(scope="module")
def interpreted(
    tmp_path_factory: pytest.TempPathFactory, run_interpreted: InterpreterRun
) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("rope_interpreter")
    return run_interpreted(_INTERPRETER_RUNNER, _cases(), folder)


def _assert_matches_reference(
    got: tuple[torch.Tensor, torch.Tensor], case: dict[str, torch.Tensor], exact: bool
) -> None:
    want = rp.rope_torch(case["q"], case["k"], case["cos"], case["sin"])
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape and g.is_contiguous()
        if exact:
            assert torch.equal(g, w)
        else:
            torch.testing.assert_close(g.float(), w.float(), rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("name", list(_cases()))
def test_interpreted_kernel_matches_torch_reference(name: str, interpreted: dict[str, Any]) -> None:
    case = _cases()[name]
    # The interpreter emulates bfloat16 by truncating each conversion (numpy has no bfloat16);
    # float32 and float16 round as torch does there, so those match bit for bit.
    _assert_matches_reference(interpreted[name], case, exact=case["q"].dtype != torch.bfloat16)


_OK = _cases()["float32_7x4x2x16"]
_BAD = [
    ({"q": torch.ones(7, 64)}, "q"),
    ({"q": torch.ones(7, 4, 16, dtype=torch.int64)}, "q"),
    ({"k": torch.ones(6, 2, 16)}, "k"),
    ({"k": torch.ones(7, 2, 16, dtype=torch.float16)}, "k"),
    ({"q": torch.ones(7, 4, 15), "k": torch.ones(7, 2, 15)}, "even"),
    ({"cos": torch.ones(7, 1, 16)}, "cos"),
    ({"sin": torch.ones(7, 1, 8, dtype=torch.bfloat16)}, "sin"),
    ({"sin": torch.ones(7, 1, 8, device="meta")}, "sin"),
]


@pytest.mark.parametrize("fn", [rp.rope_torch, rp.rope_triton])
@pytest.mark.parametrize(("change", "named"), _BAD)
def test_bad_arguments_raise_value_error_naming_them(fn: Any, change: dict, named: str) -> None:
    if fn is rp.rope_triton and not rp.HAS_TRITON:
        pytest.skip("triton is not installed")
    args = {**_OK, **change}
    with pytest.raises(ValueError, match=named):
        fn(args["q"], args["k"], args["cos"], args["sin"])


@pytest.mark.skipif(not rp.HAS_TRITON or rp._INTERPRETED, reason="needs the Triton compiler")
def test_triton_refuses_cpu_tensors_outside_the_interpreter() -> None:
    with pytest.raises(ValueError, match="CUDA device"):
        rp.rope_triton(_OK["q"], _OK["k"], _OK["cos"], _OK["sin"])


def test_dispatcher_uses_the_torch_reference_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbid(*args: Any) -> Any:
        raise AssertionError("the dispatcher used the Triton kernel on CPU tensors")

    monkeypatch.setattr(rp, "rope_triton", forbid)
    c = _cases()["bfloat16_1x9x3x64_strided"]
    got = rp.rope(c["q"], c["k"], c["cos"], c["sin"])
    want = rp.rope_torch(c["q"], c["k"], c["cos"], c["sin"])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.skipif(not rp.HAS_TRITON or rp._INTERPRETED, reason="needs the Triton compiler")
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.parametrize("dtype", ["*bf16", "*fp32"])
def test_kernel_compiles_for_hopper(
    dtype: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sm_90 cubin builds here (no GPU needed)."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    cubin = hopper_cubin(rp._rope_kernel, dtype, {"BLOCK": 32}, options=rp.LAUNCH_OPTIONS)
    assert cubin


@pytest.mark.skipif(not rp.HAS_TRITON or rp._INTERPRETED, reason="needs the Triton compiler")
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.parametrize("dtype", ["*bf16", "*fp16", "*fp32"])
def test_launch_options_keep_products_and_sums_apart(
    dtype: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the launch's options the sm_90 PTX multiplies and then adds, with no fused
    multiply-add (which rounds once where torch rounds twice); without them it fuses."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    ptx = hopper_cubin(rp._rope_kernel, dtype, {"BLOCK": 32}, options=rp.LAUNCH_OPTIONS, asm="ptx")
    assert "mul.rn." in ptx and "fma." not in ptx
    fused = {**rp.LAUNCH_OPTIONS, "enable_fp_fusion": True}
    ptx = hopper_cubin(rp._rope_kernel, dtype, {"BLOCK": 32}, options=fused, asm="ptx")
    assert "fma." in ptx


@pytest.mark.gpu
@pytest.mark.skipif(
    not (torch.cuda.is_available() and rp.HAS_TRITON), reason="needs CUDA and triton"
)
@pytest.mark.parametrize("name", list(_cases()))
def test_cuda_kernel_matches_torch_reference(name: str) -> None:
    case = _cases()[name]
    got = rp.rope(*(case[n].cuda() for n in ("q", "k", "cos", "sin")))
    # Every product and sum rounds as torch's ops do (no fused multiply-add), in every dtype.
    _assert_matches_reference((got[0].cpu(), got[1].cpu()), case, exact=True)
