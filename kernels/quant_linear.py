"""Linear layers on GGUF block-quantised weights (Q8_0, Q4_0, Q4_1, Q4_K) kept quantised on
the CPU: a C++ kernel (``csrc/quant_linear.cpp``) and its torch reference. The weights are
repacked by ``quant_formats.repack``.

``y[M, N] = x[M, K] @ dequant(W)[N, K]^T`` for ``x`` float32 or bfloat16; the result is in
``x``'s dtype, accumulated in float32. The formats, per block of 32 weights of a row of W:
Q8_0 ``d * q`` (int8 q, fp16 d), Q4_0 ``d * (q - 8)`` (4-bit q), Q4_1 ``d * q + m`` (fp16 d, m);
Q4_K ``(d * sc) * q - dmin * m`` (fp16 d, dmin per 256 weights, 6-bit sc, m per 32).

What torch already gives, measured 2026-12-06 with torch 2.13.0 on an AMD EPYC (Genoa, AVX-512,
AVX512-BF16), a 512 x 2048 weight quantised with ``gguf.quants.quantize``, 1 and 2 threads:

- ``aten._weight_int4pack_mm_for_cpu`` (4-bit q, per-group scale and zero, ``(q - 8) * scale +
  zero``) represents Q4_0 (zero 0) and Q4_1 (zero ``m + 8 d``) bit-exactly when x and the
  scales are float32 (all 1,048,576 weights equal gguf's dequantisation), but not for bfloat16:
  the scales must then be bfloat16, which rounds fp16's 11-bit d (10-33% of the weights
  differ). It was batch-invariant (row 0 bit-identical for M = 1..64, 1 and 2 threads). It
  stores 8 bytes of float32 scale and zero per 32 weights (0.75 bytes a weight against Q4_1's
  0.625) and has no 5-, 6- or 8-bit form. Its float32 path, the exact one, is slow: a 16384 x
  2048 weight took 115 ms at M=1 and 7.2 s at M=64 (2 threads, load average about 4.7), where
  this kernel took 2.7 ms at M=1. Its bfloat16 path (inexact, as above) is fast: on one thread
  (``bench/compute/quant_linear.py``, a 1B-shape layer, load 4-5.6) it matched or beat this kernel
  up to 16 rows (Q4_0 M=1 3.5 against 4.1 ms, M=8 13.0 against 17.5) and lost at 64 (102 against
  89 ms).
- ``aten._weight_int8pack_mm`` has one scale per output row, so it cannot represent Q8_0's
  scale per 32 weights (it was batch-invariant too).

So Q8_0 (the default model's embedding and tied LM head) and the K-quants need a kernel of our
own; ``bench/compute/quant_linear.py`` measures torch's int4 kernel beside ours for Q4_0/Q4_1.

This kernel's weights are bit-exact to ``gguf.quants.dequantize``: every product of an fp16
scale and a small integer is exact in float32, Q4_0's ``q * d - 8 d`` is one exact FMA, and
Q4_1's ``fma(q, d, m)`` and Q4_K's ``fma(q, d * sc, -(dmin * m))`` round once where gguf's
``d * q + m`` and ``(d * sc) * q - dmin * m`` round once (after exact products). Each output
element is one 16-lane float32 accumulator walked over K in a fixed order and summed by a fixed
tree, whatever M, the other rows, the register blocking or the thread count: the kernel is
batch-invariant by construction, and the AVX2 and AVX-512 builds compute the same bits
(``csrc/quant_linear_body.h``). AVX512-BF16 / AMX-BF16 are not used: they need bfloat16
weights, and a GGUF weight ``d * q`` with an fp16 d (11 significant bits) is not one.

``activations="int8"`` trades those float32 numerics for llama.cpp's on the K-quants (Q4_K,
Q6_K: most of a Q4_K_M file): each row of x is quantised per 256 values to int8 and the dot
products are summed in integers (``vpmaddubsw``/``vpmaddwd``, ``csrc/quant_linear_q8k.h``),
still batch-invariant and the same bits on every instruction set. The float32 path dequantises
every weight to float (about 10 GB/s of Q4_K per thread, compute-bound); the int8 one reads a
1B-shape model's layers at 25-32 GB/s on 2 threads, close to the machine's copy bandwidth
(measured 2026-12-06, AMD EPYC Genoa; ``/work`` scratch runs, see the README's GGUF section).
"""

from __future__ import annotations

import functools
import platform
import warnings
from collections.abc import Sequence
from types import ModuleType

import numpy as np
import torch

from baton.kernels.checks import check_tensor
from baton.kernels.cpp_build import load_extension, runnable_isas
from baton.kernels.huge_pages import huge_page_zeros
from baton.kernels.quant_formats import (
    FORMATS,
    QuantWeight,
    block_format,
    check_raw,
    dequantize,
)

ACTIVATIONS = ("float32", "int8")
"""Activation numerics by code: "float32" (x as given; the gguf weights exactly) or "int8"
(llama.cpp's: each row of x quantised per 256 values for the K-quant weights, see
``csrc/quant_linear_q8k.h``; weights of 32-weight block formats still take x in float32)."""

INT8_FORMATS = ("Q4_K", "Q6_K")
"""Formats whose kernel takes int8 activations when asked."""

ISAS = ("avx2", "avx512", "avx512vnni")
"""Instruction sets the kernel is built for, by code (0: AVX2+FMA+F16C, 1: AVX-512 F/BW/VL,
2: and AVX512-VNNI, whose vpdpwssd the int8 path takes; the float path runs the AVX-512 code).
Every one gives the same bits."""

# -fopenmp: at::parallel_for is a header template whose threads come from `#pragma omp
# parallel`; compiled without it, every call ran on one thread whatever torch's thread count
# (measured: M=1 on a Q4_K 16384 x 2048 weight, 2 threads, 1.92 ms without, 0.95 ms with). The
# pragma's calls resolve to the OpenMP runtime torch already loaded (one runtime, one pool).
# -ffp-contract=off: the fused decode layer includes csrc/cpu_ops_impl.h, whose RMSNorm and
# RoPE round every product as torch does, and must give cpu_ops' bits; the kernels here fuse
# only where they say so (FMA intrinsics).
_CFLAGS = ("-O3", "-fopenmp", "-ffp-contract=off")


def quant_linear_torch(x: torch.Tensor, weight: QuantWeight) -> torch.Tensor:
    """``x @ dequantize(weight).T`` with torch ops, in float32, returned in ``x``'s dtype: the
    reference for `quant_linear` (same weights, another summation order).

    Raises:
        ValueError: as `quant_linear`.
    """
    _check_input(x, weight)
    return (x.float() @ dequantize(weight).T).to(x.dtype)


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``x`` ``[M, K]`` (K a multiple of 256) as the kernel's int8 activations
    take it, per 256 values: ``d = amax / 127`` and ``q = round(x * (127 / amax))`` (ties to
    even; 0 where amax is 0), in float32. Returns (q as float32 ``[M, K]``, d ``[M, K / 256]``).
    Pure function: the reference of ``csrc/quant_linear_q8k.h``'s quantiser."""
    xf = x.float().reshape(x.shape[0], -1, 256)
    amax = xf.abs().amax(dim=-1)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    q = torch.round(xf * inv.unsqueeze(-1))
    return q.reshape(x.shape[0], -1), amax / 127.0


def quant_linear_int8_torch(x: torch.Tensor, weight: QuantWeight) -> torch.Tensor:
    """``quant_linear(x, weight, activations="int8")``'s value with torch ops, in float64: x's
    rows quantised by `quantize_rows_int8`, times ``dequantize(weight)`` (the reference for
    a weight of `INT8_FORMATS`; the kernel sums the same products in integers).

    Raises:
        ValueError: as `quant_linear`, or the weight's format is not in `INT8_FORMATS`.
    """
    _check_input(x, weight)
    if weight.format not in INT8_FORMATS:
        raise ValueError(f"int8 activations are taken by {INT8_FORMATS}, not {weight.format}")
    q, d = quantize_rows_int8(x)
    xq = (q.double().reshape(x.shape[0], -1, 256) * d.double().unsqueeze(-1)).reshape(q.shape)
    return xq @ dequantize(weight).double().T


def _check_input(x: object, weight: QuantWeight) -> torch.Tensor:
    block_format(weight.format)
    x = check_tensor("x", x, 2, (torch.float32, torch.bfloat16), "a 2-D float32/bfloat16 tensor")
    if x.device.type != "cpu":
        raise ValueError(f"x must be on the CPU, got {x.device}")
    if x.shape[1] != weight.k:
        raise ValueError(
            f"x has {x.shape[1]} features but the {weight.format} weight [{weight.n}, "
            f"{weight.k}] takes {weight.k}"
        )
    return x


@functools.cache
def _extension() -> ModuleType:
    """The compiled extension (built on first call, see ``cpp_build.load_extension``)."""
    return load_extension("baton_quant_linear", "quant_linear.cpp", _CFLAGS)


def extension() -> ModuleType:
    """The compiled extension (built on first call), for fused C++ callers: its
    ``decode_layer`` (``engine/models/cpu_decode.py``) composes these kernels with
    ``csrc/cpu_ops_impl.h``'s.

    Raises:
        RuntimeError: the extension does not build here (not x86-64, no compiler).
    """
    return _extension()


@functools.cache
def available_isas() -> tuple[str, ...]:
    """The instruction sets of `ISAS` this CPU runs (compiles the extension on first use;
    cached: it is asked on every call); none on a CPU other than x86-64, where the C++ source
    does not compile."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ()
    ext = _extension()
    return runnable_isas(ext, ISAS)


def selected_isa() -> str:
    """The instruction set `quant_linear` uses by default: the widest this CPU runs.

    Raises:
        RuntimeError: the CPU lacks even AVX2+FMA+F16C.
    """
    isas = available_isas()
    if not isas:
        raise RuntimeError("the quantised linear kernel needs an x86-64 CPU with AVX2, FMA, F16C")
    return isas[-1]


def _isa_code(isa: str | None) -> int:
    if isa is None:
        isa = selected_isa()
    elif isa not in available_isas():
        raise ValueError(
            f"isa {isa!r} is not available on this CPU; available: {', '.join(available_isas())}"
        )
    return ISAS.index(isa)


def _activations_code(activations: str) -> int:
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
    return ACTIVATIONS.index(activations)


def quant_linear(
    x: torch.Tensor,
    weight: QuantWeight,
    isa: str | None = None,
    activations: str = "float32",
) -> torch.Tensor:
    """``x @ dequant(weight).T``: ``x`` ``[M, k]`` float32/bfloat16 -> ``[M, n]`` in x's dtype,
    accumulated in float32; batch-invariant (a row's result does not depend on the other rows,
    on M or on the thread count). Runs on torch's intra-op threads (over output columns).

    ``activations`` (`ACTIVATIONS`): "float32" multiplies x as given; "int8" quantises each row
    of x per 256 values to int8 for a weight of `INT8_FORMATS` and sums in integers, as
    llama.cpp does (2-4x faster, with llama.cpp's rounding of x; still batch-invariant), and is
    "float32" for the other formats. ``isa`` forces an instruction set of `ISAS` (default
    `selected_isa`); every build gives the same bits. Compiles the extension on first use.

    Raises:
        ValueError: x is not a 2-D float32/bfloat16 CPU tensor with ``weight.k`` columns, the
            weight's format has no kernel, or ``isa`` or ``activations`` is unknown or ``isa``
            not run by this CPU.
    """
    x = _check_input(x, weight)
    return QuantProjection((weight,), isa, activations)(x)


class QuantProjection:
    """``x @ [dequant(w_0); dequant(w_1); ...].T``: several weights of one ``k`` (a fused
    projection whose parts differ in type, e.g. Q4_K q/k and Q6_K v), their outputs side by
    side, in one C++ call: one parallel region over all their tiles (its threads take equal
    shares of the bytes) and, for int8 activations, one quantisation of x. Each column is
    `quant_linear`'s for its weight, bit for bit (batch-invariant as that is).

    The weights, ``isa`` and ``activations`` are checked once, here; a call checks only x, in
    C++ (the per-step path of a model's layers: no Python checks per call).

    Raises:
        ValueError: no weights, weights of different ``k`` or of a format without a kernel,
            or ``isa``/``activations`` as `quant_linear`.
    """

    __slots__ = ("weights", "n", "k", "_args")

    def __init__(
        self,
        weights: Sequence[QuantWeight],
        isa: str | None = None,
        activations: str = "float32",
    ) -> None:
        weights = tuple(weights)
        if not weights:
            raise ValueError("a QuantProjection needs at least one weight")
        for w in weights:
            block_format(w.format)
        if len({w.k for w in weights}) != 1:
            raise ValueError(f"the weights must share k, got {[w.k for w in weights]}")
        self.weights = weights
        self.n = sum(w.n for w in weights)
        self.k = weights[0].k
        self._args = (
            [w.data for w in weights],
            [FORMATS[w.format].code for w in weights],
            [w.n for w in weights],
            self.k,
            _isa_code(isa),
            _activations_code(activations),
        )

    @property
    def call_args(self) -> tuple[object, ...]:
        """The C++ call's arguments after x: (weights' data, format codes, column counts, k,
        isa code, activations code); what a fused C++ caller (``decode_layer``) passes on."""
        return self._args

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``[M, k]`` float32/bfloat16 CPU x -> ``[M, n]`` in x's dtype. Compiles the extension
        on first use.

        Raises:
            RuntimeError: x is not a 2-D float32/bfloat16 tensor with ``k`` columns (the C++
                check's message).
        """
        return _extension().quant_linear_parts(x, *self._args)


def repack_native(raw: np.ndarray, format: str, huge_pages: bool = True) -> QuantWeight:
    """``quant_formats.repack(raw, format)`` (the same bytes) in one pass of C++ on torch's
    intra-op threads: what a loader calls. With ``huge_pages`` (for weights this process
    multiplies) into memory advised for huge pages (``huge_pages.huge_page_zeros``), else
    plain memory (weights another process will copy). Compiles the extension on first use.

    Raises:
        ValueError: as ``quant_formats.repack``.
        RuntimeError: the CPU is not x86-64 (use ``quant_formats.repack``).
    """
    fmt, n, k = check_raw(raw, format)
    if not available_isas():
        raise RuntimeError("repack_native needs the x86-64 extension; use quant_formats.repack")
    with warnings.catch_warnings():  # a read-only memory map: the C++ side only reads it
        warnings.simplefilter("ignore", UserWarning)
        src = torch.from_numpy(np.ascontiguousarray(raw))
    # On huge pages: a decode step streams the weight (kernels/huge_pages.py says why).
    size = fmt.packed_nbytes(n, k)
    out = huge_page_zeros(size) if huge_pages else torch.zeros(size, dtype=torch.uint8)
    _extension().repack_into(src, fmt.code, n, k, out)
    return QuantWeight(format, n, k, out)


def dequantize_rows_native(weight: QuantWeight, rows: torch.Tensor) -> torch.Tensor:
    """``quant_formats.dequantize_rows(weight, rows)`` in C++ (an embedding lookup in the
    blocks): float32 ``[len(rows), k]``, gguf's values (only zeros' signs may differ from the
    torch decode). Compiles the extension on first use.

    Raises:
        ValueError: ``rows`` is not a 1-D integer tensor of indices in [0, n).
        RuntimeError: the CPU is not x86-64 with AVX2 (use ``quant_formats.dequantize_rows``).
    """
    if not isinstance(rows, torch.Tensor) or rows.dim() != 1 or rows.is_floating_point():
        raise ValueError(f"rows must be a 1-D integer tensor, got {rows!r:.80}")
    if len(rows) and (int(rows.min()) < 0 or int(rows.max()) >= weight.n):
        raise ValueError(f"rows must be in [0, {weight.n}), got {rows.min()}..{rows.max()}")
    if not available_isas():
        raise RuntimeError("dequantize_rows_native needs the x86-64 extension")
    code = FORMATS[weight.format].code
    return _extension().dequantize_rows(weight.data, code, weight.n, weight.k, rows.long().cpu())


def dequantize_native(raw: np.ndarray, format: str) -> torch.Tensor:
    """GGUF blocks ``raw`` ``[n, row_bytes]`` of ``format`` as float32 ``[n, k]``: gguf's
    dequantised values bit for bit, in C++ on torch's intra-op threads (repacked first, then
    decoded tile by tile). Compiles the extension on first use.

    Raises:
        ValueError: as ``quant_formats.repack``.
        RuntimeError: the CPU is not x86-64 with AVX2 (use ``gguf.quants.dequantize``).
    """
    weight = repack_native(raw, format)
    code = FORMATS[weight.format].code
    return _extension().dequantize(weight.data, code, weight.n, weight.k)
