"""int8 weight-only linear layers: ``EngineConfig(quantization="int8")``.

At batch 1 a decode step reads every weight once and does little arithmetic on it, so it is
bound by how fast the weights stream through the cores. Per-output-channel int8 weights (one
scale per row, symmetric) are half the bytes of bfloat16, and torch's CPU kernel
``aten._weight_int8pack_mm`` multiplies them with bfloat16 (or float32) activations without
widening the weight in memory. A quantised model uses them for every step whatever its row
count, so a request gets the same weights alone and in a busy batch; above a few rows the
dense bfloat16 GEMM is faster (``baton bench linear_kernels``), which is the price of asking
for int8.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

# ``aten._weight_int8pack_mm`` on the CPU (torch 2.13) reads the input dimension in blocks of
# this many: with in_features not a multiple of it, measured on an AMD EPYC (AVX512-BF16),
# it returned wrong values at 1 row and crashed the process (SIGSEGV) from 2 rows on.
INT8_IN_FEATURES_MULTIPLE = 16


@dataclass(frozen=True)
class Int8Weight:
    """A linear weight ``[out, in]`` as int8 rows times one scale per row.

    Attributes:
        qweight: int8 ``[out, in]``, contiguous.
        scales: ``[out]`` in the activation dtype; row i of the weight is
            ``qweight[i] * scales[i]``.
    """

    qweight: torch.Tensor
    scales: torch.Tensor

    def split(self, sizes: tuple[int, ...]) -> list[Int8Weight]:
        """The weight cut into row blocks of ``sizes`` (views, no copy)."""
        return [
            Int8Weight(q, s)
            for q, s in zip(self.qweight.split(sizes), self.scales.split(sizes), strict=True)
        ]

    def to(self, device: torch.device | str) -> Int8Weight:
        return Int8Weight(self.qweight.to(device), self.scales.to(device))


def check_int8_weight(weight: torch.Tensor) -> None:
    """Checks that ``quantize_int8`` and ``int8_linear`` can take ``weight`` ``[out, in]``.

    Raises:
        ValueError: ``weight`` is not 2-D floating point, or its in_features (dim 1) is not
            a multiple of ``INT8_IN_FEATURES_MULTIPLE`` (the kernel cannot run it).
    """
    if weight.ndim != 2 or not weight.is_floating_point():
        shape = tuple(weight.shape)
        raise ValueError(f"expected a 2-D floating weight, got {weight.dtype} {shape}")
    if weight.shape[1] % INT8_IN_FEATURES_MULTIPLE:
        raise ValueError(
            f"int8 weight-only GEMMs need in_features divisible by {INT8_IN_FEATURES_MULTIPLE} "
            f"(torch's CPU kernel reads it in such blocks), got a weight of shape "
            f"{tuple(weight.shape)}"
        )


def quantize_int8(weight: torch.Tensor, dtype: torch.dtype) -> Int8Weight:
    """Symmetric per-output-channel int8 quantisation of ``weight`` ``[out, in]``, computed in
    float32; the scales come back in ``dtype`` (the activations' dtype). A row of zeros gets
    scale 1 (and zeros).

    Raises:
        ValueError: as ``check_int8_weight``.
    """
    check_int8_weight(weight)
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    # Rounded to ``dtype`` first, so the int8 values are chosen for the scales actually used.
    scales = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax)).to(dtype)
    q = torch.round(w / scales.float()[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
    return Int8Weight(q, scales.contiguous())


def int8_linear(
    x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ (qweight * scales).T + bias`` for ``x`` ``[rows, in]`` (same dtype as the scales)."""
    out = torch.ops.aten._weight_int8pack_mm(x, weight.qweight, weight.scales)
    return out if bias is None else out + bias


def quantize_and_release(linear: nn.Linear) -> Int8Weight:
    """``linear``'s weight quantised (``quantize_int8``, scales in the weight's dtype); the
    module's dense weight is replaced by an empty one, so that the model holds only the int8
    copy and a call that still reached the dense weight would fail instead of running. The
    bias stays on the module.

    Raises:
        ValueError: as ``quantize_int8``.
    """
    quantized = quantize_int8(linear.weight, linear.weight.dtype)
    linear.weight = nn.Parameter(linear.weight.new_empty(0), requires_grad=False)
    return quantized
