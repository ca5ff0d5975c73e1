"""Linear-kernel benchmark: every linear layer of the model (LM head included) at a few row
counts, as dense float32 and bfloat16 (``F.linear``), the same with weights packed once for
oneDNN (``engine/models/packed.py``), and int8 weight-only (bfloat16 activations).

It is the measurement behind packing at every row count, and the price by rows of
``quantization="int8"`` (the rows up to which the int8 kernel beats the packed bfloat16
GEMM, and by how much it loses above them). The kernels are interleaved trial by trial in
one run. Writes JSON and a PNG.

    baton bench linear_kernels [--model PATH] [--rows 1,2,4,8,16] [--trials 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from baton.bench.common import add_common_args, write_results
from baton.bench.plotting import pyplot
from baton.engine.loader import load_checkpoint
from baton.engine.models.packed import (
    PackedWeight,
    pack_linear,
    packed_linear,
    packing_available,
)
from baton.engine.models.quant import Int8Weight, int8_linear, quantize_int8

KERNELS = ("float32", "float32_packed", "bfloat16", "bfloat16_packed", "int8")


def linear_weights(weights: dict[str, torch.Tensor], tied: bool) -> list[torch.Tensor]:
    """The weights the decoder multiplies with, fused as the model fuses them (QKV, gate/up),
    plus the LM head (the embedding when tied), in float32."""
    out = []
    layer = 0
    while f"model.layers.{layer}.self_attn.q_proj.weight" in weights:
        p = f"model.layers.{layer}."
        out.append(torch.cat([weights[f"{p}self_attn.{n}_proj.weight"] for n in "qkv"]))
        out.append(weights[p + "self_attn.o_proj.weight"])
        out.append(torch.cat([weights[f"{p}mlp.{n}_proj.weight"] for n in ("gate", "up")]))
        out.append(weights[p + "mlp.down_proj.weight"])
        layer += 1
    out.append(weights["model.embed_tokens.weight" if tied else "lm_head.weight"])
    return [w.float().contiguous() for w in out]


def _runner(kernel: str, weights: list[torch.Tensor]) -> Callable[[int], float]:
    """A function timing one pass over every weight at ``rows`` rows (seconds)."""
    if kernel == "int8":
        q: list[Int8Weight] = [quantize_int8(w, torch.bfloat16) for w in weights]

        def run(rows: int) -> float:
            xs = [torch.randn(rows, w.qweight.shape[1], dtype=torch.bfloat16) for w in q]
            t0 = time.perf_counter()
            for x, w in zip(xs, q, strict=True):
                int8_linear(x, w)
            return time.perf_counter() - t0

        return run
    dtype = getattr(torch, kernel.removesuffix("_packed"))
    if kernel.endswith("_packed"):
        packed: list[PackedWeight] = [pack_linear(w.to(dtype)) for w in weights]
        shapes = [w.shape[1] for w in weights]

        def run_packed(rows: int) -> float:
            xs = [torch.randn(rows, n, dtype=dtype) for n in shapes]
            t0 = time.perf_counter()
            for x, w in zip(xs, packed, strict=True):
                packed_linear(x, w)
            return time.perf_counter() - t0

        return run_packed
    dense = [w.to(dtype) for w in weights]

    def run_dense(rows: int) -> float:
        xs = [torch.randn(rows, w.shape[1], dtype=dtype) for w in dense]
        t0 = time.perf_counter()
        for x, w in zip(xs, dense, strict=True):
            F.linear(x, w)
        return time.perf_counter() - t0

    return run_dense


@torch.inference_mode()
def run(model: str | None, rows: list[int], trials: int) -> dict:
    ckpt = load_checkpoint(model)
    weights = linear_weights(ckpt.weights, ckpt.config.tie_word_embeddings)
    kernels = [
        k
        for k in KERNELS
        if not k.endswith("_packed") or packing_available(getattr(torch, k.removesuffix("_packed")))
    ]
    runners = {k: _runner(k, weights) for k in kernels}
    for fn in runners.values():  # warm-up: first calls pack weights, pick kernels
        fn(rows[0])
    table = []
    for m in rows:
        times: dict[str, list[float]] = {k: [] for k in kernels}
        for _ in range(trials):
            for k, fn in runners.items():  # interleaved, so drift hits every kernel alike
                times[k].append(fn(m))
        ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        table.append({"rows": m, **{f"{k}_ms": v for k, v in ms.items()}})
        print(f"M={m:<3} " + "  ".join(f"{k} {v:7.2f} ms" for k, v in ms.items()), flush=True)
    dense_bf16 = "bfloat16_packed" if "bfloat16_packed" in kernels else "bfloat16"
    faster = [r["rows"] for r in table if r["int8_ms"] < r[f"{dense_bf16}_ms"]]
    return {
        "model": str(ckpt.path),
        "weights": len(weights),
        "parameters": sum(w.numel() for w in weights),
        "trials": trials,
        "rows": table,
        "kernels": kernels,
        "int8_faster_than": dense_bf16,
        "int8_faster_than_bfloat16_at": faster,
    }


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ms = [r["rows"] for r in result["rows"]]
    for k in result.get("kernels", KERNELS):
        ax.plot(ms, [r[f"{k}_ms"] for r in result["rows"]], marker="o", label=k)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows (tokens in the step)")
    ax.set_ylabel("ms, all linear layers once")
    ax.set_title("The model's linear layers, one pass")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p, "linear_kernels", dtype=None)
    p.add_argument("--rows", default="1,2,4,8,16,32")
    p.add_argument("--trials", type=int, default=7)
    a = p.parse_args(argv)
    result = run(a.model, [int(r) for r in a.rows.split(",")], a.trials)
    write_results(result, a.out, plot, dtype=",".join(result["kernels"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
