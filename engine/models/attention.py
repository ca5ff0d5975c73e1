"""Paged attention over a flat batch that mixes prefill chunks and decode tokens.

The batch is flat: the new tokens of all sequences are concatenated, and
``query_start_loc`` says where each sequence's tokens start. Each sequence's
keys and values live in fixed-size blocks of a per-layer cache
(``[num_blocks, block_size, num_kv_heads, head_dim]``); its block table lists
them in order. Everything that does not depend on the layer (gather indices,
the mask, padding indices) is computed once per step in
``AttentionMetadata.build`` and reused by all layers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from baton.kernels.cpu_ops import paged_decode_cpu, paged_decode_fits, paged_prefill_cpu
from baton.kernels.kv_write import kv_write_
from baton.kernels.paged_attention import HAS_TRITON, paged_decode_attention


@dataclass(frozen=True)
class AttentionMetadata:
    """Per-step attention inputs shared by every layer, on the model's device.

    Attributes:
        slot_mapping: int64 ``[T]``, flat cache slot (block * block_size + offset)
            where each new token's key and value are written.
        kv_index: int64 ``[B, S]``, flat cache slot of every key a sequence
            attends to, padded with slot 0 (masked out); S is the longest sequence. None in
            a block-table decode (`decode`), where attention reads the blocks in place.
        query_index: int64 ``[T]``, position of each flat token in the padded
            ``[B * Q]`` query layout, or None when every sequence has exactly
            one new token (pure decode: no padding needed).
        mask: bool ``[B, 1, Q, S]``, True where a query may attend to a key (None with
            ``kv_index``).
        num_seqs: B.
        max_query_len: Q.
        seq_lens: int64 ``[B]``, tokens in each sequence after this step.
        block_tables: int64 ``[B, ceil(S / block_size)]``, each sequence's blocks in order.
        token_seqs: int64 ``[T]``, each flat token's sequence (its row of ``block_tables``);
            None where not built (`decode`).
        token_lens: int64 ``[T]``, the positions each flat token attends to (its position + 1,
            causal); None where not built. For ``paged_attention(token_order=True)``.
        sliding_window: W where a sequence of this step is longer than the model's sliding
            window: a query at position p of a windowed layer then sees keys p - W + 1 .. p
            only (``window_mask`` says so, and attention takes the masked path); None where
            every key is in the window.
        window_mask: ``mask`` with the keys outside the window masked out too, where
            ``sliding_window`` is set (else None); ``mask`` stays causal for the layers that
            see every key (Gemma's global layers).
    """

    slot_mapping: torch.Tensor
    kv_index: torch.Tensor | None
    query_index: torch.Tensor | None
    mask: torch.Tensor | None
    num_seqs: int
    max_query_len: int
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    token_seqs: torch.Tensor | None = None
    token_lens: torch.Tensor | None = None
    sliding_window: int | None = None
    window_mask: torch.Tensor | None = None

    @staticmethod
    def decode(
        slot_mapping: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor
    ) -> AttentionMetadata:
        """Metadata of a pure-decode step (one new token per sequence) whose attention reads
        each sequence's blocks in place through ``block_tables`` (``paged_decode_attention``):
        every tensor's shape depends only on the batch and the tables' width, never on the
        lengths, as a CUDA graph needs. The tensors are used as they are (device tensors).

        Args:
            slot_mapping: int64 ``[B]``, the cache slot each new token's key/value goes to.
            seq_lens: int64 ``[B]``, tokens in each sequence after this step (>= 1).
            block_tables: int64 ``[B, max_blocks]``; entries past a sequence's length are
                never read.
        """
        return AttentionMetadata(
            slot_mapping=slot_mapping,
            kv_index=None,
            query_index=None,
            mask=None,
            num_seqs=slot_mapping.shape[0],
            max_query_len=1,
            seq_lens=seq_lens,
            block_tables=block_tables,
        )

    @staticmethod
    def build(
        query_lens: np.ndarray | torch.Tensor,
        seq_lens: np.ndarray | torch.Tensor,
        block_tables: np.ndarray | torch.Tensor,
        block_size: int,
        device: torch.device | str | None = None,
        stage: Callable[[list[np.ndarray]], list[torch.Tensor]] | None = None,
        sliding_window: int | None = None,
    ) -> AttentionMetadata:
        """Builds the metadata from per-sequence lengths and block tables known on the host.

        Everything that depends on per-token data is computed on the host, where the lengths
        are; the ``[B, S]`` tables are expanded on ``device`` from ``[B]``-sized inputs, which
        reach it in one (pinned, non-blocking) copy. No device value is read on the host.

        Args:
            query_lens: int64 ``[B]``, new tokens of each sequence this step (>= 1).
            seq_lens: int64 ``[B]``, tokens in each sequence after this step
                (cached context + new tokens).
            block_tables: int64 ``[B, max_blocks]``, block ids of each sequence in
                order; unused entries may hold any valid block id.
            block_size: tokens per cache block.
            device: where the metadata is used; None = the CPU.
            stage: how host arrays reach ``device`` (the model runner passes its
                `DeviceIO.to_device`, through its pinned staging buffer); None: views on the
                CPU, plain copies elsewhere (for tests and benchmarks).
            sliding_window: the model's attention window W (None: full causal attention): a
                query at position p sees keys p - W + 1 .. p.

        The arrays are numpy arrays or CPU tensors (reading a tensor's values counts as a host
        read for ``BATON_SYNC_CHECK``: the model runner passes numpy arrays).

        Raises:
            ValueError: on inconsistent shapes or lengths, or tensors not on the CPU.
        """
        q = _host_int64(query_lens, "query_lens")
        s = _host_int64(seq_lens, "seq_lens")
        tables = _host_int64(block_tables, "block_tables")
        max_q, max_s = _checked_lengths(q, s, tables, block_size)
        num_seqs = q.shape[0]

        ctx_lens = s - q
        starts = np.cumsum(q) - q
        token_seq = np.repeat(np.arange(num_seqs), q)
        token_off = np.arange(token_seq.size) - starts[token_seq]
        token_pos = ctx_lens[token_seq] + token_off
        slot_mapping = (
            tables[token_seq, token_pos // block_size] * block_size + token_pos % block_size
        )
        # Pure decode needs no padded layout (nothing to stage).
        query_index = token_seq[:0] if max_q == 1 else token_seq * max_q + token_off
        used_tables = np.ascontiguousarray(tables[:, : -(-max_s // block_size)])
        arrays = [slot_mapping, query_index, s, ctx_lens, q, used_tables, token_seq, token_pos + 1]
        if stage is None:
            target = torch.device("cpu") if device is None else torch.device(device)
            staged = [torch.from_numpy(a).to(target) for a in arrays]
        else:
            staged = stage(arrays)
        slots_d, query_d, seq_d, ctx_d, q_d, tables_d, token_seq_d, token_len_d = staged

        # Flat slot of every (sequence, key position) pair.
        key_pos = torch.arange(max_s, device=seq_d.device)
        blocks = tables_d.gather(1, (key_pos // block_size).expand(num_seqs, -1))
        kv_index = blocks * block_size + key_pos % block_size
        valid_key = key_pos < seq_d[:, None]
        kv_index = torch.where(valid_key, kv_index, torch.zeros_like(kv_index))

        # Query i of sequence b sits at absolute position ctx_b + i and sees
        # keys 0..ctx_b + i (causal), all of which are < seq_len_b.
        q_pos = torch.arange(max_q, device=seq_d.device)
        q_abs = ctx_d[:, None] + q_pos[None, :]
        mask = key_pos[None, None, :] <= q_abs[:, :, None]
        mask = mask & valid_key[:, None, :]
        # Decided on the host, where the lengths are: only a step with a sequence longer than
        # the window masks keys out (and leaves the unmasked fast paths).
        window = sliding_window if sliding_window is not None and max_s > sliding_window else None
        window_mask = None
        if window is not None:
            window_mask = mask & (key_pos[None, None, :] > q_abs[:, :, None] - window)
        # Padded query rows would see nothing and give NaN; let them see key 0.
        pad_rows = q_pos[None, :] >= q_d[:, None]
        mask[..., 0] |= pad_rows
        if window_mask is not None:
            window_mask[..., 0] |= pad_rows
        return AttentionMetadata(
            slot_mapping=slots_d,
            kv_index=kv_index,
            query_index=None if max_q == 1 else query_d,
            mask=mask[:, None],
            num_seqs=num_seqs,
            max_query_len=max_q,
            seq_lens=seq_d,
            block_tables=tables_d,
            token_seqs=token_seq_d,
            token_lens=token_len_d,
            sliding_window=window,
            window_mask=None if window_mask is None else window_mask[:, None],
        )


StepMetadata = AttentionMetadata | tuple[AttentionMetadata, ...]
"""A step's attention metadata: one for every layer, or one per layer where the layers are in
several KV cache groups (``engine/kv_layout.py``: each group's own block tables and window)."""


def layer_metadata(meta: StepMetadata, num_layers: int) -> tuple[AttentionMetadata, ...]:
    """Each layer's metadata of a step's.

    Raises:
        ValueError: a per-layer tuple of another length than ``num_layers``.
    """
    if isinstance(meta, AttentionMetadata):
        return (meta,) * num_layers
    if len(meta) != num_layers:
        raise ValueError(f"attention metadata for {len(meta)} layers, the model has {num_layers}")
    return meta


def _checked_lengths(
    q: np.ndarray, s: np.ndarray, tables: np.ndarray, block_size: int
) -> tuple[int, int]:
    """The longest query and sequence, after checking that query_lens ``q`` and seq_lens
    ``s`` are 1-D of one length with 1 <= q <= s and that ``tables`` ``[len(q), max_blocks]``
    covers every sequence (ValueError otherwise)."""
    if q.ndim != 1 or q.shape != s.shape:
        raise ValueError("query_lens and seq_lens must be 1-D tensors of the same length")
    num_seqs = q.shape[0]
    if tables.ndim != 2 or tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be [num_seqs={num_seqs}, max_blocks]")
    if num_seqs == 0:
        raise ValueError("attention metadata needs at least one sequence")
    if (q < 1).any() or (s < q).any():
        raise ValueError("each sequence needs 1 <= query_len <= seq_len")
    max_s = int(s.max())
    if max_s > tables.shape[1] * block_size:
        raise ValueError("block_tables are too short for seq_lens")
    return int(q.max()), max_s


def _host_int64(value: np.ndarray | torch.Tensor, name: str) -> np.ndarray:
    """``value`` as an int64 numpy array (a view when it already is one)."""
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise ValueError(f"{name} must be on the CPU (host-known lengths), got {value.device}")
        value = value.numpy()
    return np.asarray(value, dtype=np.int64)


# cuDNN's attention builds a plan per new shape, and a prompt or draft step's key length is new
# every step: on an H200 (torch 2.11) synchronous JSON steps with drafts took 100-170 ms, and
# under bench/gpu/gpu_profile.py cuDNN attention held 40% of their host time, about 1 ms per layer.
# One query per sequence on a CPU without AMX, torch's half-precision SDPA is 3-5x slower than
# its float32 one (AVX512-BF16 without AMX, 1 thread: batch 1 x 100 keys 255 vs 39 us; batch 16
# 3.8 vs 0.95 ms), so decode attends in float32 there. With AMX it is the other way round
# (Xeon with AMX, torch 2.13, 2 threads, bfloat16 vs float32 with the upcasts: batch 1 x 100
# keys 20 vs 41 us; batch 16 x 110 keys 151 vs 937 us; batch 64 x 150 keys 0.71 vs 4.8 ms).
HALF_DECODE_SDPA_FAST: bool = bool(torch.cpu._is_amx_tile_supported())
"""Whether a one-query-per-sequence (decode) step attends in its half-precision dtype on the
CPU (True where the CPU has AMX) instead of upcasting to float32."""

_CUDA_SDPA_BACKENDS = [
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]


def sdpa_backends(device: torch.device) -> AbstractContextManager[object]:
    """Context for one forward's attention: on CUDA, torch's scaled-dot-product attention
    without its cuDNN backend (flash, memory-efficient or math, whichever fits); elsewhere
    nothing. Sets torch's process-wide SDPA backend flags while it is open."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel(_CUDA_SDPA_BACKENDS)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    token_order: bool = False,
    windowed: bool = True,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Writes this step's keys/values into the cache and attends over it.

    Args:
        q: ``[T, num_heads, head_dim]``; k, v: ``[T, num_kv_heads, head_dim]``.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``,
            updated in place at ``meta.slot_mapping``.

        token_order: on the CPU, attend prefill and mixed steps token by token, each token as
            a decode step of its length (``paged_prefill_cpu``: its result then does not
            depend on its prompt's chunking or the batch) instead of the padded SDPA or the
            eager path. May cost a few percent on long prompts
            (``EngineConfig.batch_invariant``).
            Pure-decode CPU steps take the same kernel's decode call whatever this says.
        windowed: this layer keeps to ``meta.sliding_window`` (False: a layer that sees every
            earlier token, Gemma's global ones).
        softcap: scores soft-capped to ``softcap * tanh(score / softcap)`` before the softmax
            (Gemma 2); None: not. Off the CPU kernels the masked eager path below attends.
        sinks: ``[num_heads]`` logits, one per head, that join each query's softmax as an
            extra key with no value (gpt-oss); None: none. Off the CPU kernels the eager
            path attends too.

    Returns:
        ``[T, num_heads, head_dim]`` attention output for the flat tokens.
    """
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    flat_k = key_cache.view(-1, num_kv_heads, head_dim)
    flat_v = value_cache.view(-1, num_kv_heads, head_dim)
    kv_write_(flat_k, flat_v, k, v, meta.slot_mapping)  # one kernel on CUDA
    windowed = windowed and meta.sliding_window is not None
    plain = not windowed and softcap is None and sinks is None
    cpu = paged_decode_fits(q, key_cache, value_cache)
    # What the CPU kernels apply beside plain causal attention (each a no-op when None).
    mods = {
        "window": meta.sliding_window if windowed else None,
        "softcap": softcap,
        "sinks": sinks,
    }
    if cpu and meta.query_index is None:
        # Pure decode on the CPU: one C++ call over the blocks in place, one fixed order per
        # (sequence, head) whatever the batch (the gather + padded SDPA below was 8-10 ops).
        return paged_decode_cpu(
            q, key_cache, value_cache, meta.block_tables, meta.seq_lens, scale, **mods
        )
    if meta.kv_index is None or (meta.query_index is None and q.is_cuda and HAS_TRITON and plain):
        if not plain:
            raise ValueError(
                "a block-table decode step cannot apply a sliding window, softcap or sinks"
            )
        # Pure decode on the GPU (or a block-table decode anywhere): the Triton kernel reads
        # the blocks in place instead of gathering every sequence's keys into a padded copy.
        return paged_decode_attention(
            q, key_cache, value_cache, meta.block_tables, meta.seq_lens, scale
        )
    if token_order and cpu and meta.token_lens is not None:
        # Prefill or mixed on the CPU: each token as a decode step of its length computes it,
        # so its result does not depend on the chunking of its prompt or on the batch.
        assert meta.token_seqs is not None
        return paged_prefill_cpu(
            q,
            key_cache,
            value_cache,
            meta.block_tables,
            meta.token_seqs,
            meta.token_lens,
            scale,
            **mods,
        )
    return _gathered_attention(q, flat_k, flat_v, meta, scale, windowed, softcap, sinks)


def _gathered_attention(
    q: torch.Tensor,
    flat_k: torch.Tensor,
    flat_v: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    windowed: bool,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """``paged_attention``'s padded path: every sequence's keys and values gathered from the
    flat caches into ``[B, kv_heads, S, D]``, queries padded to ``[B, heads, Q, D]``, then SDPA
    (or ``eager_attention`` for soft caps and sinks) under the step's mask."""
    num_kv_heads, head_dim = flat_k.shape[1], flat_k.shape[2]
    b, qlen = meta.num_seqs, meta.max_query_len
    num_heads = q.shape[1]
    if meta.query_index is None:
        qp = q.view(b, 1, num_heads, head_dim)
    else:
        qp = q.new_zeros(b * qlen, num_heads, head_dim)
        qp.index_copy_(0, meta.query_index, q)
        qp = qp.view(b, qlen, num_heads, head_dim)
    # index_select copies whole rows; advanced indexing was 2-4x slower here.
    assert meta.kv_index is not None  # a block-table decode returned above
    kv_shape = (*meta.kv_index.shape, num_kv_heads, head_dim)
    flat_index = meta.kv_index.view(-1)
    keys = flat_k.index_select(0, flat_index).view(kv_shape).transpose(1, 2)  # [B, kvh, S, D]
    values = flat_v.index_select(0, flat_index).view(kv_shape).transpose(1, 2)
    queries = qp.transpose(1, 2)
    upcast = (
        meta.query_index is None
        and not q.is_cuda
        and q.dtype != torch.float32
        and not HALF_DECODE_SDPA_FAST
    )
    if upcast:
        queries, keys, values = queries.float(), keys.float(), values.float()
    gqa = num_heads != num_kv_heads
    if gqa and q.is_cuda:
        # With a mask, only cuDNN (left out by sdpa_backends) fuses grouped-query attention on
        # CUDA; whole heads let the memory-efficient kernel take it instead of the math one,
        # which would hold [B, heads, Q, S] scores in float32.
        # expand + reshape, not repeat_interleave: with an int count that reads its output
        # size back from the device (caught by BATON_SYNC_CHECK on the H200).
        group = num_heads // num_kv_heads
        grouped = (keys.shape[0], num_kv_heads, group, *keys.shape[2:])
        whole = (keys.shape[0], num_heads, *keys.shape[2:])
        keys = keys[:, :, None].expand(grouped).reshape(whole)
        values = values[:, :, None].expand(grouped).reshape(whole)
        gqa = False
    mask = meta.window_mask if windowed else meta.mask
    if softcap is None and sinks is None:
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa
        )
    else:
        out = eager_attention(queries, keys, values, mask, scale, softcap, sinks)
    if upcast:
        out = out.to(q.dtype)
    out = out.transpose(1, 2).reshape(b * qlen, num_heads, head_dim)
    if meta.query_index is not None:
        out = out.index_select(0, meta.query_index)
    return out


def eager_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention in plain torch ops for what SDPA cannot do: scores soft-capped before the
    softmax, ``softcap * tanh(q.k * scale / softcap)`` (Gemma 2), and per-head sink logits
    that join the softmax as a key without a value (gpt-oss); the softmax in float32.

    Args:
        queries: ``[B, heads, Q, D]``; keys, values: ``[B, kv_heads, S, D]`` (grouped-query:
            each key/value head serves ``heads / kv_heads`` query heads in a row).
        mask: bool, broadcastable to ``[B, heads, Q, S]``, True where a query sees a key.
        sinks: ``[heads]`` or None.

    Returns:
        ``[B, heads, Q, D]`` in the values' dtype.
    """
    group = queries.shape[1] // keys.shape[1]
    if group > 1:
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
    b, heads, q_len, _ = queries.shape
    rows = max(1, EAGER_SCORES_MAX // max(1, b * heads * keys.shape[2]))
    if q_len <= rows:
        return _eager_block(queries, keys, values, mask, scale, softcap, sinks)
    # A long prompt's float32 scores would be [B, heads, Q, S]: a block of queries at a time.
    blocks = []
    for start in range(0, q_len, rows):
        part = None if mask is None else mask[..., start : start + rows, :]
        block = queries[:, :, start : start + rows]
        blocks.append(_eager_block(block, keys, values, part, scale, softcap, sinks))
    return torch.cat(blocks, dim=2)


# Scores the eager path holds at once (float32 elements): 64 Mi = 256 MiB.
EAGER_SCORES_MAX = 1 << 26


def _eager_block(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """``eager_attention`` of a block of queries, keys already one per query head."""
    scores = torch.matmul(queries, keys.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32)
    else:
        sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1, dtype=torch.float32)
        weights = weights[..., :-1]
    return torch.matmul(weights.to(values.dtype), values)
