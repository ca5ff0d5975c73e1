"""Counter-based random numbers: one uniform per (seed, position), with no RNG state.

Sampling must be a pure function of (row seed, row position, row logits), so the
randomness cannot come from a torch.Generator (whose state depends on what was
drawn before, and on the batch).  Instead each row's uniform is a hash of its
seed and position: a splitmix64 finaliser run twice, written with int64 tensor
ops so that it is vectorised over the batch and runs on any device.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def _as_int64(value: int) -> int:
    """Reinterpret the low 64 bits of a Python int as a signed int64 constant."""
    value &= _MASK64
    return value - (1 << 64) if value >= (1 << 63) else value


# splitmix64's constants (Steele, Lea and Flood, 2014).
_GOLDEN = _as_int64(0x9E3779B97F4A7C15)
_MUL1 = _as_int64(0xBF58476D1CE4E5B9)
_MUL2 = _as_int64(0x94D049BB133111EB)
# Separates the seed stream from the position stream, so that (seed, pos) and
# (pos, seed) do not collide.
_SEED_SALT = _as_int64(0xD1B54A32D192ED03)

_UNIFORM_BITS = 53


def _shift_right_logical(x: torch.Tensor, shift: int) -> torch.Tensor:
    # torch's >> on int64 is arithmetic; masking off the copied sign bits makes
    # it the logical shift that the uint64 algorithm expects.
    return (x >> shift) & ((1 << (64 - shift)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """Return splitmix64's finaliser of each element of an int64 tensor.

    The result is the uint64 value reinterpreted as int64 (two's complement), and
    equals the reference algorithm bit for bit: int64 multiplication in torch wraps
    modulo 2**64 and right shifts are made logical by masking.

    Raises:
        ValueError: if `x` is not an int64 tensor.
    """
    if x.dtype != torch.int64:
        raise ValueError(f"mix64 expects an int64 tensor, got dtype {x.dtype}")
    x = x ^ _shift_right_logical(x, 30)
    x = x * _MUL1
    x = x ^ _shift_right_logical(x, 27)
    x = x * _MUL2
    return x ^ _shift_right_logical(x, 31)


def row_uniforms(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Return one float64 uniform in (0, 1] per row, a pure function of (seed, position).

    The value has 53 random bits: (k + 1) / 2**53 with k uniform in [0, 2**53).
    Excluding 0 lets inverse-CDF sampling aim at a strictly positive target, so a
    zero-probability token can never be picked.

    Raises:
        ValueError: if `seeds` or `positions` is not a 1-D int64 tensor, or their
            lengths or devices differ.
    """
    for name, tensor in (("seeds", seeds), ("positions", positions)):
        if tensor.dtype != torch.int64 or tensor.dim() != 1:
            raise ValueError(
                f"{name} must be a 1-D int64 tensor, got dtype {tensor.dtype} "
                f"and shape {tuple(tensor.shape)}"
            )
    if seeds.shape != positions.shape or seeds.device != positions.device:
        raise ValueError(
            f"seeds and positions must match: shapes {tuple(seeds.shape)} and "
            f"{tuple(positions.shape)}, devices {seeds.device} and {positions.device}"
        )
    stream = mix64(seeds ^ _SEED_SALT)
    bits = mix64(stream + (positions + 1) * _GOLDEN)
    k = _shift_right_logical(bits, 64 - _UNIFORM_BITS)
    return (k + 1).to(torch.float64) * (2.0**-_UNIFORM_BITS)
