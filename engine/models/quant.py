"""int8 weight-only linear layers for steps with few rows.

At batch 1 a decode step reads every weight once and does little arithmetic on it, so it is
bound by how fast the weights stream through the cores. Per-output-channel int8 weights (one
scale per row, symmetric) are half the bytes of bfloat16, and torch's CPU kernel
``aten._weight_int8pack_mm`` multiplies them with bfloat16 activations without widening the
weight in memory. Above a few rows the dense bfloat16 GEMM (AVX512-BF16 / AMX) wins, so the
model keeps both and picks per step by the number of rows (``INT8_MAX_ROWS``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Most rows (tokens in the step, or sampling rows for the LM head) that take the int8 kernel.
# ``baton bench linear_kernels`` (bench/results/linear_kernels.json: every linear of the
# default model, LM head included, 2 cores with AMX): int8 beats dense bfloat16 through 6 rows
# (M=1 9.9 vs 20.2 ms, M=5 20.1 vs 21.7, M=6 20.9 vs 21.3), ties at 7 and loses from 8 on
# (M=16 38.4 vs 21.8). 6 keeps a batch-1 verification step with up to 5 drafts on the int8
# kernel (measured `baton bench spec` at batch 1: auto/off 1.21 -> 1.29 on the peers workload).
INT8_MAX_ROWS = 6


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
