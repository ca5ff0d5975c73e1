"""``QuantProjection``: several packed weights of one ``k`` in one C++ call (a fused projection
whose parts differ in GGUF type). Its columns are the one-weight kernel's, bit for bit, for
float32 and int8 activations, every row count, dtype and instruction set; its weights are
checked once and x on every call, in C++.
"""

from __future__ import annotations

import platform

import numpy as np
import pytest
import torch

from baton.bench.compute.quant_linear import random_blocks
from baton.kernels.quant_formats import repack
from baton.kernels.quant_linear import ISAS, QuantProjection, available_isas, quant_linear

pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64"), reason="the kernel is built for x86-64 only"
)

K = 512


def _weight(fmt: str, n: int, seed: int):
    return repack(random_blocks(fmt, n, K, np.random.default_rng(seed), scale=0.05), fmt)


# A Q4_K_M layer's q, k, v (v in Q6_K) with a column count that is not a multiple of the tile,
# and a 32-weight format beside them (float32 activations whatever is asked).
PARTS = (("Q4_K", 36), ("Q4_K", 9), ("Q6_K", 9), ("Q8_0", 6))


@pytest.mark.parametrize("activations", ["float32", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", ISAS)
def test_the_columns_are_the_one_weight_kernels_bit_for_bit(
    activations: str, dtype: torch.dtype, isa: str
) -> None:
    if isa not in available_isas():
        pytest.skip(f"this CPU does not run {isa}")
    weights = [_weight(fmt, n, seed) for seed, (fmt, n) in enumerate(PARTS)]
    projection = QuantProjection(weights, isa=isa, activations=activations)
    assert (projection.n, projection.k) == (sum(n for _, n in PARTS), K)
    for m in (1, 3, 8):
        x = (torch.randn(m, K, generator=torch.Generator().manual_seed(m)) * 2).to(dtype)
        want = torch.cat([quant_linear(x, w, isa=isa, activations=activations) for w in weights], 1)
        got = projection(x)
        assert got.dtype == dtype and got.shape == (m, projection.n)
        assert torch.equal(got, want), (m, (got.float() - want.float()).abs().max())


def test_the_threads_take_shares_of_the_bytes_and_the_bits_stay() -> None:
    weights = [_weight("Q4_K", 64, 1), _weight("Q6_K", 256, 2), _weight("Q4_K", 8, 3)]
    projection = QuantProjection(weights, activations="int8")
    x = torch.randn(2, K, generator=torch.Generator().manual_seed(0))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = projection(x)
        torch.set_num_threads(2)
        two = projection(x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_weights_are_checked_once_and_x_on_every_call() -> None:
    with pytest.raises(ValueError, match="at least one weight"):
        QuantProjection([])
    other_k = repack(random_blocks("Q4_K", 4, 256, np.random.default_rng(0)), "Q4_K")
    with pytest.raises(ValueError, match="share k"):
        QuantProjection([_weight("Q4_K", 4, 0), other_k])
    with pytest.raises(ValueError, match="activations"):
        QuantProjection([_weight("Q4_K", 4, 0)], activations="int4")
    projection = QuantProjection([_weight("Q4_K", 4, 0)])
    with pytest.raises(RuntimeError, match=f"2-D CPU tensor of {K} columns"):
        projection(torch.zeros(1, K + 1))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        projection(torch.zeros(1, K, dtype=torch.float16))
    assert projection(torch.zeros(0, K)).shape == (0, 4)
