"""The quantised linear kernel (kernels/quant_linear.py) against gguf's dequantisation.

The packed weights must dequantise bit-exactly to ``gguf.quants.dequantize``; the product is
checked against a float64 matmul of those weights with the error bound of the kernel's float32
summation (see ``_tolerance``); and every row must come out bit-identical alone and inside any
batch, at 1 and 2 threads, on each instruction set this CPU has (others skip with the reason).
"""

from __future__ import annotations

import platform

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from baton.bench.compute.quant_linear import random_blocks
from baton.kernels.quant_formats import FORMATS, dequantize, dequantize_rows, repack
from baton.kernels.quant_linear import (
    ISAS,
    available_isas,
    quant_linear,
    quant_linear_torch,
    repack_native,
)

pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64"), reason="the kernel is built for x86-64 only"
)

U32 = 2.0**-24  # float32 unit roundoff
U_BF16 = 2.0**-8


def _require(isa: str) -> None:
    if isa not in available_isas():
        pytest.skip(f"this CPU lacks the {isa} instructions the kernel's {isa} build needs")


# Formats gguf's numpy quantiser writes (it has no K-quant quantiser).
_QUANTIZABLE = ("Q8_0", "Q4_0", "Q4_1")


def _quantized(fmt: str, n: int, k: int, seed: int) -> np.ndarray:
    """GGUF blocks of a random [n, k] weight made by gguf's quantiser: rows of different
    magnitudes and offsets (Q4_1's m), one row all zeros."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)) * rng.uniform(1e-3, 2.0, (n, 1)) + rng.uniform(-1, 1, (n, 1))
    w[n // 2] = 0.0
    return gguf_quantize(w.astype(np.float32), GGMLQuantizationType[fmt])


def _random_blocks(fmt: str, n: int, k: int, seed: int) -> np.ndarray:
    """Hand-built blocks (``bench.compute.quant_linear.random_blocks``): fp16 scales of either sign,
    which gguf's quantiser never writes (e.g. a negative Q4_0 d)."""
    return random_blocks(fmt, n, k, np.random.default_rng(seed), scale=0.05)


def _shapes(fmt: str) -> list[tuple[int, int]]:
    """[n, k] cases: n off the tile of 4, k as small and as odd as the format allows."""
    if FORMATS[fmt].block_weights == 256:
        return [(1, 256), (7, 512), (13, 768), (130, 1536)]
    return [(1, 32), (7, 96), (13, 576), (130, 1536)]


_CASES = [
    (fmt, n, k, blocks)
    for fmt in sorted(FORMATS)
    for n, k in _shapes(fmt)
    for blocks in (("quantize", "random") if fmt in _QUANTIZABLE else ("random",))
]


def _blocks(kind: str, fmt: str, n: int, k: int, seed: int) -> np.ndarray:
    return (_quantized if kind == "quantize" else _random_blocks)(fmt, n, k, seed)


def _reference(x: torch.Tensor, raw: np.ndarray, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """gguf's dequantisation times x in float64, and sum |x| |w| per output (the error scale)."""
    w = torch.from_numpy(gguf_dequantize(raw, GGMLQuantizationType[fmt])).double()
    xd = x.double()
    return xd @ w.T, xd.abs() @ w.abs().T


def _tolerance(k: int, magnitude: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bound on |kernel - exact|: each product passes through at most k/16 FMAs of its lane and
    the 4 additions of the 16-lane tree, so the float32 error is at most gamma(k/16 + 4) times
    sum |x w| (Higham's bound; the weights themselves are exact); a bfloat16 result adds its own
    rounding, half an ulp of bfloat16 relative to the value (bounded by the same sum)."""
    steps = k // 16 + 4
    gamma = steps * U32 / (1 - steps * U32)
    bound = gamma * magnitude
    if dtype == torch.bfloat16:
        bound = bound + U_BF16 * (magnitude + bound)
    return bound


@pytest.mark.parametrize(("fmt", "n", "k", "blocks"), _CASES)
def test_dequantize_is_gguf_bit_for_bit(fmt: str, n: int, k: int, blocks: str) -> None:
    raw = _blocks(blocks, fmt, n, k, seed=n * k)
    expected = torch.from_numpy(gguf_dequantize(raw, GGMLQuantizationType[fmt]))
    got = dequantize(repack(raw, fmt))
    assert got.dtype == torch.float32 and got.shape == (n, k)
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))  # -0.0 too


@pytest.mark.parametrize(("fmt", "n", "k", "blocks"), _CASES)
def test_native_repack_writes_the_numpy_bytes(fmt: str, n: int, k: int, blocks: str) -> None:
    raw = _blocks(blocks, fmt, n, k, seed=n + 2 * k)
    expected = repack(raw, fmt)
    got = repack_native(raw, fmt)
    assert (got.format, got.n, got.k) == (expected.format, expected.n, expected.k)
    assert torch.equal(got.data, expected.data)
    read_only = raw.copy()
    read_only.flags.writeable = False  # as a memory-mapped file's tensor is
    assert torch.equal(repack_native(read_only, fmt).data, expected.data)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_dequantize_rows_is_an_embedding_lookup(fmt: str) -> None:
    raw = _random_blocks(fmt, 13, 512, seed=4)
    weight = repack(raw, fmt)
    full = torch.from_numpy(gguf_dequantize(raw, GGMLQuantizationType[fmt]))
    rows = torch.tensor([12, 0, 5, 5, 3, 8])
    got = dequantize_rows(weight, rows)
    assert torch.equal(got.view(torch.int32), full[rows].view(torch.int32))
    assert dequantize_rows(weight, torch.tensor([], dtype=torch.long)).shape == (0, 512)
    with pytest.raises(ValueError, match=r"rows must be in \[0, 13\), got 0..13"):
        dequantize_rows(weight, torch.tensor([0, 13]))
    with pytest.raises(ValueError, match="rows must be a 1-D integer tensor"):
        dequantize_rows(weight, torch.tensor([[1]]))


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_packed_is_as_compact_as_the_file(fmt: str) -> None:
    raw = _random_blocks(fmt, 64, 2048, seed=1)
    # Q4_K keeps its 12 bytes of 6-bit scales and mins as 16 bytes; the rest as in the file.
    extra = 4 * 2048 // 256 if fmt == "Q4_K" else 0
    assert repack(raw, fmt).nbytes == raw.nbytes + 64 * extra  # no padding rows at n = 64
    odd = _random_blocks(fmt, 65, 2048, seed=1)
    assert repack(odd, fmt).nbytes == (raw.nbytes // 64 + extra) * 68  # padded to a tile of 4


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("fmt", "n", "k", "blocks"), _CASES)
def test_matches_float64_product_of_gguf_weights(
    isa: str, fmt: str, dtype: torch.dtype, n: int, k: int, blocks: str
) -> None:
    _require(isa)
    raw = _blocks(blocks, fmt, n, k, seed=n + k)
    weight = repack(raw, fmt)
    gen = torch.Generator().manual_seed(k)
    for m in (1, 3, 4, 5, 9, 33):  # across the fused/buffered switch and the row groups
        x = torch.randn(m, k, generator=gen).to(dtype)
        y = quant_linear(x, weight, isa=isa)
        assert y.dtype == dtype and y.shape == (m, n)
        exact, magnitude = _reference(x, raw, fmt)
        err = (y.double() - exact).abs()
        bound = _tolerance(k, magnitude, dtype)
        assert bool((err <= bound).all()), f"M={m}: max err/bound {(err / bound).max():.3g}"


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_torch_reference_within_the_same_bound(fmt: str) -> None:
    raw = _random_blocks(fmt, 9, 512, seed=3)
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(3))
    exact, magnitude = _reference(x, raw, fmt)
    err = (quant_linear_torch(x, repack(raw, fmt)).double() - exact).abs()
    # torch's float32 GEMM sums in another order; a sequential sum's bound covers it.
    assert bool((err <= 512 * U32 / (1 - 512 * U32) * magnitude).all())


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_instruction_sets_give_the_same_bits(fmt: str, dtype: torch.dtype) -> None:
    isas = available_isas()
    if len(isas) < 2:
        pytest.skip(f"this CPU runs only {isas}: nothing to compare")
    weight = repack(_random_blocks(fmt, 37, 768, seed=5), fmt)
    x = torch.randn(11, 768, generator=torch.Generator().manual_seed(5)).to(dtype)
    outs = [quant_linear(x, weight, isa=isa) for isa in isas]
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_bfloat16_is_the_float32_result_rounded(fmt: str) -> None:
    """bfloat16 x is widened exactly and the float32 result rounded as torch rounds it."""
    weight = repack(_random_blocks(fmt, 37, 768, seed=6), fmt)
    x = torch.randn(9, 768, generator=torch.Generator().manual_seed(6)).bfloat16()
    y = quant_linear(x, weight)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, quant_linear(x.float(), weight).bfloat16())


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariant(isa: str, fmt: str, dtype: torch.dtype, restore_threads: None) -> None:
    """A row alone, then inside batches of 1..64 random other rows at a random place, at 1 and 2
    threads (N=101, K=2048 gives 26 tiles, enough for the kernel to split them over threads)."""
    _require(isa)
    n, k = 101, 2048
    weight = repack(_random_blocks(fmt, n, k, seed=7), fmt)
    gen = torch.Generator().manual_seed(7)
    row = torch.randn(1, k, generator=gen).to(dtype)
    torch.set_num_threads(1)
    alone = quant_linear(row, weight, isa=isa)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        assert torch.equal(quant_linear(row, weight, isa=isa), alone)
        for others in range(1, 65):
            batch = torch.randn(others + 1, k, generator=gen).to(dtype)
            at = int(torch.randint(0, others + 1, (1,), generator=gen))
            batch[at] = row[0]
            out = quant_linear(batch, weight, isa=isa)
            assert torch.equal(out[at : at + 1], alone), f"{threads} threads, {others} others"


def test_kernel_threads_follow_torch(restore_threads: None) -> None:
    """The extension is built with OpenMP: its parallel loops use torch's intra-op threads
    (built without, every call ran on one thread whatever torch.set_num_threads said)."""
    from baton.kernels.quant_linear import _extension

    ext = _extension()
    torch.set_num_threads(1)
    assert ext.parallel_threads_used(64) == 1
    torch.set_num_threads(2)
    assert ext.parallel_threads_used(64) == 2


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_native_dequantize_is_gguf_up_to_zero_signs(fmt: str) -> None:
    """The loader's C++ decode gives gguf's values; only a zero's sign may differ (q d - 8 d
    is +0 where gguf's (q - 8) d is -0 for a negative d)."""
    from baton.kernels.quant_linear import dequantize_native

    raw = _random_blocks(fmt, 37, 512, seed=11)
    got = dequantize_native(raw, fmt).numpy()
    want = gguf_dequantize(raw, GGMLQuantizationType[fmt]).reshape(37, 512).astype(np.float32)
    assert got.shape == (37, 512) and np.array_equal(got, want)
    differ = got.view(np.uint32) != want.view(np.uint32)
    assert np.all(got[differ] == 0)


def test_strided_x_is_the_same_as_contiguous() -> None:
    weight = repack(_random_blocks("Q4_K", 9, 512, seed=8), "Q4_K")
    wide = torch.randn(5, 1024, generator=torch.Generator().manual_seed(8))
    x = wide[:, ::2]  # every other column: a strided view
    assert torch.equal(quant_linear(x, weight), quant_linear(x.contiguous(), weight))


def test_no_rows() -> None:
    weight = repack(_quantized("Q4_1", 6, 64, seed=0), "Q4_1")
    for dtype in (torch.float32, torch.bfloat16):
        y = quant_linear(torch.empty(0, 64, dtype=dtype), weight)
        assert y.shape == (0, 6) and y.dtype == dtype


def test_bad_inputs_name_what_is_wrong() -> None:
    raw = _quantized("Q8_0", 8, 64, seed=0)
    weight = repack(raw, "Q8_0")
    with pytest.raises(ValueError, match=r"x must be a 2-D float32/bfloat16 tensor.*float16"):
        quant_linear(torch.zeros(2, 64, dtype=torch.float16), weight)
    with pytest.raises(ValueError, match=r"x must be a 2-D .*shape \(64,\)"):
        quant_linear(torch.zeros(64), weight)
    with pytest.raises(ValueError, match=r"x has 96 features but the Q8_0 weight \[8, 64\]"):
        quant_linear(torch.zeros(2, 96), weight)
    with pytest.raises(ValueError, match=r"tensor type 'Q5_K' has no quantised kernel"):
        repack(raw, "Q5_K")
    with pytest.raises(ValueError, match=r"raw must be a 2-D uint8 array of Q8_0 blocks.*int8"):
        repack(raw.view(np.int8), "Q8_0")
    with pytest.raises(ValueError, match=r"rows of 68 bytes are not whole Q4_0 blocks of 18"):
        repack(raw, "Q4_0")
    with pytest.raises(ValueError, match=r"rows of 68 bytes are not whole Q4_K blocks of 144"):
        repack(raw, "Q4_K")
    with pytest.raises(ValueError, match=r"rows of 68 bytes are not whole Q4_K blocks of 144"):
        repack_native(raw, "Q4_K")
    with pytest.raises(ValueError, match=r"tensor type 'IQ4_NL' has no quantised kernel"):
        repack_native(raw, "IQ4_NL")
    with pytest.raises(ValueError, match=r"isa 'sse2' is not available on this CPU"):
        quant_linear(torch.zeros(1, 64), weight, isa="sse2")


def test_an_extension_is_named_by_the_headers_it_includes_only() -> None:
    """Editing one extension's header must not rebuild another (the build name hashes the
    source and the headers it includes, directly or through each other)."""
    from baton.kernels.cpp_build import CSRC, included_headers

    names = {p.name for p in included_headers(CSRC / "quant_linear.cpp")}
    assert {"quant_linear_body.h", "quant_linear_q8k.h", "quant_repack.h"} <= names
    # cpu_ops' kernels are in the fused decode layer too (through cpu_ops_impl.h); the
    # quantised kernels' headers are not in cpu_ops.
    ops = {p.name for p in included_headers(CSRC / "cpu_ops.cpp")}
    assert ops == {"cpu_ops_impl.h", "decode_attention.h", "v16_avx2.h", "v16_avx512.h"}
    assert ops <= names
