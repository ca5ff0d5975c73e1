"""RMSNorm with an optional fused residual add: a Triton kernel and its torch reference.

The model's norm, as Hugging Face's Llama computes it: in float32, ``x * rsqrt(mean(x^2) + eps)``
cast back to ``x``'s dtype, then times the weight (a product in that dtype). With ``residual``
the input is first ``x + residual`` (rounded to the dtype, as torch's ``x + residual``), and that
sum is returned too: it is the residual stream the next block adds to. On a GPU the torch form is
eight or nine kernels per call (casts, power, mean, add, rsqrt, products), the Triton kernel one;
a small model's decode step is bound by such launches (``bench/gpu/gpu_profile.py``). Nothing here
reads a tensor value on the host.
"""

from __future__ import annotations

import math
from numbers import Real

import torch

from baton.kernels import cpu_ops
from baton.kernels.checks import check_tensor, check_triton_device

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install can still use the torch reference
    triton = None

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_HIDDEN = 1 << 16

HAS_TRITON: bool = triton is not None
"""True when triton is importable, i.e. `rms_norm_triton` can run."""


def rms_norm_torch(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Return ``(norm(h) * weight, h)`` with ``h = x + residual``, or ``(norm(x) * weight, None)``
    without ``residual``, with torch ops (any device); see the module docstring.

    Raises:
        ValueError: if ``x`` is not a 2-D float32/float16/bfloat16 tensor [T, hidden], ``weight``
            not a 1-D tensor [hidden] of x's dtype, ``residual`` not None or a tensor of x's
            shape and dtype, ``eps`` not a finite number >= 0, or the tensors not on one device.
    """
    _check_arguments(x, weight, eps, residual)
    return _rms_norm_ops(x, weight, eps, residual)


def _rms_norm_ops(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    h = x if residual is None else x + residual
    h32 = h.float()
    normed = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(h.dtype), (None if residual is None else h)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`rms_norm_torch` in one Triton kernel launch (one program per row; none for 0 rows).

    The sum of squares is reduced in another order than torch's, so outputs may differ from the
    reference in the last bit of the dtype; the residual sum is exact (one rounding, as torch's).
    Runs on CPU tensors only under the Triton interpreter (TRITON_INTERPRET=1 set before this
    module is imported).

    Raises:
        ValueError: as `rms_norm_torch`; also if the tensors are not on a CUDA device (outside the
            interpreter), a row is not contiguous, or hidden exceeds 65536.
        ImportError: if triton is not installed.
    """
    if not HAS_TRITON:
        raise ImportError("rms_norm_triton needs triton, which is not installed")
    _check_arguments(x, weight, eps, residual)
    check_triton_device("x", x, _INTERPRETED)
    rows, hidden = x.shape
    if hidden > _MAX_HIDDEN:
        raise ValueError(f"x has hidden size {hidden}; the kernel takes at most {_MAX_HIDDEN}")
    for name, t in (("x", x), ("weight", weight), ("residual", residual)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"{name} must have contiguous rows (last stride 1)")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    summed = None if residual is None else torch.empty_like(out)
    if rows == 0:
        return out, summed
    block = triton.next_power_of_2(hidden)
    res = x if residual is None else residual  # a valid pointer; unread without a residual
    _rms_norm_kernel[(rows,)](
        x,
        res,
        weight,
        out,
        out if summed is None else summed,
        hidden,
        x.stride(0),
        res.stride(0),
        float(eps),
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=4 if block <= 1024 else 8,
    )
    return out, summed


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`rms_norm_torch`'s result (the model's per-norm call): CUDA tensors with contiguous rows
    go through `rms_norm_triton` when triton is installed, which checks its arguments; CPU
    tensors with contiguous rows through `cpu_ops.rms_norm_cpu` (one C++ call; the mean summed
    in another fixed order) when its extension builds; anything else runs `rms_norm_torch`'s
    ops without its checks (they cost about 3 us a norm on a 2-core CPU).

    Raises:
        ValueError: as `rms_norm_triton`, on CUDA.
        RuntimeError: torch's, for tensors its ops refuse, elsewhere.
    """
    if (
        HAS_TRITON
        and x.is_cuda
        and x.dim() == 2
        and x.stride(-1) == 1
        and (residual is None or residual.stride(-1) == 1)
    ):
        return rms_norm_triton(x, weight, eps, residual)
    if x.device.type == "cpu" and cpu_ops.ENABLED and cpu_ops.rms_norm_fits(x, weight, residual):
        return cpu_ops.rms_norm_cpu(x, weight, eps, residual)
    return _rms_norm_ops(x, weight, eps, residual)


if HAS_TRITON:
    # Triton reads parameter annotations as types (constexpr, i32, pointers), so the runtime
    # arguments carry none: Triton specialises them on the values passed.
    @triton.jit
    def _rms_norm_kernel(
        x_ptr,
        res_ptr,
        w_ptr,
        out_ptr,
        sum_ptr,
        hidden,
        x_stride,
        res_stride,
        eps,
        HAS_RESIDUAL: tl.constexpr,
        BLOCK: tl.constexpr,
    ) -> None:
        """Program r normalises row r; ``out`` and ``sum`` are contiguous [rows, hidden]."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        live = cols < hidden
        x = tl.load(x_ptr + row * x_stride + cols, mask=live, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * res_stride + cols, mask=live, other=0.0)
            # Rounded to the dtype once, as torch's x + residual.
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            tl.store(sum_ptr + row * hidden + cols, x, mask=live)
        x32 = x.to(tl.float32)
        mean_square = tl.sum(x32 * x32, axis=0) / hidden
        normed = (x32 * tl.rsqrt(mean_square + eps)).to(x.dtype)
        w = tl.load(w_ptr + cols, mask=live, other=0.0)
        # A product in the dtype: exact in float32, then rounded once, as torch's.
        y = (normed.to(tl.float32) * w.to(tl.float32)).to(x.dtype)
        tl.store(out_ptr + row * hidden + cols, y, mask=live)


# triton.jit picks the interpreter or the compiler when the kernel is defined (at import, from
# TRITON_INTERPRET), so ask the kernel object which one it got, whatever the environment says now.
_INTERPRETED: bool = HAS_TRITON and type(_rms_norm_kernel).__name__ == "InterpretedFunction"


def _check_arguments(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> None:
    check_tensor("x", x, 2, _FLOAT_DTYPES, "a 2-D float32, float16 or bfloat16 tensor [T, hidden]")
    hidden = x.shape[1]
    check_tensor("weight", weight, 1, (x.dtype,), f"a 1-D {x.dtype} tensor [{hidden}]")
    if weight.shape[0] != hidden:
        raise ValueError(f"weight has {weight.shape[0]} entries but x has hidden size {hidden}")
    if residual is not None:
        check_tensor(
            "residual", residual, 2, (x.dtype,), f"None or a {x.dtype} tensor of x's shape"
        )
        if residual.shape != x.shape:
            raise ValueError(f"residual has shape {tuple(residual.shape)} but x {tuple(x.shape)}")
    if isinstance(eps, bool) or not isinstance(eps, Real) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    for name, t in (("weight", weight), ("residual", residual)):
        if isinstance(t, torch.Tensor) and t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
