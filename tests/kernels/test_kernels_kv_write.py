"""Tests of baton.kernels.kv_write: the torch reference against a plain loop, the Triton kernel
against the reference bit for bit (under the Triton interpreter, compiled for Hopper, and on
CUDA), argument validation and the dispatch."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from kernel_testing import hopper_cubin

from baton.kernels import kv_write as kw

if TYPE_CHECKING:
    from conftest import InterpreterRun

_INTERPRETER_RUNNER = """
import sys, torch
from baton.kernels import kv_write as kw
assert kw._INTERPRETED, "TRITON_INTERPRET=1 did not select the interpreter"
cases = torch.load(sys.argv[1])
out = {}
for name, c in cases.items():
    kc, vc = c["key_cache"].clone(), c["value_cache"].clone()
    kw.kv_write_triton_(kc, vc, c["k"], c["v"], c["slots"])
    out[name] = (kc, vc)
torch.save(out, sys.argv[2])
"""


def _cases() -> dict[str, dict[str, torch.Tensor]]:
    """SmolLM2's KV heads (3, dim 64) and others, each dtype; k contiguous (the RoPE kernel's
    output) and v a strided view of a fused QKV projection, as the model passes them; caches
    full of random values that the unwritten slots must keep; 0 tokens too."""
    gen = torch.Generator().manual_seed(0)
    cases = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for tokens, heads, kv_heads, dim, blocks, block in (
            (1, 9, 3, 64, 4, 16),
            (7, 4, 2, 16, 3, 4),
            (5, 2, 1, 128, 2, 8),
            (0, 2, 1, 32, 1, 4),
        ):
            width = (heads + 2 * kv_heads) * dim
            qkv = torch.randn(tokens, width, generator=gen).to(dtype)
            _, k, v = qkv.split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)
            slots = torch.randperm(blocks * block, generator=gen)[:tokens]
            cache = (blocks * block, kv_heads, dim)  # the caches seen flat, as the model passes
            cases[f"{str(dtype)[6:]}_{tokens}x{kv_heads}x{dim}"] = {
                "key_cache": torch.randn(cache, generator=gen).to(dtype),
                "value_cache": torch.randn(cache, generator=gen).to(dtype),
                "k": k.reshape(tokens, kv_heads, dim).contiguous(),
                "v": v.reshape(tokens, kv_heads, dim),
                "slots": slots,
            }
    return cases


def _reference(c: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    kc, vc = c["key_cache"].clone(), c["value_cache"].clone()
    kw.kv_write_torch_(kc, vc, c["k"], c["v"], c["slots"])
    return kc, vc


@pytest.mark.parametrize("name", list(_cases()))
def test_reference_writes_each_token_into_its_slot_only(name: str) -> None:
    c = _cases()[name]
    kc, vc = _reference(c)
    want_k, want_v = c["key_cache"].clone(), c["value_cache"].clone()
    for t, slot in enumerate(c["slots"].tolist()):
        want_k[slot] = c["k"][t]
        want_v[slot] = c["v"][t]
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


@pytest.fixture(scope="module")
def interpreted(
    tmp_path_factory: pytest.TempPathFactory, run_interpreted: InterpreterRun
) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("kv_write_interpreter")
    return run_interpreted(_INTERPRETER_RUNNER, _cases(), folder)


@pytest.mark.parametrize("name", list(_cases()))
def test_interpreted_kernel_matches_torch_reference(name: str, interpreted: dict[str, Any]) -> None:
    want = _reference(_cases()[name])
    got = interpreted[name]
    # A copy: every dtype bit for bit, the unwritten slots untouched.
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_interpreted_kernel_skips_slots_outside_the_cache(
    tmp_path: Path, run_interpreted: InterpreterRun
) -> None:
    c = _cases()["float32_7x2x16"]
    c["slots"] = torch.tensor([0, -1, 11, 12, 10**12, 5, 3])  # 3 blocks of 4: 12 slots
    got = run_interpreted(_INTERPRETER_RUNNER, {"x": c}, tmp_path)["x"]
    num_slots = c["key_cache"].shape[0]
    inside = [(t, s) for t, s in enumerate(c["slots"].tolist()) if 0 <= s < num_slots]
    want = {
        **c,
        "k": c["k"][[t for t, _ in inside]],
        "v": c["v"][[t for t, _ in inside]].contiguous(),
        "slots": torch.tensor([s for _, s in inside]),
    }
    want_k, want_v = _reference(want)
    assert torch.equal(got[0], want_k) and torch.equal(got[1], want_v)


_OK = _cases()["float32_7x2x16"]
_BAD = [
    ({"key_cache": torch.ones(12, 32)}, "key_cache"),
    ({"key_cache": torch.ones(12, 2, 16, dtype=torch.int64)}, "key_cache"),
    ({"key_cache": torch.ones(12, 16, 2).transpose(1, 2)}, "key_cache"),
    ({"value_cache": torch.ones(12, 2, 8)}, "value_cache"),
    ({"value_cache": torch.ones(12, 2, 16, dtype=torch.float16)}, "value_cache"),
    ({"k": torch.ones(7, 3, 16)}, "k"),
    ({"k": torch.ones(7, 2, 16, dtype=torch.float16)}, "k"),
    ({"v": torch.ones(6, 2, 16)}, "v"),
    ({"slots": torch.zeros(7, dtype=torch.int32)}, "slot_mapping"),
    ({"slots": torch.zeros(6, dtype=torch.int64)}, "slot_mapping"),
    ({"slots": torch.zeros(7, dtype=torch.int64, device="meta")}, "slot_mapping"),
]


@pytest.mark.parametrize("fn", [kw.kv_write_torch_, kw.kv_write_triton_])
@pytest.mark.parametrize(("change", "named"), _BAD)
def test_bad_arguments_raise_value_error_naming_them(fn: Any, change: dict, named: str) -> None:
    if fn is kw.kv_write_triton_ and not kw.HAS_TRITON:
        pytest.skip("triton is not installed")
    a = {**_OK, **change}
    with pytest.raises(ValueError, match=named):
        fn(a["key_cache"], a["value_cache"], a["k"], a["v"], a["slots"])


@pytest.mark.skipif(not kw.HAS_TRITON or kw._INTERPRETED, reason="needs the Triton compiler")
def test_triton_refuses_cpu_tensors_outside_the_interpreter() -> None:
    with pytest.raises(ValueError, match="CUDA device"):
        kw.kv_write_triton_(_OK["key_cache"], _OK["value_cache"], _OK["k"], _OK["v"], _OK["slots"])


def test_dispatcher_uses_the_torch_reference_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbid(*args: Any) -> Any:
        raise AssertionError("the dispatcher used the Triton kernel on CPU tensors")

    monkeypatch.setattr(kw, "kv_write_triton_", forbid)
    c = _cases()["bfloat16_1x3x64"]
    kc, vc = c["key_cache"].clone(), c["value_cache"].clone()
    kw.kv_write_(kc, vc, c["k"], c["v"], c["slots"])
    want = _reference(c)
    assert torch.equal(kc, want[0]) and torch.equal(vc, want[1])


@pytest.mark.skipif(not kw.HAS_TRITON or kw._INTERPRETED, reason="needs the Triton compiler")
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.parametrize("dtype", ["*bf16", "*fp32"])
def test_kernel_compiles_for_hopper(
    dtype: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sm_90 cubin builds here (no GPU needed)."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    cubin = hopper_cubin(
        kw._kv_write_kernel, dtype, {"BLOCK": 256}, {"slot_ptr": "*i64"}, num_warps=1
    )
    assert cubin


@pytest.mark.gpu
@pytest.mark.skipif(
    not (torch.cuda.is_available() and kw.HAS_TRITON), reason="needs CUDA and triton"
)
@pytest.mark.parametrize("name", list(_cases()))
def test_cuda_kernel_matches_torch_reference(name: str) -> None:
    c = {n: t.cuda() for n, t in _cases()[name].items()}
    kc, vc = c["key_cache"].clone(), c["value_cache"].clone()
    kw.kv_write_triton_(kc, vc, c["k"], c["v"], c["slots"])
    want = _reference({n: t.cpu() for n, t in c.items()})
    assert torch.equal(kc.cpu(), want[0]) and torch.equal(vc.cpu(), want[1])
