"""Paged decode attention: one new query token per sequence attends to the keys and values its
block table points at. A Triton kernel and its torch reference.

Layout (the engine's, see ``baton.engine.models.attention``): ``q`` is ``[B, H, D]``; the caches
are ``[num_blocks, block_size, KVH, D]``; sequence b's key at position p lives in cache block
``block_tables[b, p // block_size]`` at offset ``p % block_size``, and it attends to positions
``0 .. seq_lens[b] - 1`` (the new token's own key and value are already in the cache). Query head
h reads kv head ``h // (H // KVH)`` (grouped-query attention). Nothing here reads a tensor value
on the host, so on CUDA a call queues work without a sync.
"""

from __future__ import annotations

import math
from numbers import Real

import torch
import torch.nn.functional as F

from baton.kernels.checks import check_power_of_two, check_tensor, check_triton_device

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install can still use the torch reference
    triton = None

_DEFAULT_BLOCK_N = 64
_MIN_BLOCK_N = 16
# tl.dot needs every dimension >= 16, and the query heads of one kv head are padded to that.
_MIN_DOT = 16
_MAX_HEAD_DIM = 256
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INDEX_DTYPES = (torch.int32, torch.int64)

HAS_TRITON: bool = triton is not None
"""True when triton is importable, i.e. `paged_decode_attention_triton` can run."""


def paged_decode_attention_torch(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Return the decode attention output ``[B, H, D]`` in q's dtype, with torch ops (any device).

    Gathers every sequence's keys and values up to the block tables' capacity
    (``max_blocks * block_size``, a shape, so no value is read on the host), masks positions at
    or past ``seq_lens[b]`` and runs scaled-dot-product attention in float32. Table entries past a
    sequence's length are never used and may hold anything (e.g. -1). A length past the table's
    capacity attends to the whole table; a length < 1 gives NaN (the caller's bug: not checked,
    that would sync). Writes into `out` when given (and returns it), else allocates.

    Raises:
        ValueError: if `q` is not a 3-D float32/float16/bfloat16 tensor [B, H, D], the caches
            not 4-D tensors [num_blocks, block_size, KVH, D] of q's dtype and one shape, H not a
            multiple of KVH, `block_tables` not a 2-D int32/int64 tensor [B, max_blocks] with
            max_blocks >= 1, `seq_lens` not a 1-D int32/int64 tensor [B], `scale` not a finite
            number, `out` not None or a tensor of q's shape and dtype, or the tensors are not all
            on one device.
        IndexError: on the CPU, for a used block id outside the cache (a device-side assert on
            CUDA).
    """
    _check_arguments(q, key_cache, value_cache, block_tables, seq_lens, scale, out)
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    capacity = block_tables.shape[1] * block_size
    positions = torch.arange(capacity, device=q.device)
    blocks = block_tables.to(torch.int64).gather(
        1, (positions // block_size).expand(batch, capacity)
    )
    valid = positions < seq_lens.to(torch.int64)[:, None]
    slots = torch.where(valid, blocks * block_size + positions % block_size, 0)
    flat_slots = slots.view(-1)
    kv_shape = (batch, capacity, num_kv_heads, head_dim)
    keys = key_cache.reshape(-1, num_kv_heads, head_dim).index_select(0, flat_slots)
    values = value_cache.reshape(-1, num_kv_heads, head_dim).index_select(0, flat_slots)
    attended = F.scaled_dot_product_attention(
        q.to(torch.float32).unsqueeze(2),  # [B, H, 1, D]
        keys.view(kv_shape).transpose(1, 2).to(torch.float32),  # [B, KVH, S, D]
        values.view(kv_shape).transpose(1, 2).to(torch.float32),
        attn_mask=valid[:, None, None, :],
        scale=float(scale),
        enable_gqa=num_heads != num_kv_heads,
    ).squeeze(2)
    if out is None:
        return attended.to(q.dtype)
    return out.copy_(attended)


def paged_decode_attention_triton(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    block_n: int = _DEFAULT_BLOCK_N,
) -> torch.Tensor:
    """Return the decode attention output ``[B, H, D]`` in q's dtype, with one Triton kernel
    launch (none when B is 0).

    One program per (sequence, kv head) serves all the query heads of that kv head, so each key
    and value is read once; it streams the sequence's keys `block_n` at a time with an online
    softmax accumulated in float32, so any length fits. The grid comes from shapes only and each
    program loads its own length, so nothing is read on the host. Same semantics and validation
    as `paged_decode_attention_torch`, except for bad values, which are not checked either but
    never read out of bounds: a length past the table's capacity is clamped to it, a length < 1
    gives zeros and keys in a block whose id is outside ``[0, num_blocks)`` are left out. Runs on
    CPU tensors only under the Triton interpreter (TRITON_INTERPRET=1 set before this module is
    imported).

    Raises:
        ValueError: as `paged_decode_attention_torch`; also if the head dim is not a power of two
            in [16, 256], the tensors are not on a CUDA device (outside the interpreter) or
            `block_n` is not a power of two >= 16.
        ImportError: if triton is not installed.
    """
    if not HAS_TRITON:
        raise ImportError("paged_decode_attention_triton needs triton, which is not installed")
    check_power_of_two("block_n", block_n, _MIN_BLOCK_N)
    _check_arguments(q, key_cache, value_cache, block_tables, seq_lens, scale, out)
    _check_head_dim(q.shape[2])
    check_triton_device("q", q, _INTERPRETED)
    batch, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads = key_cache.shape[:3]
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if batch == 0:
        return out
    group = num_heads // num_kv_heads
    _paged_decode_kernel[(batch, num_kv_heads)](
        q,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        out,
        # log2(e) folded in: the kernel exponentiates with exp2.
        float(scale) * math.log2(math.e),
        num_blocks,
        block_tables.shape[1],
        block_size,
        *q.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        *block_tables.stride(),
        seq_lens.stride(0),
        *out.stride(),
        GROUP=group,
        GROUP_PAD=max(_MIN_DOT, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_N=block_n,
        DOT_DTYPE=_dot_dtype(q.dtype),
        num_warps=4,
    )
    return out


def paged_decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Return the decode attention output ``[B, H, D]`` in q's dtype (see the module docstring).

    CUDA tensors go through `paged_decode_attention_triton` when triton is installed and the head
    dim is one it supports (a power of two in [16, 256]); anything else goes through
    `paged_decode_attention_torch`. Neither reads a value on the host. Writes into `out` when
    given (and returns it). Bad lengths or block ids are the caller's bug and behave as the
    chosen function documents.

    Raises:
        ValueError: as `paged_decode_attention_torch`.
    """
    if (
        HAS_TRITON
        and isinstance(q, torch.Tensor)
        and q.is_cuda
        and q.dim() == 3
        and _head_dim_supported(q.shape[2])
    ):
        return paged_decode_attention_triton(
            q, key_cache, value_cache, block_tables, seq_lens, scale, out
        )
    return paged_decode_attention_torch(
        q, key_cache, value_cache, block_tables, seq_lens, scale, out
    )


if HAS_TRITON:
    # Triton reads parameter annotations as types (constexpr, i32, pointers), so the runtime
    # arguments carry none: Triton specialises them on the values passed.
    @triton.jit
    def _paged_decode_kernel(
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        block_tables_ptr,
        seq_lens_ptr,
        out_ptr,
        qk_scale,
        num_blocks,
        max_blocks,
        block_size,
        q_stride_b,
        q_stride_h,
        q_stride_d,
        k_stride_block,
        k_stride_slot,
        k_stride_head,
        k_stride_d,
        v_stride_block,
        v_stride_slot,
        v_stride_head,
        v_stride_d,
        table_stride_b,
        table_stride_m,
        seq_lens_stride,
        out_stride_b,
        out_stride_h,
        out_stride_d,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_N: tl.constexpr,
        DOT_DTYPE: tl.constexpr,
    ) -> None:
        """Program (b, g): the GROUP query heads of kv head g for sequence b, padded to
        GROUP_PAD rows so that the scores and the weighted sum are tensor-core dots, whose
        operands are cast to DOT_DTYPE (a no-op but under the interpreter, see `_dot_dtype`)."""
        seq = tl.program_id(0).to(tl.int64)
        kv_head = tl.program_id(1).to(tl.int64)
        rows = tl.arange(0, GROUP_PAD)
        dims = tl.arange(0, HEAD_DIM)
        live_rows = rows < GROUP
        heads = kv_head * GROUP + rows
        q = tl.load(
            q_ptr + seq * q_stride_b + heads[:, None] * q_stride_h + dims[None, :] * q_stride_d,
            mask=live_rows[:, None],
            other=0.0,
        ).to(DOT_DTYPE)
        # Clamping to the table's capacity keeps a bad length from reading past the table.
        seq_len = tl.load(seq_lens_ptr + seq * seq_lens_stride).to(tl.int32)
        seq_len = tl.minimum(seq_len, max_blocks * block_size)
        table = block_tables_ptr + seq * table_stride_b
        k_base = k_cache_ptr + kv_head * k_stride_head
        v_base = v_cache_ptr + kv_head * v_stride_head
        # A finite start keeps exp2(m_i - m_new) a number even if a whole tile is masked out.
        m_i = tl.full([GROUP_PAD], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
        offsets = tl.arange(0, BLOCK_N)
        for start in range(0, seq_len, BLOCK_N):
            pos = start + offsets
            valid = pos < seq_len
            block = tl.load(table + (pos // block_size) * table_stride_m, mask=valid, other=0)
            block = block.to(tl.int64)
            valid = valid & (block >= 0) & (block < num_blocks)
            slot = pos % block_size
            k = tl.load(  # [HEAD_DIM, BLOCK_N]: already transposed for the dot
                k_base
                + (block * k_stride_block + slot * k_stride_slot)[None, :]
                + dims[:, None] * k_stride_d,
                mask=valid[None, :],
                other=0.0,
            ).to(DOT_DTYPE)
            scores = tl.dot(q, k, input_precision="ieee") * qk_scale
            scores = tl.where(valid[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                v_base
                + (block * v_stride_block + slot * v_stride_slot)[:, None]
                + dims[None, :] * v_stride_d,
                mask=valid[:, None],
                other=0.0,
            ).to(DOT_DTYPE)
            # The weights are rounded to the cache dtype, as tensor cores take them.
            weights = p.to(v_cache_ptr.dtype.element_ty).to(DOT_DTYPE)
            acc = tl.dot(weights, v, acc * alpha[:, None], input_precision="ieee")
            m_i = m_new
        # l_i is 0 only when nothing was attended (length < 1): give zeros, not NaN.
        result = acc / tl.maximum(l_i, 1.0e-30)[:, None]
        tl.store(
            out_ptr
            + seq * out_stride_b
            + heads[:, None] * out_stride_h
            + dims[None, :] * out_stride_d,
            result.to(out_ptr.dtype.element_ty),
            mask=live_rows[:, None],
        )


# triton.jit picks the interpreter or the compiler when the kernel is defined (at import, from
# TRITON_INTERPRET), so ask the kernel object which one it got, whatever the environment says now.
_INTERPRETED: bool = HAS_TRITON and type(_paged_decode_kernel).__name__ == "InterpretedFunction"


def _dot_dtype(dtype: torch.dtype) -> object:
    """The Triton dtype the kernel's dots take their operands in: the cache dtype, except under
    the interpreter, whose bfloat16 dot is wrong (numpy has no bfloat16), where it is float32 on
    the same bfloat16 values."""
    if _INTERPRETED and dtype == torch.bfloat16:
        return tl.float32
    return {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[
        dtype
    ]


def _check_arguments(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None,
) -> None:
    check_tensor("q", q, 3, _FLOAT_DTYPES, "a 3-D float32, float16 or bfloat16 tensor [B, H, D]")
    batch, num_heads, head_dim = q.shape
    cache_shape = f"[num_blocks, block_size, KVH, {head_dim}]"
    check_tensor("key_cache", key_cache, 4, (q.dtype,), f"a 4-D {q.dtype} tensor {cache_shape}")
    if key_cache.shape[3] != head_dim:
        raise ValueError(f"key_cache has head dim {key_cache.shape[3]} but q has {head_dim}")
    num_kv_heads = key_cache.shape[2]
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(
            f"key_cache has {num_kv_heads} kv heads, which must be >= 1 and divide q's "
            f"{num_heads} heads"
        )
    check_tensor(
        "value_cache",
        value_cache,
        4,
        (q.dtype,),
        f"a 4-D {q.dtype} tensor of key_cache's shape {tuple(key_cache.shape)}",
    )
    if value_cache.shape != key_cache.shape:
        raise ValueError(
            f"value_cache has shape {tuple(value_cache.shape)} but key_cache has "
            f"{tuple(key_cache.shape)}"
        )
    check_tensor(
        "block_tables",
        block_tables,
        2,
        _INDEX_DTYPES,
        f"a 2-D int32 or int64 tensor [{batch}, max_blocks]",
    )
    if block_tables.shape[0] != batch or block_tables.shape[1] < 1:
        raise ValueError(
            f"block_tables has shape {tuple(block_tables.shape)} but must be [{batch}, "
            f"max_blocks] with max_blocks >= 1"
        )
    check_tensor("seq_lens", seq_lens, 1, _INDEX_DTYPES, f"a 1-D int32 or int64 tensor [{batch}]")
    if seq_lens.shape[0] != batch:
        raise ValueError(f"seq_lens has {seq_lens.shape[0]} entries but q has {batch} sequences")
    if isinstance(scale, bool) or not isinstance(scale, Real) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number, got {scale!r}")
    if out is not None:
        check_tensor("out", out, 3, (q.dtype,), f"None or a {q.dtype} tensor of q's shape")
        if out.shape != q.shape:
            raise ValueError(f"out has shape {tuple(out.shape)} but q has {tuple(q.shape)}")
    for name, value in (
        ("key_cache", key_cache),
        ("value_cache", value_cache),
        ("block_tables", block_tables),
        ("seq_lens", seq_lens),
        ("out", out),
    ):
        if isinstance(value, torch.Tensor) and value.device != q.device:
            raise ValueError(f"{name} is on {value.device} but q is on {q.device}")


def _head_dim_supported(head_dim: int) -> bool:
    return _MIN_DOT <= head_dim <= _MAX_HEAD_DIM and not head_dim & (head_dim - 1)


def _check_head_dim(head_dim: int) -> None:
    if not _head_dim_supported(head_dim):
        raise ValueError(
            f"head dim (q's last dimension) must be a power of two in [{_MIN_DOT}, "
            f"{_MAX_HEAD_DIM}] for the Triton kernel, got {head_dim}; use "
            f"paged_decode_attention_torch for other sizes"
        )
