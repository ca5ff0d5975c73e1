"""A batch-invariant linear, ``y = x @ weight.T (+ bias)``: a Triton kernel and its torch reference.

cuBLAS picks its kernel, tile and split-K by the row count M, so on CUDA ``F.linear`` gives a row
other bits when the rest of its batch changes, and a request's logits depend on who shared its
step. This kernel reduces every output element over K in one order whatever M is and whatever
the other rows hold: the tile (BLOCK_N, BLOCK_K, warps, stages) is chosen from (N, K, dtype)
only (`tile_config`), BLOCK_M is one constant (rows past M are masked to zeros), there is no
split-K, and each output tile accumulates ``tl.dot`` over K in BLOCK_K steps, in float32, from
k = 0 up; the bias is added in float32 and the sum rounded once to the dtype. The same program
then computes a row's outputs with the same instructions at any row count, which is what
Thinking Machines' "defeating nondeterminism" note and vLLM's batch-invariant ops rely on for
their matmul (theirs is persistent; this one launches a tile per program, grouped along M for
L2 reuse, which changes only where a tile runs, not how it sums). float32 dots run in IEEE
float32 (no TF32), as ``F.linear`` does by default. Nothing here reads a tensor value on the
host, so a call queues work without a sync and can be captured in a CUDA graph.

Without split-K a small-M call has only ``cdiv(N, BLOCK_N)`` programs: decode pays for
invariance in parallelism (bench/gpu/gpu_check.py measures the cost against cuBLAS).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from baton.kernels.checks import check_tensor, check_triton_device

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install can still use the torch reference
    triton = None

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

BLOCK_M = 64
"""Rows of an output tile, whatever M is: a tile shape that followed M could change the
tensor-core instruction, and with it the order of a row's sum."""

# Output tiles along M a program group walks before moving along N (L2 reuse of weight tiles).
_GROUP_M = 8

HAS_TRITON: bool = triton is not None
"""True when triton is importable, i.e. `invariant_matmul` can run."""


@dataclass(frozen=True)
class TileConfig:
    """One launch's tile: every argument of it comes from (N, K, dtype), never from M.

    Attributes:
        block_n: output columns per tile.
        block_k: the K step of the reduction (the order of every element's sum).
        num_warps: warps per program.
        num_stages: software-pipelining depth of the K loop.
    """

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


def tile_config(n: int, k: int, dtype: torch.dtype) -> TileConfig:
    """The tile for an ``[M, k] @ [k, n]`` product of ``dtype``, the same for every M.

    Wide outputs (an LM head, a fused gate/up) take 128 columns a tile, narrower ones 64 so
    that a decode step still has some programs to spread over the SMs; float32 operands, twice
    the bytes of 16-bit ones, take half the K step (the same shared memory a stage). ``k`` is
    an argument so that a later rule may use it; it must never become M.
    """
    del k  # one K step for every K today; the signature keeps the rule's inputs explicit
    block_n = 128 if n >= 8192 else 64
    block_k = 32 if dtype == torch.float32 else 64
    return TileConfig(block_n=block_n, block_k=block_k)


def invariant_matmul_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ weight.T + bias`` with torch ops (any device): the products summed in float32 and
    the bias added in float32, then rounded once to x's dtype, which is what the kernel
    computes (in another summation order, so float32 results agree to rounding, 16-bit ones
    to the dtype's last bit).

    Raises:
        ValueError: as `invariant_matmul`'s shape, dtype and device checks.
    """
    _check_arguments(x, weight, bias)
    y = x.float() @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def invariant_matmul(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` ``[M, K]``, ``weight`` ``[N, K]``, ``bias`` ``[N]`` or
    None, one float dtype: a new contiguous ``[M, N]`` tensor whose row i has the same bits
    whatever M is and whatever the other rows hold (see the module docstring). One Triton
    launch (none when M or N is 0). Runs on CPU tensors only under the Triton interpreter
    (TRITON_INTERPRET=1 set before this module is imported).

    Raises:
        ValueError: ``x`` not a 2-D float32/float16/bfloat16 tensor, ``weight`` not a 2-D
            tensor of its dtype with K columns, ``bias`` not None or a 1-D tensor [N] of its
            dtype, the tensors not on one device, a row of x or weight (or the bias) not
            contiguous, or a CPU tensor outside the interpreter.
        ImportError: if triton is not installed.
    """
    if not HAS_TRITON:
        raise ImportError("invariant_matmul needs triton, which is not installed")
    _check_arguments(x, weight, bias)
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is not None and t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} must have contiguous rows (last stride 1)")
    check_triton_device("x", x, _INTERPRETED)
    config = tile_config(weight.shape[0], x.shape[1], x.dtype)
    return _launch(x, weight, bias, config)


def _launch(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: TileConfig
) -> torch.Tensor:
    """One launch of the kernel with ``config`` on checked arguments; the result, allocated."""
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    grid = (triton.cdiv(m, BLOCK_M) * triton.cdiv(n, config.block_n),)
    _invariant_matmul_kernel[grid](
        x,
        weight,
        weight if bias is None else bias,  # a valid pointer; unread without a bias
        out,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=BLOCK_M,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=_GROUP_M,
        DOT_DTYPE=_dot_dtype(x.dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


if HAS_TRITON:
    # Triton reads parameter annotations as types (constexpr, i32, pointers), so the runtime
    # arguments carry none. M is not specialised (Triton would otherwise compile M == 1 apart):
    # every M runs the one compiled kernel.
    @triton.jit(do_not_specialize=["m"])
    def _invariant_matmul_kernel(
        x_ptr,
        w_ptr,
        b_ptr,
        out_ptr,
        m,
        n,
        k,
        x_stride,
        w_stride,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
        DOT_DTYPE: tl.constexpr,
    ) -> None:
        """Program p computes one [BLOCK_M, BLOCK_N] tile of ``out`` (contiguous [m, n]); the
        tiles are numbered GROUP_M tiles down M before the next column of tiles."""
        pid = tl.program_id(0)
        tiles_m = tl.cdiv(m, BLOCK_M)
        tiles_n = tl.cdiv(n, BLOCK_N)
        per_group = GROUP_M * tiles_n
        first_m = (pid // per_group) * GROUP_M
        group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
        tile_m = first_m + (pid % per_group) % group_rows
        tile_n = (pid % per_group) // group_rows
        rows = tile_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tile_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        live_rows = rows < m
        live_cols = cols < n
        x_tile = x_ptr + rows[:, None] * x_stride + ks[None, :]
        w_tile = w_ptr + cols[None, :] * w_stride + ks[:, None]  # [BLOCK_K, BLOCK_N]: W^T
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # The one order of every element's sum: K in BLOCK_K steps from 0, whatever m is.
        for start in range(0, k, BLOCK_K):
            live_k = start + ks < k
            a = tl.load(x_tile, mask=live_rows[:, None] & live_k[None, :], other=0.0)
            b = tl.load(w_tile, mask=live_k[:, None] & live_cols[None, :], other=0.0)
            acc = tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE), acc, input_precision="ieee")
            x_tile += BLOCK_K
            w_tile += BLOCK_K
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=live_cols, other=0.0).to(tl.float32)[None, :]
        tl.store(
            out_ptr + rows[:, None] * n + cols[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=live_rows[:, None] & live_cols[None, :],
        )


# triton.jit picks the interpreter or the compiler when the kernel is defined (at import, from
# TRITON_INTERPRET), so ask the kernel object which one it got, whatever the environment says now.
_INTERPRETED: bool = HAS_TRITON and type(_invariant_matmul_kernel).__name__ == "InterpretedFunction"


def _dot_dtype(dtype: torch.dtype) -> object:
    """The Triton dtype the dots take their operands in: x's, except under the interpreter,
    whose bfloat16 dot is wrong (numpy has no bfloat16), where it is float32 on the same
    bfloat16 values (exact products, summed in float32 as the tensor cores do)."""
    if _INTERPRETED and dtype == torch.bfloat16:
        return tl.float32
    return {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[
        dtype
    ]


def _check_arguments(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    check_tensor("x", x, 2, _FLOAT_DTYPES, "a 2-D float32, float16 or bfloat16 tensor [M, K]")
    k = x.shape[1]
    check_tensor("weight", weight, 2, (x.dtype,), f"a 2-D {x.dtype} tensor [N, {k}]")
    if weight.shape[1] != k:
        raise ValueError(f"weight has {weight.shape[1]} columns but x has K = {k}")
    if bias is not None:
        n = weight.shape[0]
        check_tensor("bias", bias, 1, (x.dtype,), f"None or a 1-D {x.dtype} tensor [{n}]")
        if bias.shape[0] != n:
            raise ValueError(f"bias has {bias.shape[0]} entries but weight has N = {n} rows")
    for name, t in (("weight", weight), ("bias", bias)):
        if isinstance(t, torch.Tensor) and t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
