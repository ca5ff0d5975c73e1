"""Dense linear layers on the CPU through oneDNN with weights packed once at load.

``F.linear`` on a CPU tensor hands the weight to the BLAS (float32) or to oneDNN (bfloat16)
as a plain row-major matrix on every call, and the library lays it out for its kernel each
time. Packed once into oneDNN's blocked layout (what inductor's CPU weight freezing does),
the same GEMMs ran faster at every row count measured on a 2-core VM (``baton bench
linear_kernels``, every linear of the default model, LM head included): float32 1.3-4x (M=1
65.8 -> 38.2 ms, M=16 76.0 -> 37.8, M=1024 1815 -> 1396), bfloat16 up to 1.6x (M=16 32.6 ->
20.8, M=64 67.2 -> 54.5, from M=512 on a tie). So on the CPU every step of a model without
int8 weights (``quantization="int8"``) multiplies with packed weights, and the dense ones
are released once packed (``LlamaForCausalLM.pack_weights``). On a Xeon with AMX
(2026-12-04) packed bfloat16 still won below 512 rows, but packed float32 lost at 1-3 rows
(M=1 25.3 against 20.6 ms) and won from 4 on (M=16 42.6 against 52.0); float32 is the parity
dtype there, bfloat16 the default.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from baton.engine.models.row_invariance import probe_rows, with_zero_row

# The row count oneDNN is told to expect when it picks the packed layout; the layout serves
# any row count (measured at 1-64 rows: hints 1, 16 and 64 within noise of each other on the
# AMD machine; on the AMX Xeon hints 4-64 were, while hint 1 made float32 about 2x slower at
# 1-2 rows).
_PACK_HINT_ROWS = 64


@dataclass(frozen=True)
class PackedWeight:
    """A linear layer's weight in oneDNN's blocked layout, and its bias.

    Attributes:
        weight: the packed ``[out, in]`` weight (an opaque oneDNN tensor).
        bias: ``[out]`` in the weight's dtype, or None.
        pad_lone_row: a one-row input is multiplied as the first of two rows, because a
            lone row takes a kernel that reduces it in another order here
            (``row_invariance.py``).
    """

    weight: torch.Tensor
    bias: torch.Tensor | None
    pad_lone_row: bool = False


def packing_available(dtype: torch.dtype) -> bool:
    """Whether this torch build packs and multiplies CPU weights of ``dtype`` through oneDNN
    (float32 wherever oneDNN is built in; bfloat16 where the CPU has bfloat16 instructions)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_linear(
    weight: torch.Tensor, bias: torch.Tensor | None = None, batch_invariant: bool = True
) -> PackedWeight:
    """``weight`` ``[out, in]`` (and ``bias``) packed for ``packed_linear``; the inputs are
    not changed. ``batch_invariant``: probe whether the packed GEMM gives a lone row the bits
    it gives the row among others (``row_invariance.probe_rows``, a few GEMMs per shape once
    per process) and pad lone rows where it does not.

    Raises:
        ValueError: ``weight`` is not a 2-D CPU tensor of a dtype ``packing_available``
            takes.
    """
    if weight.ndim != 2 or weight.device.type != "cpu" or not packing_available(weight.dtype):
        raise ValueError(
            f"cannot pack a {weight.dtype} {tuple(weight.shape)} weight on {weight.device} "
            "(2-D CPU float32, or bfloat16 where the CPU has it)"
        )
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _PACK_HINT_ROWS)
    unpadded = PackedWeight(packed, None if bias is None else bias.detach().contiguous())
    if not batch_invariant:
        return unpadded
    out_features, in_features = weight.shape
    probe = probe_rows(
        lambda x: _onednn_linear(x, unpadded),
        in_features,
        out_features,
        weight.dtype,
        key=("onednn-packed", bias is not None),
    )
    return replace(unpadded, pad_lone_row=probe.lone_row_differs)


def packed_linear(x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` ``[rows, in]`` of the weight's dtype."""
    if weight.pad_lone_row and x.shape[0] == 1:
        return _onednn_linear(with_zero_row(x), weight)[:1]
    return _onednn_linear(x, weight)


def _onednn_linear(x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight.weight, weight.bias, "none", [], "")


def pack_and_release(linear: nn.Linear, batch_invariant: bool = True) -> PackedWeight:
    """``linear``'s weight and bias packed (``pack_linear``, ``batch_invariant`` as there);
    the module's dense weight is replaced by an empty one, so a call that still reached it
    would fail instead of running.

    Raises:
        ValueError: as ``pack_linear``.
    """
    packed = pack_linear(linear.weight, linear.bias, batch_invariant)
    linear.weight = nn.Parameter(linear.weight.new_empty(0), requires_grad=False)
    return packed
