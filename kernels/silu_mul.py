"""SwiGLU's activation, ``silu(gate) * up``: a Triton kernel and its torch reference.

The torch form is two kernels per layer (the SiLU, then the product) and a ``[T, I]``
intermediate in memory between them; the Triton kernel reads gate and up once and writes the
product, in one launch (one CUDA graph node instead of two). As in torch, the SiLU rounds to the
tensors' dtype before the product, which rounds again; the SiLU's exponential is Triton's, so a
result may differ from torch's in its last bit. Nothing here reads a tensor value on the host.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from baton.kernels.checks import check_tensor, check_triton_device

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install can still use the torch reference
    triton = None

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_BLOCK = 1024

HAS_TRITON: bool = triton is not None
"""True when triton is importable, i.e. `silu_mul_triton` can run."""


def silu_mul_torch(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` for ``[T, I]`` tensors of one float dtype (any device, any strides).

    Raises:
        ValueError: if ``gate`` and ``up`` are not 2-D float tensors of one shape, dtype and
            device.
    """
    _check_arguments(gate, up)
    return F.silu(gate) * up


def silu_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`silu_mul_torch` in one Triton kernel launch (none for an empty result); the output is
    contiguous. Runs on CPU tensors only under the Triton interpreter (TRITON_INTERPRET=1 set
    before this module is imported).

    Raises:
        ValueError: as `silu_mul_torch`; also if the tensors are not on a CUDA device (outside
            the interpreter) or their rows are not contiguous (last stride 1).
        ImportError: if triton is not installed.
    """
    if not HAS_TRITON:
        raise ImportError("silu_mul_triton needs triton, which is not installed")
    _check_arguments(gate, up)
    check_triton_device("gate", gate, _INTERPRETED)
    for name, t in (("gate", gate), ("up", up)):
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"{name} must have contiguous rows (last stride 1)")
    tokens, width = gate.shape
    out = torch.empty((tokens, width), dtype=gate.dtype, device=gate.device)
    if out.numel() == 0:
        return out
    _silu_mul_kernel[(tokens, triton.cdiv(width, _BLOCK))](
        gate,
        up,
        out,
        width,
        gate.stride(0),
        up.stride(0),
        BLOCK=_BLOCK,
        num_warps=4,
    )
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`silu_mul_torch`'s result (the model's per-layer call): CUDA tensors with contiguous
    rows go through `silu_mul_triton` when triton is installed, which checks its arguments;
    anything else is ``F.silu(gate) * up`` without the checks, so a CPU computes what it always
    did at the cost it always had.

    Raises:
        ValueError: as `silu_mul_triton`, on CUDA.
        RuntimeError: torch's, for tensors its ops refuse, elsewhere.
    """
    if HAS_TRITON and gate.is_cuda and gate.stride(-1) == 1 and up.stride(-1) == 1:
        return silu_mul_triton(gate, up)
    return F.silu(gate) * up


if HAS_TRITON:
    # Triton reads parameter annotations as types (constexpr, i32, pointers), so the runtime
    # arguments carry none: Triton specialises them on the values passed.
    @triton.jit
    def _silu_mul_kernel(
        gate_ptr,
        up_ptr,
        out_ptr,
        width,
        gate_stride,
        up_stride,
        BLOCK: tl.constexpr,
    ) -> None:
        """Program (t, b) computes columns [b * BLOCK, (b + 1) * BLOCK) of row t."""
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        live = cols < width
        g = tl.load(gate_ptr + t * gate_stride + cols, mask=live, other=0.0)
        u = tl.load(up_ptr + t * up_stride + cols, mask=live, other=0.0)
        dt = g.dtype
        g32 = g.to(tl.float32)
        # torch's SiLU: x / (1 + exp(-x)) in float32, rounded to the dtype; then the product.
        silu = (g32 / (1.0 + tl.exp(-g32))).to(dt)
        prod = (silu.to(tl.float32) * u.to(tl.float32)).to(dt)
        tl.store(out_ptr + t * width + cols, prod, mask=live)


# triton.jit picks the interpreter or the compiler when the kernel is defined (at import, from
# TRITON_INTERPRET), so ask the kernel object which one it got, whatever the environment says now.
_INTERPRETED: bool = HAS_TRITON and type(_silu_mul_kernel).__name__ == "InterpretedFunction"


def _check_arguments(gate: torch.Tensor, up: torch.Tensor) -> None:
    check_tensor("gate", gate, 2, _DTYPES, "a 2-D float32, float16 or bfloat16 tensor [T, I]")
    shape = tuple(gate.shape)
    check_tensor("up", up, 2, (gate.dtype,), f"a {gate.dtype} tensor of gate's shape {shape}")
    if tuple(up.shape) != shape:
        raise ValueError(f"up has shape {tuple(up.shape)} but gate has {shape}")
    if up.device != gate.device:
        raise ValueError(f"up is on {up.device} but gate is on {gate.device}")
