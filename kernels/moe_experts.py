"""A mixture-of-experts layer's experts on the CPU in one C++ call (``csrc/moe_experts.cpp``):
the (token, choice) pairs sorted by expert, each expert's gate | up GEMM, SwiGLU and down GEMM
over all of its rows, and each token's weighted sum over its k choices.

Why: the torch form (``models/moe.py``'s ``experts_forward``) runs one oneDNN GEMM pair per
expert that got tokens, and at decode sizes those small calls cost more than the weights they
read: a Qwen3-MoE-like layer (64 experts of width 256, top 8) took 1.9x the time of a dense
layer reading as many bytes at batch 1 (``bench/moe_decode.py``). Here every work item is an
(expert, column tile) that reads its weights once for all of the expert's rows.

Every output element is one dot product in one fixed order: a token's result does not depend
on the other tokens or the thread count (batch-invariant). AVX2 and AVX-512 give the same bits;
AVX-512 BF16 (``vdpbf16ps``, bfloat16 weights only) rounds its pairwise products otherwise.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from baton.kernels.cpp_build import load_extension, runnable_isas

logger = logging.getLogger(__name__)

_CFLAGS = ("-O3", "-fopenmp", "-ffp-contract=off")
_DTYPES = (torch.float32, torch.bfloat16)
_PAD = 32  # the kernel's rows are a multiple of 32 elements (one bfloat16 AVX-512 step)

ENABLED: bool = os.environ.get("BATON_MOE_GROUPED", "1") != "0"
"""Whether CPU MoE layers use this kernel; ``BATON_MOE_GROUPED=0`` keeps them on one oneDNN GEMM
pair per expert (``models/moe.py``), for side-by-side measurements."""

ISAS = ("avx2", "avx512", "avx512bf16")
"""The kernel's instruction sets by code."""


@functools.cache
def extension() -> ModuleType | None:
    """The compiled extension, or None where it cannot be built (not x86-64, no compiler;
    logged once). Compiles it on the first call."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    try:
        return load_extension("baton_moe_experts", "moe_experts.cpp", _CFLAGS)
    except (RuntimeError, OSError, ImportError) as exc:
        logger.warning("the MoE experts extension did not build (%s); using torch ops", exc)
        return None


@functools.cache
def available_isas() -> tuple[str, ...]:
    """The instruction sets of `ISAS` this CPU runs, narrowest first; none without the
    extension or AVX2+FMA. Where torch's own probe says no AVX-512 (the suite's AVX2-only
    emulation, ``tests/avx2_only``), only AVX2."""
    ext = extension()
    if ext is None:
        return ()
    return runnable_isas(ext, ISAS)


@dataclass(frozen=True)
class GroupedExperts:
    """A layer's experts laid out for `moe_experts_cpu` (`group_experts`).

    Attributes:
        gate_up: ``[E, 2 * ff, kp_h]``, gate rows then up rows, each zero-padded from hidden to
            kp_h elements (a multiple of 32).
        down: ``[E, hidden, kp_f]``, rows zero-padded from ff to kp_f.
        gate_up_bias: float32 ``[E, 2 * ff]`` or None.
        down_bias: float32 ``[E, hidden]`` or None.
        ff: the experts' width.
        swiglu: gpt-oss's ``(alpha, limit)`` clamped SwiGLU, or None for ``silu(g) * u``.
    """

    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None
    ff: int
    swiglu: tuple[float, float] | None


def grouping_available(dtype: torch.dtype) -> bool:
    """Whether `moe_experts_cpu` runs CPU experts of ``dtype`` here (float32 or bfloat16, the
    extension built, AVX2+FMA at least, `ENABLED`)."""
    return ENABLED and dtype in _DTYPES and bool(available_isas())


def _pad_last(t: torch.Tensor) -> torch.Tensor:
    width = -(-t.shape[-1] // _PAD) * _PAD
    if width == t.shape[-1]:
        return t.detach().contiguous()
    return F.pad(t.detach(), (0, width - t.shape[-1])).contiguous()


def group_experts(
    gate_up: torch.Tensor,
    down: torch.Tensor,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    swiglu: tuple[float, float] | None = None,
) -> GroupedExperts:
    """The stacked experts ``gate_up`` ``[E, 2 * ff, hidden]`` and ``down`` ``[E, hidden,
    ff]`` (and their biases) in `moe_experts_cpu`'s layout; shares their storage where no row
    needs padding, else copies.

    Raises:
        ValueError: not 3-D CPU float32/bfloat16 tensors of one dtype and matching shapes.
    """
    if (
        gate_up.ndim != 3
        or down.ndim != 3
        or gate_up.device.type != "cpu"
        or gate_up.dtype not in _DTYPES
        or down.dtype != gate_up.dtype
        or down.device != gate_up.device
        or gate_up.shape[1] != 2 * down.shape[2]
        or down.shape[:2] != (gate_up.shape[0], gate_up.shape[2])
    ):
        raise ValueError(
            f"cannot group experts of {gate_up.dtype} {tuple(gate_up.shape)} and {down.dtype} "
            f"{tuple(down.shape)} on {gate_up.device} (CPU float32/bfloat16 [E, 2 * ff, "
            "hidden] and [E, hidden, ff])"
        )
    return GroupedExperts(
        gate_up=_pad_last(gate_up),
        down=_pad_last(down),
        gate_up_bias=None if gate_up_bias is None else gate_up_bias.detach().float().contiguous(),
        down_bias=None if down_bias is None else down_bias.detach().float().contiguous(),
        ff=down.shape[2],
        swiglu=swiglu,
    )


def moe_experts_cpu(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    grouped: GroupedExperts,
    isa: str | None = None,
) -> torch.Tensor:
    """``sum_j weights[t, j] * expert_{experts[t, j]}(x[t])`` for every row of ``x`` ``[T,
    hidden]`` (``models/moe.py``'s ``experts_forward`` with its SwiGLU experts), in x's dtype.
    The dot products run in float32 (bfloat16 weights: the activation rounds to bfloat16
    between the GEMMs, as in the torch form), the weighted sum in float32 in the order of the
    token's k choices. ``isa``: one of `available_isas` (default the widest).

    Raises:
        ValueError: ``isa`` not available here.
        RuntimeError: no extension; x not of the weights' dtype and hidden size; an expert id
            out of range.
    """
    ext = extension()
    isas = available_isas()
    if ext is None or not isas:
        raise RuntimeError("the MoE experts kernel needs its extension and AVX2 with FMA")
    if isa is None:
        isa = isas[-1]
    elif isa not in isas:
        raise ValueError(f"isa {isa!r} is not available here; available: {', '.join(isas)}")
    alpha, limit = grouped.swiglu or (0.0, 0.0)
    return ext.moe_experts(
        x.contiguous(),
        experts.long().contiguous(),
        weights.float().contiguous(),
        grouped.gate_up,
        grouped.down,
        grouped.gate_up_bias,
        grouped.down_bias,
        grouped.ff,
        grouped.swiglu is not None,
        alpha,
        limit,
        ISAS.index(isa),
    )
