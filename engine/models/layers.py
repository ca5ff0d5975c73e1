"""Building blocks of a Llama-family decoder: RMSNorm, rotary embeddings and the dense linear
that is batch-invariant on request."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from baton.engine.models.rope_scaling import rope_inv_freq
from baton.kernels.invariant_matmul import invariant_matmul
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


class RotaryEmbedding(nn.Module):
    """Applies RoPE (Hugging Face's rotate-half layout) at given positions."""

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        inv_freq, attention_factor = rope_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        if attention_factor != 1.0:  # YaRN scales both tables, as transformers does
            cos, sin = cos * attention_factor, sin * attention_factor
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

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


def dense_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, invariant: bool
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` ``[T, in]``; ``invariant``: through the
    batch-invariant Triton kernel instead (``kernels/invariant_matmul.py``: a row's bits the
    same whatever else the step holds), which the model asks for on CUDA only
    (``LlamaForCausalLM.set_invariant_gemm``). Rows with a stride are copied contiguous first
    (the kernel takes contiguous rows).

    Raises:
        ValueError: with ``invariant``, tensors the kernel refuses (a CPU tensor outside the
            Triton interpreter, mismatched shapes or dtypes).
        ImportError: with ``invariant``, when triton is not installed.
    """
    if not invariant:
        return F.linear(x, weight, bias)
    if x.stride(-1) != 1:
        x = x.contiguous()
    return invariant_matmul(x, weight, bias)
