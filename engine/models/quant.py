"""int8 weight-only linear layers for steps with few rows.

At batch 1 a decode step reads every weight once and does little arithmetic on it, so it is
bound by how fast the weights stream through the cores. Per-output-channel int8 weights (one
scale per row, symmetric) are half the bytes of bfloat16, and torch's CPU kernel
``aten._weight_int8pack_mm`` multiplies them with bfloat16 activations without widening the
weight in memory. Above a few rows the dense bfloat16 GEMM (AVX512-BF16 / AMX) wins, so the
model keeps both and picks per step by the number of rows (``INT8_MAX_ROWS``); the dense
ones are packed for oneDNN on the CPU (``packed.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Most rows (tokens in the step, or sampling rows for the LM head) that take the int8 kernel.
# ``baton bench linear_kernels`` (every linear of the default model, LM head included, 2 cores,
# 2026-12-04), against bfloat16 weights packed for oneDNN (``models/packed.py``, what larger
# steps take): on an AMD EPYC with AVX512-BF16 and no AMX int8 won at 1 and 2 rows (M=1 14.0
# vs 23.1 ms, M=2 16.3 vs 20.1), tied at 3-4 (18.0 vs 16.7, 17.9 vs 17.4) and lost from 6 on
# (M=6 29.3 vs 16.3); on a Xeon with AMX it won through 4 rows by a little (M=3 13.3 vs 16.3,
# M=4 14.4 vs 15.4) and lost from 6 on (21.9 vs 15.5). 2 is right on both; 3-4 rows would
# gain a millisecond or two on AMX only. Against dense unpacked bfloat16 it had won through
# 6 rows.
INT8_MAX_ROWS = 2


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


def quantize_int8(weight: torch.Tensor, dtype: torch.dtype) -> Int8Weight:
    """Symmetric per-output-channel int8 quantisation of ``weight`` ``[out, in]``, computed in
    float32; the scales come back in ``dtype`` (the activations' dtype). A row of zeros gets
    scale 1 (and zeros).

    Raises:
        ValueError: ``weight`` is not 2-D floating point.
    """
    if weight.ndim != 2 or not weight.is_floating_point():
        shape = tuple(weight.shape)
        raise ValueError(f"expected a 2-D floating weight, got {weight.dtype} {shape}")
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
