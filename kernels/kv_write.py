"""Write a step's keys and values into the paged KV cache: a Triton kernel and its torch reference.

Each new token's key and value rows go to one slot of the caches, seen flat as ``[slots,
num_kv_heads, head_dim]`` (slot ``block * block_size + offset``, the attention metadata's
``slot_mapping``). The torch form is one ``index_copy_`` per
cache, two launches per layer; on the H200 those two copies were 13% of a decode step's GPU time
(``bench/gpu/gpu_profile.py``, batch 32). The Triton kernel writes both caches in one launch, and a
CUDA graph holds one node for it instead of two. It only moves values, so it matches the
reference bit for bit in every dtype. Nothing here reads a tensor value on the host.
"""

from __future__ import annotations

import torch

from baton.kernels.checks import check_tensor, check_triton_device

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install can still use the torch reference
    triton = None

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

HAS_TRITON: bool = triton is not None
"""True when triton is importable, i.e. `kv_write_triton_` can run."""


def kv_write_torch_(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes ``k[t]`` and ``v[t]`` into slot ``slot_mapping[t]`` of the caches in place, with
    torch ops (any device).

    Args:
        key_cache, value_cache: the caches seen flat, ``[slots, num_kv_heads, head_dim]``
            (``cache.view(-1, num_kv_heads, head_dim)`` of a ``[blocks, block size, ...]``
            cache), contiguous, one dtype.
        k, v: ``[T, num_kv_heads, head_dim]`` of that dtype (any strides).
        slot_mapping: int64 ``[T]``, flat slots. With a slot repeated, which token lands there
            is undefined. Slots are not checked (that would read them on the host): one out of
            range raises IndexError on the CPU and a device-side assert on CUDA.

    Raises:
        ValueError: if the arguments do not have those shapes, dtypes and devices.
    """
    _check_arguments(key_cache, value_cache, k, v, slot_mapping)
    key_cache.index_copy_(0, slot_mapping, k)
    value_cache.index_copy_(0, slot_mapping, v)


def kv_write_triton_(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """`kv_write_torch_` in one Triton kernel launch (none for 0 tokens). A slot outside the
    caches is skipped rather than checked (no device sync, never a write out of bounds). Runs
    on CPU tensors only under the Triton interpreter (TRITON_INTERPRET=1 set before this
    module is imported).

    Raises:
        ValueError: as `kv_write_torch_`; also if the tensors are not on a CUDA device (outside
            the interpreter) or a head's dims of ``k`` or ``v`` are not contiguous.
        ImportError: if triton is not installed.
    """
    if not HAS_TRITON:
        raise ImportError("kv_write_triton_ needs triton, which is not installed")
    _check_arguments(key_cache, value_cache, k, v, slot_mapping)
    check_triton_device("key_cache", key_cache, _INTERPRETED)
    for name, t in (("k", k), ("v", v)):
        if t.stride(2) != 1:
            raise ValueError(f"{name} must have contiguous heads (last stride 1)")
    tokens, num_kv_heads, head_dim = k.shape
    if tokens == 0:
        return
    num_slots = key_cache.shape[0]
    _kv_write_kernel[(tokens, 2)](
        key_cache,
        value_cache,
        k,
        v,
        slot_mapping,
        num_slots,
        head_dim,
        num_kv_heads * head_dim,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        BLOCK=triton.next_power_of_2(num_kv_heads * head_dim),
        num_warps=1,
    )


def kv_write_(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes the step's keys and values into the caches in place (the model's per-layer
    call): CUDA tensors whose heads are contiguous go through `kv_write_triton_` when triton is
    installed, which checks its arguments; anything else runs `kv_write_torch_`'s two ops
    without its checks, so a CPU computes what it always did at the cost it always had (the
    checks took about 7 us a layer on a 2-core CPU).

    Raises:
        ValueError: as `kv_write_triton_`, on CUDA.
        RuntimeError: torch's, for tensors ``index_copy_`` refuses, elsewhere.
    """
    if HAS_TRITON and key_cache.is_cuda and k.stride(-1) == 1 and v.stride(-1) == 1:
        kv_write_triton_(key_cache, value_cache, k, v, slot_mapping)
    else:  # kv_write_torch_'s ops
        key_cache.index_copy_(0, slot_mapping, k)
        value_cache.index_copy_(0, slot_mapping, v)


if HAS_TRITON:
    # Triton reads parameter annotations as types (constexpr, i32, pointers), so the runtime
    # arguments carry none: Triton specialises them on the values passed.
    @triton.jit
    def _kv_write_kernel(
        key_cache_ptr,
        value_cache_ptr,
        k_ptr,
        v_ptr,
        slot_ptr,
        num_slots,
        head_dim,
        row_size,
        k_token_stride,
        k_head_stride,
        v_token_stride,
        v_head_stride,
        BLOCK: tl.constexpr,
    ) -> None:
        """Program (t, 0) copies token t's key row into its slot of the key cache, (t, 1) its
        value row into the value cache; a slot outside ``[0, num_slots)`` is skipped."""
        t = tl.program_id(0).to(tl.int64)
        which = tl.program_id(1)
        slot = tl.load(slot_ptr + t)
        cols = tl.arange(0, BLOCK)
        # An out-of-range slot writes no element (a mask built by one comparison: the
        # interpreter refuses a scalar condition and-ed into a block mask).
        live = cols < tl.where((slot >= 0) & (slot < num_slots), row_size, 0)
        head, dim = cols // head_dim, cols % head_dim
        dst = slot * row_size + cols
        if which == 0:
            row = tl.load(k_ptr + t * k_token_stride + head * k_head_stride + dim, mask=live)
            tl.store(key_cache_ptr + dst, row, mask=live)
        else:
            row = tl.load(v_ptr + t * v_token_stride + head * v_head_stride + dim, mask=live)
            tl.store(value_cache_ptr + dst, row, mask=live)


# triton.jit picks the interpreter or the compiler when the kernel is defined (at import, from
# TRITON_INTERPRET), so ask the kernel object which one it got, whatever the environment says now.
_INTERPRETED: bool = HAS_TRITON and type(_kv_write_kernel).__name__ == "InterpretedFunction"


def _check_arguments(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    what = "a contiguous 3-D float32, float16 or bfloat16 tensor [slots, KVH, D]"
    check_tensor("key_cache", key_cache, 3, _DTYPES, what)
    if not key_cache.is_contiguous():
        raise ValueError(f"key_cache must be {what}, got a non-contiguous one")
    shape, dtype = tuple(key_cache.shape), key_cache.dtype
    if not isinstance(value_cache, torch.Tensor) or (
        tuple(value_cache.shape),
        value_cache.dtype,
    ) != (shape, dtype):
        raise ValueError(f"value_cache must be a {dtype} tensor of key_cache's shape {shape}")
    if not value_cache.is_contiguous():
        raise ValueError("value_cache must be contiguous")
    heads = shape[1:]
    check_tensor("k", k, 3, (dtype,), f"a 3-D {dtype} tensor [T, {heads[0]}, {heads[1]}]")
    tokens = k.shape[0]
    if tuple(k.shape[1:]) != heads:
        raise ValueError(f"k has shape {tuple(k.shape)}, expected [T, {heads[0]}, {heads[1]}]")
    check_tensor("v", v, 3, (dtype,), f"a 3-D {dtype} tensor [{tokens}, {heads[0]}, {heads[1]}]")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v has shape {tuple(v.shape)} but k has {tuple(k.shape)}")
    check_tensor("slot_mapping", slot_mapping, 1, (torch.int64,), f"an int64 tensor [{tokens}]")
    if slot_mapping.shape[0] != tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} slots for {tokens} tokens")
    for name, t in (
        ("value_cache", value_cache),
        ("k", k),
        ("v", v),
        ("slot_mapping", slot_mapping),
    ):
        if t.device != key_cache.device:
            raise ValueError(f"{name} is on {t.device} but key_cache is on {key_cache.device}")
