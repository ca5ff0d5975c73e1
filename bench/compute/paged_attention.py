"""Paged decode attention micro-benchmark: the Triton kernel against the torch paths, on CUDA.

SmolLM2-135M's attention shape (9 query heads, 3 kv heads, head dim 64, cache blocks of 16
tokens), one decode token per sequence, every sequence `context` tokens long in shuffled cache
blocks. Per (batch, context) it times, with CUDA events after a warm-up, the median over
--repeats of --inner back-to-back calls of:

- triton: `paged_decode_attention_triton`;
- reference: `paged_decode_attention_torch` (gather to the tables' capacity, float32 SDPA);
- engine: the engine's `paged_attention` (gather to the longest sequence, SDPA in the cache
  dtype, plus its one-token cache write), with its metadata built once outside the timing, as
  the engine builds it once per step for all layers.

Each kernel's output is checked against the reference first. Prints a table (ratio = triton /
engine, lower is better; GB/s = K and V bytes read by the kernel per second) and writes JSON.
Without CUDA or triton it prints one line and exits 0 without writing anything. Small inputs sit
in L2, so their times are a best case; where a call's host work (checks, launch) outlasts its
GPU work, the time is the host's.

    python -m baton.bench.compute.paged_attention [--batches 1,8,32,64] [--contexts 256,1024,4096]
        [--dtype bfloat16|float16|float32] [--block-n 64] [--repeats 15] [--inner 10]
        [--out bench/results/paged_attention.json]
"""

from __future__ import annotations

import argparse
import inspect
import math
import statistics
from collections.abc import Callable

import torch

from baton.bench.common import add_common_args, write_results
from baton.engine.models.attention import AttentionMetadata, paged_attention
from baton.kernels import paged_attention as kpa

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
WARMUP = 3


def time_us(fn: Callable[[], object], repeats: int, inner: int) -> float:
    """Median over `repeats` of the mean time of `inner` back-to-back calls, in microseconds."""
    for _ in range(WARMUP):
        fn()
    samples = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000.0 / inner)
    return statistics.median(samples)


def engine_metadata(seq_lens: torch.Tensor, tables: torch.Tensor) -> AttentionMetadata:
    """The engine's metadata for a pure-decode step, on the GPU. Its builder takes host arrays
    and a device where it has a `device` parameter, device tensors where it has none."""
    query_lens = torch.ones_like(seq_lens)
    if "device" in inspect.signature(AttentionMetadata.build).parameters:
        return AttentionMetadata.build(
            query_lens.cpu(), seq_lens.cpu(), tables.cpu(), BLOCK_SIZE, device=seq_lens.device
        )
    return AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK_SIZE)


def measure(
    batch: int, context: int, dtype: torch.dtype, block_n: int, repeats: int, inner: int
) -> dict[str, float | int]:
    """Time the three paths on one shape; raise AssertionError if an output disagrees."""
    gen = torch.Generator(device="cuda").manual_seed(batch * 100_003 + context)
    blocks_per_seq = math.ceil(context / BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    cache_shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    key_cache = torch.randn(cache_shape, generator=gen, device="cuda", dtype=dtype)
    value_cache = torch.randn(cache_shape, generator=gen, device="cuda", dtype=dtype)
    tables = torch.randperm(num_blocks, generator=gen, device="cuda").view(batch, -1)
    seq_lens = torch.full((batch,), context, dtype=torch.int64, device="cuda")
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen, device="cuda", dtype=dtype)
    scale = HEAD_DIM**-0.5
    meta = engine_metadata(seq_lens, tables)
    # The engine writes the new token's key and value first: give it the ones already there.
    flat_slots = meta.slot_mapping
    new_k = key_cache.view(-1, KV_HEADS, HEAD_DIM)[flat_slots].clone()
    new_v = value_cache.view(-1, KV_HEADS, HEAD_DIM)[flat_slots].clone()
    out = torch.empty_like(q)
    args = (q, key_cache, value_cache, tables, seq_lens, scale)

    def triton_call() -> object:
        return kpa.paged_decode_attention_triton(*args, out, block_n=block_n)

    def reference_call() -> object:
        return kpa.paged_decode_attention_torch(*args)

    def engine_call() -> object:
        return paged_attention(q, new_k, new_v, key_cache, value_cache, meta, scale)

    expected = reference_call().float()
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    errors = {}
    for name, call in (("triton", triton_call), ("engine", engine_call)):
        errors[name] = float((call().float() - expected).abs().max())
        assert errors[name] <= tolerance, f"{name} differs from the reference by {errors[name]}"
    times = {
        name: time_us(call, repeats, inner)
        for name, call in (
            ("triton", triton_call),
            ("reference", reference_call),
            ("engine", engine_call),
        )
    }
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * key_cache.element_size()
    return {
        "batch": batch,
        "context": context,
        "triton_us": times["triton"],
        "reference_us": times["reference"],
        "engine_us": times["engine"],
        "triton_over_engine": times["triton"] / times["engine"],
        "triton_over_reference": times["triton"] / times["reference"],
        "triton_gb_per_s": kv_bytes / times["triton"] / 1e3,
        "triton_max_abs_error": errors["triton"],
        "engine_max_abs_error": errors["engine"],
    }


def print_table(rows: list[dict[str, float | int]]) -> None:
    print(
        f"{'batch':>5} {'context':>7} {'triton us':>10} {'engine us':>10} {'ref us':>10} "
        f"{'tri/eng':>8} {'tri/ref':>8} {'GB/s':>7}"
    )
    for r in rows:
        print(
            f"{r['batch']:>5} {r['context']:>7} {r['triton_us']:>10.1f} {r['engine_us']:>10.1f} "
            f"{r['reference_us']:>10.1f} {r['triton_over_engine']:>8.3f} "
            f"{r['triton_over_reference']:>8.3f} {r['triton_gb_per_s']:>7.0f}"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--contexts", default="256,1024,4096")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--block-n", type=int, default=64, help="keys per kernel tile")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--inner", type=int, default=10, help="calls per timed sample")
    add_common_args(p, "paged_attention", model=False, dtype=None)
    a = p.parse_args(argv)
    if not (torch.cuda.is_available() and kpa.HAS_TRITON):
        print("paged attention benchmark: needs a CUDA device and triton; nothing measured")
        return 0
    dtype = getattr(torch, a.dtype)
    batches = [int(b) for b in a.batches.split(",")]
    contexts = [int(c) for c in a.contexts.split(",")]
    rows = [
        measure(batch, context, dtype, a.block_n, a.repeats, a.inner)
        for batch in batches
        for context in contexts
    ]
    print_table(rows)
    result = {
        "device": torch.cuda.get_device_name(),
        "dtype": a.dtype,
        "shape": {
            "heads": HEADS,
            "kv_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "block_size": BLOCK_SIZE,
        },
        "block_n": a.block_n,
        "repeats": a.repeats,
        "inner": a.inner,
        "rows": rows,
    }
    write_results(result, a.out, None, dtype=a.dtype)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
