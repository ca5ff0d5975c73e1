"""Rotary position embedding of queries and keys: a Triton kernel and its torch reference.

Hugging Face's Llama rotation ("rotate half"): a head ``x = [x1, x2]`` (two halves of the head
dim) becomes ``[x1 * cos - x2 * sin, x2 * cos + x1 * sin]``, each product and sum in the tensors'
dtype, with ``cos``/``sin`` the token's angles already cast to that dtype. On a GPU the torch form
is about seven kernels per tensor and layer, the Triton kernel one for queries and keys together
(a small model's decode step is bound by such launches: ``bench/gpu/gpu_profile.py``). Nothing here
reads a tensor value on the host.
"""

from __future__ import annotations

import torch

from baton.kernels import cpu_ops
from baton.kernels.checks import check_tensor, check_triton_device

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install can still use the torch reference
    triton = None

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

HAS_TRITON: bool = triton is not None
"""True when triton is importable, i.e. `rope_triton` can run."""

# Fused, a product and the sum after it round once: an H200 gave 1-ulp differences from torch
# in bfloat16 and float16 (its PTX had fma.rn.bf16). Unfused, every product and sum rounds as
# torch's ops do.
LAUNCH_OPTIONS: dict[str, int | bool] = {"num_warps": 1, "enable_fp_fusion": False}
"""The compile options every launch of the kernel uses."""


def rope_torch(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return rotated copies of ``q`` ``[T, H, D]`` and ``k`` ``[T, KVH, D]`` with torch ops (any
    device); ``cos``/``sin`` are ``[T, 1, D / 2]`` in their dtype (see the module docstring).

    Raises:
        ValueError: if ``q``/``k`` are not 3-D float tensors of one dtype with T tokens and one
            even head dim, ``cos``/``sin`` not ``[T, 1, D / 2]`` tensors of that dtype, or the
            tensors not on one device.
    """
    _check_arguments(q, k, cos, sin)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rope_triton(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope_torch` in one Triton kernel launch (one program per token and head; none for 0
    tokens); the outputs are contiguous. Every product and sum rounds to the dtype as torch's
    ops do: the compiler is told not to fuse a product into a sum. Runs on CPU
    tensors only under the Triton interpreter (TRITON_INTERPRET=1 set before this module is
    imported).

    Raises:
        ValueError: as `rope_torch`; also if the tensors are not on a CUDA device (outside the
            interpreter) or a head's dims are not contiguous.
        ImportError: if triton is not installed.
    """
    if not HAS_TRITON:
        raise ImportError("rope_triton needs triton, which is not installed")
    _check_arguments(q, k, cos, sin)
    check_triton_device("q", q, _INTERPRETED)
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have contiguous heads (last stride 1)")
    tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    _rope_kernel[(tokens, num_heads + num_kv_heads)](
        q,
        k,
        cos,
        sin,
        q_out,
        k_out,
        num_heads,
        half,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos.stride(0),
        sin.stride(0),
        BLOCK=triton.next_power_of_2(half),
        **LAUNCH_OPTIONS,
    )
    return q_out, k_out


def rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope_torch`'s result (the model's per-layer call): CUDA tensors whose heads are
    contiguous go through `rope_triton` when triton is installed, which checks its arguments;
    CPU tensors with contiguous heads through `cpu_ops.rope_cpu` (the same bits, one C++ call
    per tensor) when its extension builds; anything else runs `rope_torch`'s ops without its
    checks (they cost about 4 us a layer on a 2-core CPU).

    Raises:
        ValueError: as `rope_triton`, on CUDA.
        RuntimeError: torch's, for tensors its ops refuse, elsewhere.
    """
    if HAS_TRITON and q.is_cuda and all(t.stride(-1) == 1 for t in (q, k, cos, sin)):
        return rope_triton(q, k, cos, sin)
    if q.device.type == "cpu" and cpu_ops.ENABLED and cpu_ops.rope_fits(q, k, cos, sin):
        return cpu_ops.rope_cpu(q, k, cos, sin)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


if HAS_TRITON:
    # Triton reads parameter annotations as types (constexpr, i32, pointers), so the runtime
    # arguments carry none: Triton specialises them on the values passed.
    @triton.jit
    def _rope_kernel(
        q_ptr,
        k_ptr,
        cos_ptr,
        sin_ptr,
        q_out_ptr,
        k_out_ptr,
        num_heads,
        half,
        q_token_stride,
        q_head_stride,
        k_token_stride,
        k_head_stride,
        cos_stride,
        sin_stride,
        BLOCK: tl.constexpr,
    ) -> None:
        """Program (t, h) rotates query head h of token t, or key head h - num_heads; the
        outputs are contiguous ``[T, heads, 2 * half]``."""
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        num_kv_heads = tl.num_programs(1) - num_heads
        cols = tl.arange(0, BLOCK)
        live = cols < half
        is_q = h < num_heads
        if is_q:
            src = q_ptr + t * q_token_stride + h * q_head_stride
            dst = q_out_ptr + (t * num_heads + h) * 2 * half
        else:
            kh = h - num_heads
            src = k_ptr + t * k_token_stride + kh * k_head_stride
            dst = k_out_ptr + (t * num_kv_heads + kh) * 2 * half
        x1 = tl.load(src + cols, mask=live, other=0.0)
        x2 = tl.load(src + half + cols, mask=live, other=0.0)
        c = tl.load(cos_ptr + t * cos_stride + cols, mask=live, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + t * sin_stride + cols, mask=live, other=0.0).to(tl.float32)
        dt = x1.dtype
        a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
        # Each product and sum rounds to the dtype, as torch's ops on such tensors do.
        lo = ((a1 * c).to(dt).to(tl.float32) - (a2 * s).to(dt).to(tl.float32)).to(dt)
        hi = ((a2 * c).to(dt).to(tl.float32) + (a1 * s).to(dt).to(tl.float32)).to(dt)
        tl.store(dst + cols, lo, mask=live)
        tl.store(dst + half + cols, hi, mask=live)


# triton.jit picks the interpreter or the compiler when the kernel is defined (at import, from
# TRITON_INTERPRET), so ask the kernel object which one it got, whatever the environment says now.
_INTERPRETED: bool = HAS_TRITON and type(_rope_kernel).__name__ == "InterpretedFunction"


def _check_arguments(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    check_tensor("q", q, 3, _FLOAT_DTYPES, "a 3-D float32, float16 or bfloat16 tensor [T, H, D]")
    tokens, _, head_dim = q.shape
    check_tensor("k", k, 3, (q.dtype,), f"a 3-D {q.dtype} tensor [{tokens}, KVH, {head_dim}]")
    if k.shape[0] != tokens or k.shape[2] != head_dim:
        raise ValueError(f"k has shape {tuple(k.shape)} but q has {tuple(q.shape)}")
    if head_dim % 2:
        raise ValueError(f"the head dim must be even, got {head_dim}")
    for name, t in (("cos", cos), ("sin", sin)):
        check_tensor(name, t, 3, (q.dtype,), f"a {q.dtype} tensor [{tokens}, 1, {head_dim // 2}]")
        if t.shape != (tokens, 1, head_dim // 2):
            raise ValueError(
                f"{name} has shape {tuple(t.shape)}, expected [{tokens}, 1, {head_dim // 2}]"
            )
    for name, t in (("k", k), ("cos", cos), ("sin", sin)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
