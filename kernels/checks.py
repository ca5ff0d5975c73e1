"""Argument checks shared by the kernel modules: each raises ValueError naming the argument and
what was expected. None reads a tensor's values (that would wait for the device)."""

from __future__ import annotations

import torch


def describe(value: object) -> str:
    """A short description of ``value`` for an error message: a tensor's shape and dtype, else
    its type."""
    if isinstance(value, torch.Tensor):
        return f"shape {tuple(value.shape)} and dtype {value.dtype}"
    return type(value).__name__


def check_tensor(
    name: str, value: object, dim: int, dtypes: tuple[torch.dtype, ...], expected: str
) -> torch.Tensor:
    """``value``, when it is a ``dim``-D tensor of one of ``dtypes``.

    Raises:
        ValueError: "``name`` must be ``expected``, got ..." otherwise.
    """
    if not isinstance(value, torch.Tensor) or value.dim() != dim or value.dtype not in dtypes:
        raise ValueError(f"{name} must be {expected}, got {describe(value)}")
    return value


def check_power_of_two(name: str, value: int, minimum: int) -> None:
    """Raises ValueError unless ``value`` is a power of two >= ``minimum`` (a tile size)."""
    if value < minimum or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= {minimum}, got {value}")


def check_triton_device(name: str, tensor: torch.Tensor, interpreted: bool) -> None:
    """Raises ValueError unless ``tensor`` is on a CUDA device, or the kernel runs under the
    Triton interpreter (``interpreted``)."""
    if tensor.device.type != "cuda" and not interpreted:
        raise ValueError(
            f"{name} must be on a CUDA device for the Triton kernel, got {tensor.device}; set "
            f"TRITON_INTERPRET=1 before importing triton to run it on the CPU"
        )
