"""The quantised linear kernel with int8 activations (``activations="int8"``, llama.cpp's
numerics for Q4_K and Q6_K weights, ``csrc/quant_linear_q8k.h``) against its torch reference.

The kernel quantises each row of x per 256 values exactly as ``quantize_rows_int8`` does (the
same bits), and its value is that of ``quant_linear_int8_torch`` (float64) up to the float32
steps it takes per super block. Its distance from the float32-activation product is bounded by
half a quantisation step of x per weight. Every row comes out bit-identical alone and inside
any batch, at 1 and 2 threads, on every instruction set (the same bits on each).
"""

from __future__ import annotations

import platform

import numpy as np
import pytest
import torch

from baton.bench.compute.quant_linear import random_blocks
from baton.kernels.quant_formats import dequantize, repack
from baton.kernels.quant_linear import (
    INT8_FORMATS,
    ISAS,
    available_isas,
    quant_linear,
    quant_linear_int8_torch,
    quantize_rows_int8,
)

pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64"), reason="the kernel is built for x86-64 only"
)

U32 = 2.0**-24


def _weight(fmt: str, n: int, k: int, seed: int):
    return repack(random_blocks(fmt, n, k, np.random.default_rng(seed), scale=0.05), fmt)


def _x(m: int, k: int, seed: int) -> torch.Tensor:
    """Rows of different magnitudes, one all zeros, one with a single large value."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 4
    x[m // 2] = 0.0
    if m > 2:
        x[1, 7] = 300.0
    return x


def test_the_torch_quantiser_rounds_to_nearest_even() -> None:
    x = torch.zeros(1, 256)
    x[0, 0] = 127.0  # amax 127: the scale is 1, so q is x rounded
    x[0, 1:5] = torch.tensor([0.5, 1.5, -2.5, 2.4999])
    q, d = quantize_rows_int8(x)
    assert d.tolist() == [[1.0]]
    assert q[0, :5].tolist() == [127.0, 0.0, 2.0, -2.0, 2.0]


@pytest.mark.parametrize("fmt", INT8_FORMATS)
@pytest.mark.parametrize("n,k", [(1, 256), (7, 512), (130, 1536), (33, 2048), (9, 4096)])
def test_matches_the_torch_reference(fmt: str, n: int, k: int) -> None:
    """Within the float32 rounding of its per-super-block steps (K/256 FMAs per lane, a 2-level
    tree, the scale products, the int32 -> float32 conversions), bounded with room by 4 gamma
    of sum |x_q w| (the two Q4_K terms each are at most about that sum)."""
    weight = _weight(fmt, n, k, seed=n + k)
    x = _x(9, k, seed=k)
    ref = quant_linear_int8_torch(x, weight)
    q, d = quantize_rows_int8(x)
    xq = (q.double().reshape(9, -1, 256) * d.double().unsqueeze(-1)).reshape(9, k)
    magnitude = xq.abs() @ dequantize(weight).double().abs().T
    steps = k // 256 + 8
    bound = 4 * steps * U32 * magnitude + 1e-30
    out = quant_linear(x, weight, activations="int8").double()
    assert ((out - ref).abs() <= bound).all(), ((out - ref).abs() / bound).max()
    assert torch.equal(out[9 // 2], torch.zeros(n, dtype=torch.float64))  # the zero row


@pytest.mark.parametrize("fmt", INT8_FORMATS)
def test_within_half_a_step_of_x_from_the_exact_product(fmt: str) -> None:
    """|y_int8 - x @ w| <= sum_i |w_i| dx_i / 2 (each x_i moves by at most half its block's
    step dx), plus float32 slack; and the two really differ (the int8 path ran)."""
    n, k = 37, 1024
    weight = _weight(fmt, n, k, seed=3)
    x = _x(5, k, seed=3)
    w = dequantize(weight).double()
    exact = x.double() @ w.T
    _, d = quantize_rows_int8(x)
    step = d.double().repeat_interleave(256, dim=1)  # dx per element of x
    bound = 0.5 * step @ w.abs().T + 1e-4 * (x.double().abs() @ w.abs().T)
    out = quant_linear(x, weight, activations="int8").double()
    assert ((out - exact).abs() <= bound).all()
    assert not torch.equal(out, quant_linear(x, weight).double())


@pytest.mark.parametrize("fmt", INT8_FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_instruction_sets_give_the_same_bits(fmt: str, dtype: torch.dtype) -> None:
    isas = available_isas()
    if len(isas) < 2:
        pytest.skip(f"this CPU runs only {isas}: nothing to compare")
    weight = _weight(fmt, 37, 768, seed=5)
    x = _x(11, 768, seed=5).to(dtype)
    outs = [quant_linear(x, weight, isa=isa, activations="int8") for isa in isas]
    assert outs[0].dtype == dtype
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", INT8_FORMATS)
def test_batch_invariant(isa: str, fmt: str, restore_threads: None) -> None:
    """A row alone, then inside batches of 1..40 other rows at a random place (every residue of
    the kernel's row blocking), at 1 and 2 threads."""
    if isa not in available_isas():
        pytest.skip(f"this CPU lacks the {isa} instructions")
    n, k = 101, 2048
    weight = _weight(fmt, n, k, seed=7)
    gen = torch.Generator().manual_seed(7)
    row = torch.randn(1, k, generator=gen).bfloat16()
    torch.set_num_threads(1)
    alone = quant_linear(row, weight, isa=isa, activations="int8")
    for threads in (1, 2):
        torch.set_num_threads(threads)
        assert torch.equal(quant_linear(row, weight, isa=isa, activations="int8"), alone)
        for others in range(1, 41):
            batch = torch.randn(others + 1, k, generator=gen).bfloat16()
            at = int(torch.randint(0, others + 1, (1,), generator=gen))
            batch[at] = row[0]
            out = quant_linear(batch, weight, isa=isa, activations="int8")
            assert torch.equal(out[at : at + 1], alone), f"{threads} threads, {others} others"


def test_block32_formats_take_float32_activations() -> None:
    """int8 is for the K-quants only: a Q4_0 weight gives its float32 product either way."""
    weight = _weight("Q4_0", 9, 256, seed=1)
    x = _x(3, 256, seed=1)
    assert torch.equal(quant_linear(x, weight, activations="int8"), quant_linear(x, weight))


def test_bad_activations_and_reference_formats_are_named() -> None:
    weight = _weight("Q4_K", 4, 256, seed=2)
    with pytest.raises(ValueError, match="activations must be one of"):
        quant_linear(torch.zeros(1, 256), weight, activations="int4")
    with pytest.raises(ValueError, match="int8 activations are taken by"):
        quant_linear_int8_torch(torch.zeros(1, 256), _weight("Q8_0", 4, 256, seed=2))
