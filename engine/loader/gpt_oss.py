"""gpt-oss's expert tensors as Hugging Face checkpoints hold them, turned into the per-expert
weights baton loads (``mlp.experts.{e}.{gate,up,down}_proj.{weight,bias}``).

Two layouts: transformers' dense one (``mlp.experts.gate_up_proj`` ``[E, hidden, 2 * ff]``
with gate and up in alternate columns, ``down_proj`` ``[E, ff, hidden]``: ``x @ W``), and the
official checkpoints' MXFP4 one (``*_blocks`` ``[E, rows, groups, 16]`` bytes, two 4-bit
e2m1 values each, low nibble first, and ``*_scales`` ``[E, rows, groups]``, a power-of-two
exponent biased by 127 per 32 values; rows are output features, gate and up alternating).
MXFP4 weights are dequantised here (no MXFP4 kernel yet).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import torch

from baton.engine.loader.errors import ModelLoadError

# A stacked expert tensor of a gpt-oss checkpoint: layer prefix, projection, part.
EXPERT_TENSOR = re.compile(
    r"^(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)(|_bias|_blocks|_scales)$"
)

# The 16 values of a 4-bit e2m1 code (sign, two exponent bits, one mantissa bit).
FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 ``blocks`` ``[..., groups, 16]`` (uint8) with ``scales`` ``[..., groups]`` (uint8)
    as float32 ``[..., groups * 32]``: value ``2 ** (scale - 127) * e2m1(nibble)``, each byte's
    low nibble before its high one.

    Raises:
        ValueError: the shapes or dtypes do not fit together.
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(
            f"MXFP4 blocks and scales must be uint8, got {blocks.dtype}, {scales.dtype}"
        )
    if blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not fit scales {tuple(scales.shape)}; "
            "expected [..., groups, 16] and [..., groups]"
        )
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    pairs = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)
    values = pairs.reshape(*blocks.shape[:-1], 32)
    values = torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127)
    return values.reshape(*blocks.shape[:-2], blocks.shape[-2] * 32)


def unstack_experts(
    path: Path, stacked: Mapping[str, torch.Tensor], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The per-expert weights and biases, in ``dtype``, of a gpt-oss checkpoint's stacked
    expert tensors (``stacked``: name -> tensor as stored, every ``EXPERT_TENSOR`` of the
    checkpoint).

    Raises:
        ModelLoadError: a projection with neither dense weights nor both MXFP4 parts, or a
            tensor of an unexpected shape.
    """
    out: dict[str, torch.Tensor] = {}
    prefixes = {m.group(1) for name in stacked if (m := EXPERT_TENSOR.match(name))}
    for prefix in sorted(prefixes):
        for proj in ("gate_up_proj", "down_proj"):
            weight = _rows(path, stacked, prefix + proj)  # [E, out, in]
            bias = stacked.get(prefix + proj + "_bias")
            if bias is None or bias.shape != weight.shape[:2]:
                raise ModelLoadError(
                    f"{path}: {prefix}{proj}_bias is missing or not [experts, "
                    f"{weight.shape[1]}] (its weight is {tuple(weight.shape)})"
                )
            parts = {"gate_proj": slice(0, None, 2), "up_proj": slice(1, None, 2)}
            if proj == "down_proj":
                parts = {"down_proj": slice(None)}
            for leaf, rows in parts.items():
                for e in range(weight.shape[0]):
                    name = f"{prefix}{e}.{leaf}"
                    out[name + ".weight"] = weight[e, rows].to(dtype).contiguous()
                    out[name + ".bias"] = bias[e, rows].to(dtype).contiguous()
    return out


def _rows(path: Path, stacked: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    """Projection ``name``'s experts as ``[E, out, in]`` float32 rows (gate and up alternate
    in gate_up's rows), from its dense tensor (stored ``[E, in, out]``) or MXFP4 parts."""
    dense = stacked.get(name)
    if dense is not None:
        if dense.dim() != 3:
            raise ModelLoadError(f"{path}: {name} has shape {tuple(dense.shape)}, expected 3-D")
        return dense.float().transpose(1, 2)
    blocks, scales = stacked.get(name + "_blocks"), stacked.get(name + "_scales")
    if blocks is None or scales is None:
        raise ModelLoadError(
            f"{path}: {name} is missing; expected it dense or as {name}_blocks + {name}_scales"
        )
    try:
        return dequantize_mxfp4(blocks, scales)
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {name}: {exc}") from exc
