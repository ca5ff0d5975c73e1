"""Tensor parallel vs one worker: decode step time, and the share of it spent in collectives.

Every configuration runs the same greedy decode (``--batch-sizes`` requests at once, each
``--output-len`` tokens, EOS ignored, sync scheduling, the worker-process executor). TP=N
runs one torch thread per rank; TP=1 runs twice, with one thread (the same per rank) and with
N threads (the same in all; at most the cores).
The step time is the engine's wall time per step over the decode, and the collective share is
rank 0's time inside all-reduces, the logits gather and the token broadcast over its device
time (``LLM.stats()``'s ``tp_collective_s`` / ``device_s``).

Two models: the default model's own weights (9 query heads, 3 key/value heads, so TP=3 is the
only split it takes besides 1) and, for TP=2, a random-weight model of the same width, depth
and vocabulary with 8 query and 4 key/value heads of 72 dimensions.

    baton bench tensor_parallel [--batch-sizes 1,8] [--output-len 16]
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import replace
from typing import Any

import torch

from baton.bench.common import add_common_args, write_results
from baton.bench.plotting import pyplot
from baton.engine import LLM, SamplingParams
from baton.engine.config import num_cpu_cores
from baton.engine.loader import Checkpoint, expected_weight_shapes, load_checkpoint

PROMPT = "Write a long story about a lighthouse keeper and the sea."


def even_heads_checkpoint(base: Checkpoint, seed: int = 0) -> Checkpoint:
    """The default model's width, depth and vocabulary with 8 query and 4 key/value heads of
    72 dimensions (576 wide, as the original's 9 x 64), random weights (std 0.02, norms 1)."""
    config = replace(base.config, num_heads=8, num_kv_heads=4, head_dim=72)
    gen = torch.Generator().manual_seed(seed)
    weights = {
        name: torch.ones(shape) if len(shape) == 1 else 0.02 * torch.randn(shape, generator=gen)
        for name, shape in expected_weight_shapes(config).items()
    }
    return Checkpoint(base.path, config, weights, base.tokenizer)


def measure(ckpt: Checkpoint, tp: int, threads: int, batch: int, output_len: int) -> dict[str, Any]:
    """One engine at ``tp`` ranks: a warm-up batch, then ``batch`` requests decoded together;
    returns the step time and the collective share over the measured batch."""
    llm = LLM.from_checkpoint(
        ckpt,
        dtype="float32",
        tensor_parallel_size=tp,
        worker_threads=max(1, threads // tp),
        async_scheduling=False,
        executor="mp",
        max_model_len=256,
        enable_prefix_caching=False,
    )
    try:
        sp = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        llm.generate([PROMPT] * batch, sp, use_tqdm=False)  # warm-up: same shapes
        before = llm.stats()
        t0 = time.perf_counter()
        llm.generate([PROMPT] * batch, sp, use_tqdm=False)
        wall = time.perf_counter() - t0
        after = llm.stats()
    finally:
        llm.shutdown()
    steps = int(after["steps"]) - int(before["steps"])
    device = float(after["device_s"]) - float(before["device_s"])
    comm = float(after.get("tp_collective_s", 0.0)) - float(before.get("tp_collective_s", 0.0))
    return {
        "tp": tp,
        "threads_per_rank": threads,
        "batch": batch,
        "steps": steps,
        "step_ms": 1000 * wall / steps,
        "device_step_ms": 1000 * device / steps,
        "collective_share": comm / device if device > 0 else 0.0,
    }


def plot(result: dict, path: Any) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    labels, values, shares = [], [], []
    for row in result["rows"]:
        labels.append(
            f"{row['model'][:13]}\nTP={row['tp']}x{row['threads_per_rank']}t b={row['batch']}"
        )
        values.append(row["step_ms"])
        shares.append(row["collective_share"])
    bars = ax.bar(range(len(values)), values, color="tab:blue")
    for bar, share in zip(bars, shares, strict=True):
        if share:
            ax.annotate(
                f"{100 * share:.0f}% coll.",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=7,
            )
    ax.set_xticks(range(len(values)), labels, fontsize=6)
    ax.set_ylabel("decode step time (ms)")
    ax.set_title("Tensor parallel vs one worker (float32, sync; TP=NxTt: N ranks of T threads)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="baton bench tensor_parallel", description=__doc__)
    add_common_args(parser, "tensor_parallel", model=False, dtype=None)
    parser.add_argument("--batch-sizes", default="1,8", help="requests decoded at once")
    parser.add_argument("--output-len", type=int, default=16, help="tokens per request")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batch_sizes.split(",") if b]
    base = load_checkpoint(None, dtype=torch.float32)
    models = [
        ("default model (9/3 heads)", base, (1, 3)),
        ("same shape, 8/4 heads, random", even_heads_checkpoint(base), (1, 2)),
    ]
    rows = []
    for name, ckpt, (_, n) in models:
        # (ranks, threads per rank): one worker with 1 thread and with as many as the ranks
        # (at most the cores), then n ranks of 1.
        runs = [(1, 1), (1, min(n, num_cpu_cores())), (n, 1)]
        for batch in batches:
            for tp, threads in runs:
                row = {"model": name, **measure(ckpt, tp, threads, batch, args.output_len)}
                rows.append(row)
                print(
                    f"{name:30s} TP={tp} x {threads} threads, batch {batch:3d}: "
                    f"{row['step_ms']:7.1f} ms/step "
                    f"(device {row['device_step_ms']:.1f} ms), collectives "
                    f"{100 * row['collective_share']:.0f}% of it"
                )
    result = {
        "config": {
            "batch_sizes": batches,
            "output_len": args.output_len,
            "cpu_cores": num_cpu_cores(),
            "dtype": "float32",
        },
        "rows": rows,
    }
    # The machine's load at the end: on a shared 2-core machine it decides these numbers.
    write_results(result, args.out, plot, dtype="float32", load_average=list(os.getloadavg()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
