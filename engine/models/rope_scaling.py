"""RoPE frequencies with the context-extension schemes checkpoints ask for: linear, Llama 3,
YaRN and LongRoPE, computed as transformers computes them (``modeling_rope_utils``).

LongRoPE (Phi-3) switches from its short to its long factors once a sequence outgrows the
original context, which a paged cache computed with the short ones cannot follow; baton applies
the short factors and keeps sequences within the original context (``ModelConfig.max_context``),
where transformers applies them too.

``check_rope_scaling`` runs when a ``ModelConfig`` is built, so a scheme baton does not run,
or one missing a parameter, is refused before any weight is read.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

# Each scheme -> the parameters it cannot do without.
_REQUIRED: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "llama3": ("factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "longrope": ("factor", "original_max_position_embeddings"),
}
ROPE_TYPES: tuple[str, ...] = tuple(_REQUIRED)
# Parameters each scheme reads besides the required ones; anything else is refused, so that a
# setting baton would ignore (e.g. LongRoPE's factor lists under another name) is never
# dropped silently.
_OPTIONAL: dict[str, frozenset[str]] = {
    "linear": frozenset(),
    "llama3": frozenset({"low_freq_factor", "high_freq_factor"}),
    "yarn": frozenset(
        {"attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"}
    ),
    "longrope": frozenset({"short_factor", "long_factor", "attention_factor"}),
}
# Keys some configs carry beside any scheme and that change nothing here.
_NEUTRAL = frozenset({"rope_type", "type", "rope_theta", "partial_rotary_factor"})


def rope_kind(scaling: Mapping[str, Any] | None) -> str:
    """The scheme of an HF-style ``rope_scaling`` dict ("default" for None or plain RoPE)."""
    if not scaling:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def check_rope_scaling(scaling: Mapping[str, Any] | None) -> None:
    """Raises ``ValueError`` naming what is wrong unless baton computes ``scaling`` exactly:
    a known scheme, its required parameters present and positive, no parameter it would
    ignore, and no partial rotary factor other than 1."""
    kind = rope_kind(scaling)
    if kind == "default" or scaling is None:
        return
    if kind not in _REQUIRED:
        raise ValueError(
            f"unsupported rope_scaling type {kind!r}; expected one of "
            f"{', '.join(ROPE_TYPES)} or none"
        )
    for key in _REQUIRED[kind]:
        value = scaling.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"rope_scaling {kind!r} needs a positive {key!r}, got {value!r}")
    unknown = set(scaling) - set(_REQUIRED[kind]) - _OPTIONAL[kind] - _NEUTRAL
    if unknown:
        raise ValueError(
            f"rope_scaling {kind!r} has parameters baton does not apply: {sorted(unknown)}"
        )
    partial = scaling.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor {partial!r} is not supported; expected 1.0")
    if kind == "longrope":
        for key in ("short_factor", "long_factor"):
            factors = scaling.get(key)
            if not isinstance(factors, (list, tuple)) or not all(
                isinstance(f, (int, float)) and f > 0 for f in factors
            ):
                raise ValueError(f"rope_scaling 'longrope' needs {key!r} as positive numbers")


def rope_inv_freq(
    head_dim: int, theta: float, scaling: Mapping[str, Any] | None
) -> tuple[torch.Tensor, float]:
    """RoPE's inverse frequencies (float32, ``head_dim // 2``) and the factor cos and sin are
    multiplied by (1.0 but for YaRN).

    Raises:
        ValueError: as ``check_rope_scaling``.
    """
    check_rope_scaling(scaling)
    kind = rope_kind(scaling)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if kind == "default" or scaling is None:
        return inv_freq.float(), 1.0
    if kind == "linear":
        return (inv_freq / float(scaling["factor"])).float(), 1.0
    if kind == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if kind == "longrope":
        return _longrope(head_dim, theta, scaling)
    return _yarn(head_dim, theta, scaling)


def _longrope(
    head_dim: int, theta: float, scaling: Mapping[str, Any]
) -> tuple[torch.Tensor, float]:
    """LongRoPE with its short factors (each frequency divided by its factor), and the
    attention factor sqrt(1 + ln(factor) / ln(original context)), as transformers computes
    them for a sequence within the original context.

    Raises:
        ValueError: ``short_factor`` does not hold one factor per frequency.
    """
    short = scaling["short_factor"]
    if len(short) != head_dim // 2:
        raise ValueError(
            f"rope_scaling 'longrope' has {len(short)} short factors, expected {head_dim // 2} "
            f"(head_dim {head_dim} / 2)"
        )
    factor = float(scaling["factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old_ctx))
    shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (torch.tensor(short, dtype=torch.float32) * theta**shape)
    return inv_freq, float(attention)


def _llama3(inv_freq: torch.Tensor, scaling: Mapping[str, Any]) -> torch.Tensor:
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


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(head_dim: int, theta: float, scaling: Mapping[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071): each frequency blends its interpolated (divided by ``factor``)
    and original value by a linear ramp between the dimensions that turn ``beta_fast`` and
    ``beta_slow`` times over the original context; cos and sin are scaled by the attention
    factor. In float32 as transformers computes it, so that the tables match it bit for bit."""
    factor = float(scaling["factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all:
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attention = _yarn_mscale(factor)
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # the share of the original frequency
    return interpolation * (1 - keep) + extrapolation * keep, float(attention)
