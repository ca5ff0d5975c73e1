"""The grouped MoE experts kernel (``kernels/moe_experts.py``) against a float64 torch reference
(``experts_forward`` with the same experts) on every instruction set this CPU runs: float32
within float32 rounding, bfloat16 within its rounding of the activation and of the output;
batch-invariant bit for bit; AVX2 and AVX-512 give the same bits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from baton.engine.models.moe import clamped_swiglu, experts_forward
from baton.kernels import moe_experts

ISAS = moe_experts.available_isas()
pytestmark = pytest.mark.skipif(not ISAS, reason="the MoE experts kernel does not run here")

# (tokens, hidden, ff, experts, k, biased): odd widths that are no multiple of a vector, one
# row, more experts than pairs (some get none), top 1 to 8.
SHAPES = [
    (1, 64, 32, 4, 2, False),
    (16, 70, 45, 5, 3, True),
    (3, 33, 17, 6, 1, True),
    (16, 96, 40, 32, 8, False),
]
# Largest error over the output's largest magnitude: float32 rounding; bfloat16 rounds the
# activation and the output (2^-8 relative each), and AVX-512 BF16 its pairwise products.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _case(shape: tuple[int, int, int, int, int, bool], dtype: torch.dtype, seed: int = 0):
    t, h, ff, e, k, biased = shape
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=gen).to(dtype)
    gate_up = (torch.randn(e, 2 * ff, h, generator=gen) * 0.2).to(dtype)
    down = (torch.randn(e, h, ff, generator=gen) * 0.2).to(dtype)
    gate_up_bias = torch.randn(e, 2 * ff, generator=gen) if biased else None
    down_bias = torch.randn(e, h, generator=gen) if biased else None
    weights, experts = torch.topk(torch.randn(t, e, generator=gen).softmax(-1), k, dim=-1)
    swiglu = (1.702, 7.0) if biased else None
    grouped = moe_experts.group_experts(gate_up, down, gate_up_bias, down_bias, swiglu)
    return x, weights, experts, grouped


def _reference(x, weights, experts, grouped) -> torch.Tensor:
    h, ff = x.shape[1], grouped.ff
    gate_up = grouped.gate_up[..., :h].double()
    down = grouped.down[..., :ff].double()

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        b1 = None if grouped.gate_up_bias is None else grouped.gate_up_bias[e].double()
        b2 = None if grouped.down_bias is None else grouped.down_bias[e].double()
        g, u = F.linear(rows, gate_up[e], b1).chunk(2, dim=-1)
        act = F.silu(g) * u if grouped.swiglu is None else clamped_swiglu(g, u, *grouped.swiglu)
        return F.linear(act, down[e], b2)

    out = experts_forward(x.double(), weights.double(), experts, gate_up.shape[0], expert)
    return out


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_the_kernel_computes_the_reference(shape, dtype, isa):
    x, weights, experts, grouped = _case(shape, dtype)
    out = moe_experts.moe_experts_cpu(x, weights, experts, grouped, isa)
    ref = _reference(x, weights, experts, grouped)
    assert out.dtype == dtype and out.shape == x.shape
    err = (out.double() - ref).abs().max().item()
    assert err <= TOLERANCE[dtype] * ref.abs().max().item()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_gets_the_same_bits_alone_and_among_others(dtype, isa):
    shape = (16, 70, 45, 8, 4, False)
    x, weights, experts, grouped = _case(shape, dtype)
    together = moe_experts.moe_experts_cpu(x, weights, experts, grouped, isa)
    for t in (0, 7, 15):
        alone = moe_experts.moe_experts_cpu(
            x[t : t + 1], weights[t : t + 1], experts[t : t + 1], grouped, isa
        )
        assert torch.equal(alone[0], together[t])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(moe_experts.moe_experts_cpu(x, weights, experts, grouped, isa), together)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif("avx512" not in ISAS, reason="no AVX-512 here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_avx2_and_avx512_give_the_same_bits(dtype):
    x, weights, experts, grouped = _case((16, 70, 45, 5, 3, True), dtype)
    a = moe_experts.moe_experts_cpu(x, weights, experts, grouped, "avx2")
    b = moe_experts.moe_experts_cpu(x, weights, experts, grouped, "avx512")
    assert torch.equal(a, b)


def test_no_rows_and_bad_input():
    x, weights, experts, grouped = _case((3, 33, 17, 6, 1, True), torch.float32)
    assert moe_experts.moe_experts_cpu(x[:0], weights[:0], experts[:0], grouped).shape == (0, 33)
    with pytest.raises(RuntimeError, match="expert id out of range"):
        moe_experts.moe_experts_cpu(x, weights, experts + 6, grouped)
    with pytest.raises(ValueError, match="isa"):
        moe_experts.moe_experts_cpu(x, weights, experts, grouped, "sse2")
    with pytest.raises(ValueError, match="cannot group"):
        moe_experts.group_experts(grouped.gate_up, grouped.gate_up)
