"""Building blocks of a Llama-family decoder: RMSNorm and rotary embeddings."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from baton.kernels.rms_norm import rms_norm
from baton.kernels.rope import rope


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in float32 like the reference (one Triton
    kernel on CUDA, torch ops elsewhere: ``kernels/rms_norm.py``)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The norm of ``x`` ``[T, hidden]``."""
        return rms_norm(x, self.weight, self.eps)[0]

    def forward_add(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``: the residual add fused into the norm."""
        out, summed = rms_norm(x, self.weight, self.eps, residual)
        assert summed is not None
        return out, summed


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies of RoPE, with llama3-style scaling when configured.

    Raises:
        ValueError: for a rope_scaling type other than default/llama3/linear.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not scaling:
        return inv_freq.float()
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq.float()
    if kind == "linear":
        return (inv_freq / float(scaling["factor"])).float()
    if kind != "llama3":
        raise ValueError(f"unsupported rope_scaling type {kind!r}; expected llama3, linear or none")
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling["original_max_position_embeddings"])
    low_wavelen = old_ctx / low
    high_wavelen = old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled).float()


class RotaryEmbedding(nn.Module):
    """Applies RoPE (Hugging Face's rotate-half layout) at given positions."""

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Cos and sin tables ``[T, 1, D/2]`` for the given positions, computed once per step."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(
            dtype
        )


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q ``[T, H, D]`` and k ``[T, KVH, D]`` (rotate-half layout; one Triton kernel on
    CUDA, torch ops elsewhere: ``kernels/rope.py``)."""
    return rope(q, k, cos, sin)
