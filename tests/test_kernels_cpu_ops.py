"""The CPU's one-call RMSNorm and RoPE (``kernels/cpu_ops.py``) against their torch references:
RoPE bit for bit, RMSNorm within the mean's rounding; both batch-invariant."""

from __future__ import annotations

import pytest
import torch

from baton.kernels import cpu_ops
from baton.kernels.rms_norm import rms_norm, rms_norm_torch
from baton.kernels.rope import rope, rope_torch

pytestmark = pytest.mark.skipif(
    cpu_ops.extension() is None, reason="the CPU ops extension does not build here"
)
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _angles(tokens: int, half: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.arange(tokens, dtype=torch.float32)[:, None]
    freq = 1.0 / (10000.0 ** (torch.arange(half, dtype=torch.float32) / half))
    angle = (pos * freq)[:, None, :]
    return angle.cos().to(dtype), angle.sin().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_is_the_reference_bit_for_bit(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    tokens, heads, kv_heads, dim = 7, 9, 3, 64
    # q and k as views of one fused projection, as the model passes them.
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    q = qkv[:, : heads * dim].reshape(tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].reshape(tokens, kv_heads, dim)
    cos, sin = _angles(tokens, dim // 2, dtype)
    assert cpu_ops.rope_fits(q, k, cos, sin)
    got_q, got_k = cpu_ops.rope_cpu(q, k, cos, sin)
    want_q, want_k = rope_torch(q, k, cos, sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert all(
        torch.equal(a, b) for a, b in zip(rope(q, k, cos, sin), (want_q, want_k), strict=True)
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_the_reference(dtype: torch.dtype, with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 576, generator=gen).to(dtype)
    residual = torch.randn(5, 576, generator=gen).to(dtype) if with_residual else None
    weight = (1 + 0.1 * torch.randn(576, generator=gen)).to(dtype)
    out, summed = cpu_ops.rms_norm_cpu(x, weight, 1e-5, residual)
    want, want_summed = rms_norm_torch(x, weight, 1e-5, residual)
    if with_residual:
        assert torch.equal(summed, want_summed)  # the residual stream: exact
    else:
        assert summed is None
    # Only the mean's summation order differs: float32 to a few ulps, bfloat16 at most one
    # bfloat16 rounding step on a few elements.
    tol = 1e-6 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(out.float(), want.float(), rtol=tol, atol=tol)
    assert torch.equal(rms_norm(x, weight, 1e-5, residual)[0], out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_both_are_batch_invariant(dtype: torch.dtype, restore_threads: None) -> None:
    gen = torch.Generator().manual_seed(2)
    hidden, heads, dim = 2048, 4, 64
    weight = torch.randn(hidden, generator=gen).to(dtype)
    row = torch.randn(1, hidden, generator=gen).to(dtype)
    res = torch.randn(1, hidden, generator=gen).to(dtype)
    torch.set_num_threads(1)
    alone = cpu_ops.rms_norm_cpu(row, weight, 1e-6, res)[0]
    head = row[:, : heads * dim].reshape(1, heads, dim)
    cos, sin = _angles(1, dim // 2, dtype)
    rot_alone = cpu_ops.rope_cpu(head, head, cos, sin)[0]
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for others in (1, 7, 63):
            batch = torch.randn(others + 1, hidden, generator=gen).to(dtype)
            resb = torch.randn(others + 1, hidden, generator=gen).to(dtype)
            batch[others // 2], resb[others // 2] = row[0], res[0]
            out = cpu_ops.rms_norm_cpu(batch, weight, 1e-6, resb)[0]
            assert torch.equal(out[others // 2], alone[0]), f"{threads} threads, {others}"
            heads_b = batch[:, : heads * dim].reshape(others + 1, heads, dim)
            cosb, sinb = _angles(others + 1, dim // 2, dtype)
            cosb[others // 2], sinb[others // 2] = cos[0], sin[0]
            rot = cpu_ops.rope_cpu(heads_b, heads_b, cosb, sinb)[0]
            assert torch.equal(rot[others // 2], rot_alone[0])


def test_shapes_the_ops_refuse_fall_back_to_torch() -> None:
    x = torch.randn(4, 8)[:, ::2]  # strided rows
    weight = torch.ones(4)
    assert not cpu_ops.rms_norm_fits(x, weight, None)
    torch.testing.assert_close(rms_norm(x, weight, 1e-5)[0], rms_norm_torch(x, weight, 1e-5)[0])
    half = torch.randn(3, 2, 8, dtype=torch.float16)
    cos, sin = _angles(3, 4, torch.float16)
    assert not cpu_ops.rope_fits(half, half, cos, sin)
    assert all(
        torch.equal(a, b)
        for a, b in zip(rope(half, half, cos, sin), rope_torch(half, half, cos, sin), strict=True)
    )
