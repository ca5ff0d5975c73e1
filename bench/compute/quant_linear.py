"""Quantised-linear benchmark: baton's GGUF block kernel (``kernels/quant_linear.py``) against
the paths the model takes today, by row count, interleaved trial by trial in one run.

Workloads: every linear layer of the default model as its file stores them (SmolLM2-135M:
Q4_1 linears, fused QKV and gate/up as the model fuses them, and the Q8_0 tied LM head), and
one decoder layer of a 1B-shape Llama (hidden 2048, intermediate 8192, 32 query / 8 KV heads of
64; random blocks) in each of Q4_0, Q4_1, Q4_K, Q6_K and Q8_0; the K-quants also with int8
activations (``gguf_int8act_*``, llama.cpp's numerics). The baselines multiply the same
weights dequantised: float32 and bfloat16 packed for oneDNN (``engine/models/packed.py``), int8
per-row (``engine/models/quant.py``, bfloat16 activations), and for the 4-bit formats torch's
``_weight_int4pack_mm_for_cpu`` (bfloat16 activations and scales, its fast path; its float32
path, the exact one, is far slower still, see the kernel module's docstring). At M=1 it also
reports each kernel's weight bytes per second against a measured copy bandwidth and a read
(sum) bandwidth, and it records whether torch's int4 kernel represents Q4_0 / Q4_1 exactly and
is batch-invariant (``torch_int4_check``). Medians of the trials are the table; the best
trial is recorded beside each (``_min_ms``), the better estimate on a machine shared with other
work. Writes JSON and a PNG.

    baton bench quant_linear [--rows 1,2,4,8,16,32,64] [--trials 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from baton.bench.common import add_common_args, run_order, write_results
from baton.bench.plotting import pyplot
from baton.bench.tables import COMPACT, markdown_table
from baton.engine.loader import default_model_path
from baton.engine.loader.gguf_reader import read_gguf_file
from baton.engine.models.packed import pack_linear, packed_linear, packing_available
from baton.engine.models.quant import int8_linear, quantize_int8
from baton.kernels.quant_formats import FORMATS, dequantize, repack
from baton.kernels.quant_linear import (
    INT8_FORMATS,
    available_isas,
    quant_linear,
    repack_native,
    selected_isa,
)

LLAMA_1B = {"hidden": 2048, "intermediate": 8192, "heads": 32, "kv_heads": 8, "head_dim": 64}


@dataclass(frozen=True)
class Workload:
    """Weights multiplied once per pass, each as GGUF block bytes and their type name."""

    name: str
    weights: tuple[tuple[np.ndarray, str], ...]


def smollm2_workload(path: Path) -> Workload:
    """The default model's linears from its GGUF file (QKV and gate/up fused by rows)."""
    tensors = {t.name: t for t in read_gguf_file(path).tensors}
    weights = []
    layer = 0
    while f"blk.{layer}.attn_q.weight" in tensors:
        group = [["attn_q", "attn_k", "attn_v"], ["attn_output"], ["ffn_gate", "ffn_up"]]
        group.append(["ffn_down"])
        for names in group:
            parts = [tensors[f"blk.{layer}.{n}.weight"] for n in names]
            kind = {p.tensor_type.name for p in parts}.pop()
            weights.append((np.concatenate([np.asarray(p.data) for p in parts]), kind))
        layer += 1
    head = tensors.get("output.weight", tensors["token_embd.weight"])
    weights.append((np.asarray(head.data), head.tensor_type.name))
    return Workload(f"smollm2-135m ({path.name})", tuple(weights))


# Byte offsets of the fp16 fields of each format's block; the other bytes are quants or packed
# small scales, any value valid.
_FP16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q6_K": (208,)}


def random_blocks(
    fmt: str, n: int, k: int, rng: np.random.Generator, scale: float = 0.01
) -> np.ndarray:
    """[n, k] weights as random GGUF blocks: random quant and small-scale bytes, fp16 scales
    drawn from N(0, ``scale``) (of either sign; 0.01 is a trained model's size)."""
    spec = FORMATS[fmt]
    nblocks = k // spec.block_weights
    blocks = rng.integers(0, 256, (n, nblocks, spec.block_bytes), dtype=np.uint8)
    for at in _FP16_FIELDS[fmt]:
        scales = (rng.standard_normal((n, nblocks)) * scale).astype(np.float16)
        blocks[..., at : at + 2] = scales.view(np.uint8).reshape(n, nblocks, 2)
    return blocks.reshape(n, -1)


def llama_1b_layer(fmt: str) -> Workload:
    """One decoder layer of the 1B shape: fused QKV, O, fused gate/up, down."""
    s = LLAMA_1B
    h, qkv = s["hidden"], (s["heads"] + 2 * s["kv_heads"]) * s["head_dim"]
    shapes = [(qkv, h), (h, s["heads"] * s["head_dim"]), (2 * s["intermediate"], h)]
    shapes.append((h, s["intermediate"]))
    rng = np.random.default_rng(0)
    return Workload(
        f"llama-1b layer {fmt}", tuple((random_blocks(fmt, n, k, rng), fmt) for n, k in shapes)
    )


Runner = Callable[[int], float]


def _timed(xs: list[torch.Tensor], calls: list[Callable[[torch.Tensor], torch.Tensor]]) -> float:
    t0 = time.perf_counter()
    for x, call in zip(xs, calls, strict=True):
        call(x)
    return time.perf_counter() - t0


def _runner(ks: list[int], dtype: torch.dtype, calls: list) -> Runner:
    def run(rows: int) -> float:
        xs = [torch.randn(rows, k).to(dtype) for k in ks]
        return _timed(xs, calls)

    return run


def runners(workload: Workload) -> tuple[dict[str, Runner], dict[str, int], dict[str, float]]:
    """Each kernel's pass over the workload, the bytes of weights it reads per pass, and the
    seconds the numpy and the native repack took for all the workload's weights."""
    t0 = time.perf_counter()
    [repack(raw, fmt) for raw, fmt in workload.weights]
    t1 = time.perf_counter()
    quant = [repack_native(raw, fmt) for raw, fmt in workload.weights]
    repack_s = {"numpy": t1 - t0, "native": time.perf_counter() - t1}
    ks = [w.k for w in quant]
    dense = [dequantize(w) for w in quant]
    params = sum(w.numel() for w in dense)
    out: dict[str, Runner] = {}
    nbytes: dict[str, int] = {}
    isa = selected_isa()
    isas = [isa] + [i for i in available_isas() if i != isa]
    for i, name in enumerate(isas):
        for dtype in (torch.float32, torch.bfloat16) if i == 0 else (torch.float32,):
            label = f"gguf_{str(dtype).removeprefix('torch.')}_{name}"
            calls = [lambda x, w=w, name=name: quant_linear(x, w, isa=name) for w in quant]
            out[label] = _runner(ks, dtype, calls)
            nbytes[label] = sum(w.nbytes for w in quant)
    if any(fmt in INT8_FORMATS for _, fmt in workload.weights):
        label = f"gguf_int8act_{isa}"  # llama.cpp's numerics: int8 rows of x (bfloat16 in)
        calls = [lambda x, w=w: quant_linear(x, w, isa=isa, activations="int8") for w in quant]
        out[label] = _runner(ks, torch.bfloat16, calls)
        nbytes[label] = sum(w.nbytes for w in quant)
    for dtype in (torch.float32, torch.bfloat16):
        if packing_available(dtype):
            packed = [pack_linear(w.to(dtype)) for w in dense]
            label = f"{str(dtype).removeprefix('torch.')}_packed"
            out[label] = _runner(ks, dtype, [lambda x, p=p: packed_linear(x, p) for p in packed])
            nbytes[label] = params * dtype.itemsize
    int8 = [quantize_int8(w, torch.bfloat16) for w in dense]
    out["int8"] = _runner(ks, torch.bfloat16, [lambda x, q=q: int8_linear(x, q) for q in int8])
    nbytes["int8"] = sum(q.qweight.numel() + 2 * q.scales.numel() for q in int8)
    if all(fmt in ("Q4_0", "Q4_1") for _, fmt in workload.weights):
        out["int4pack_bfloat16"], nbytes["int4pack_bfloat16"] = _int4pack(workload.weights, ks)
    del dense
    return out, nbytes, repack_s


def int4pack_calls(
    weights: tuple[tuple[np.ndarray, str], ...], dtype: torch.dtype
) -> tuple[list[Callable[[torch.Tensor], torch.Tensor]], int]:
    """torch's int4 kernel on 4-bit GGUF weights, one call per weight, and the bytes it holds:
    its q is the block's nibbles, its scale d, its zero m + 8 d (Q4_1) or 0 (Q4_0), both in
    ``dtype`` (x's dtype, which the kernel requires of them)."""
    calls, nbytes = [], 0
    for raw, fmt in weights:
        blocks = raw.reshape(raw.shape[0], -1, FORMATS[fmt].block_bytes)
        scales = 2 if fmt == "Q4_1" else 1
        head = np.ascontiguousarray(blocks[..., : 2 * scales]).view(np.float16)
        d = torch.from_numpy(head[..., 0].astype(np.float32))
        m = torch.from_numpy(head[..., 1].astype(np.float32)) if scales == 2 else None
        qs = torch.from_numpy(np.ascontiguousarray(blocks[..., 2 * scales :]))
        q = torch.cat([qs & 0x0F, qs >> 4], -1).reshape(raw.shape[0], -1).to(torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        zero = torch.zeros_like(d) if m is None else m + 8 * d
        sz = torch.stack([d, zero], -1).transpose(0, 1).contiguous().to(dtype)
        calls.append(
            lambda x, p=packed, s=sz: torch.ops.aten._weight_int4pack_mm_for_cpu(x, p, 32, s)
        )
        nbytes += packed.numel() * packed.element_size() + sz.numel() * sz.element_size()
    return calls, nbytes


def _int4pack(weights: tuple[tuple[np.ndarray, str], ...], ks: list[int]) -> tuple[Runner, int]:
    """torch's int4 kernel timed on its fast path: bfloat16 activations and scales."""
    calls, nbytes = int4pack_calls(weights, torch.bfloat16)
    return _runner(ks, torch.bfloat16, calls), nbytes


def torch_int4_check(n: int = 512, k: int = 2048, max_rows: int = 64) -> dict:
    """Whether torch's int4 kernel represents Q4_0 / Q4_1 weights exactly (every weight of a
    gguf-quantised [n, k] matrix, read back through an identity matrix, against gguf's
    dequantisation rounded to x's dtype) and gives row 0 the same bits at M = 1..max_rows."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize
    from gguf.quants import quantize as gguf_quantize

    rng = np.random.default_rng(1)
    w = rng.standard_normal((n, k)) * rng.uniform(1e-3, 1, (n, 1)) + rng.uniform(-0.5, 0.5, (n, 1))
    out: dict[str, dict] = {}
    for fmt in ("Q4_0", "Q4_1"):
        raw = gguf_quantize(w.astype(np.float32), GGMLQuantizationType[fmt])
        exact = torch.from_numpy(gguf_dequantize(raw, GGMLQuantizationType[fmt]))
        out[fmt] = {}
        for dtype in (torch.float32, torch.bfloat16):
            call = int4pack_calls(((raw, fmt),), dtype)[0][0]
            read = call(torch.eye(k, dtype=dtype)).T.float()
            x = torch.randn(max_rows, k).to(dtype)
            alone = call(x[:1])
            varying = [m for m in range(1, max_rows + 1) if not torch.equal(call(x[:m])[:1], alone)]
            out[fmt][str(dtype).removeprefix("torch.")] = {
                "weights_differing": int((read != exact.to(dtype).float()).sum()),
                "weights": exact.numel(),
                "rows_where_row0_changed": varying,
            }
    return out


def memory_bandwidth(mib: int = 256, trials: int = 5) -> tuple[float, float]:
    """GB/s of a large float32 tensor copy (bytes read + bytes written) and of a sum over it
    (bytes read: what a weights-bound step does), best of ``trials`` each, on torch's
    threads."""
    src = torch.ones(mib * 2**18)
    dst = torch.empty_like(src)
    dst.copy_(src)
    nbytes = src.numel() * 4
    copy = min(_seconds(lambda: dst.copy_(src)) for _ in range(trials))
    read = min(_seconds(src.sum) for _ in range(trials))
    return 2 * nbytes / copy / 1e9, nbytes / read / 1e9


def _seconds(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@torch.inference_mode()
def run_workload(
    workload: Workload, rows: list[int], trials: int, bandwidth: tuple[float, float]
) -> dict:
    fns, nbytes, repack_s = runners(workload)
    for fn in fns.values():  # warm-up: builds the extension, lets oneDNN pick its kernels
        fn(rows[0])
    table = []
    for m in rows:
        times: dict[str, list[float]] = {k: [] for k in fns}
        for trial in range(trials):
            for k in run_order(list(fns), trial):  # interleaved, alternating order
                times[k].append(fns[k](m))
        ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        best = {f"{k}_min_ms": min(v) * 1e3 for k, v in times.items()}
        table.append({"rows": m, **{f"{k}_ms": v for k, v in ms.items()}, **best})
        print(f"{workload.name} M={m:<3} " + "  ".join(f"{k} {v:.2f}" for k, v in ms.items()))
    m1 = next((r for r in table if r["rows"] == 1), None)
    used = {}
    if m1 is not None:  # weight bytes per second at M=1, median and best trial
        for k in fns:
            gbs = nbytes[k] / (m1[f"{k}_ms"] / 1e3) / 1e9
            top = nbytes[k] / (m1[f"{k}_min_ms"] / 1e3) / 1e9
            used[k] = {
                "GB/s": gbs,
                "of_copy": gbs / bandwidth[0],
                "of_read": gbs / bandwidth[1],
                "best_GB/s": top,
            }
    return {
        "name": workload.name,
        "formats": sorted({fmt for _, fmt in workload.weights}),
        "weights": len(workload.weights),
        "weight_bytes": nbytes,
        "repack_s": repack_s,
        "kernels": list(fns),
        "rows": table,
        "m1_weight_bandwidth": used,
    }


def run(model: str | None, rows: list[int], trials: int, formats: list[str]) -> dict:
    load_before = os.getloadavg()
    torch_int4 = torch_int4_check()
    print(f"torch int4 on GGUF Q4_0/Q4_1: {torch_int4}", flush=True)
    bandwidth = memory_bandwidth()
    print(
        f"copy {bandwidth[0]:.1f} GB/s, read {bandwidth[1]:.1f} GB/s; kernel ISA {selected_isa()}",
        flush=True,
    )
    path = Path(model) if model else default_model_path()
    workloads = [smollm2_workload(path)] + [llama_1b_layer(f) for f in formats]
    results = [run_workload(w, rows, trials, bandwidth) for w in workloads]
    return {
        "trials": trials,
        "torch_int4": torch_int4,
        "copy_bandwidth_GBps": bandwidth[0],
        "read_bandwidth_GBps": bandwidth[1],
        "isa": selected_isa(),
        "available_isas": list(available_isas()),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "workloads": results,
    }


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    workloads = result["workloads"]
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.2 * len(workloads), 3.6), squeeze=False)
    for ax, w in zip(axes[0], workloads, strict=True):
        ms = [r["rows"] for r in w["rows"]]
        for k in w["kernels"]:
            style = "-" if k.startswith("gguf") else "--"
            ax.plot(ms, [r[f"{k}_ms"] for r in w["rows"]], style, marker="o", ms=3, label=k)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("rows (tokens in the step)")
        ax.set_ylabel("ms, one pass")
        ax.set_title(w["name"], fontsize=9)
    labels: dict[str, object] = {}  # every kernel once, whichever panel has it
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            labels.setdefault(label, handle)
    fig.legend(list(labels.values()), list(labels), loc="lower center", ncol=len(labels))
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)


def readme_table(result: dict) -> str:
    """The README's section body: where it ran, each kernel's weight bandwidth at one row
    against the measured copy bandwidth, and milliseconds per pass by row count."""
    run = result.get("run", {})
    parts = [
        f"{run.get('cpu', '?')}, {run.get('torch_threads', '?')} torch threads, kernel ISA "
        f"{result['isa']}, commit {str(run.get('commit', '?'))[:7]}, "
        f"{str(run.get('date', '?'))[:10]}; copy {result['copy_bandwidth_GBps']:.1f} GB/s, "
        f"read {result['read_bandwidth_GBps']:.1f} GB/s; median of {result['trials']} "
        "interleaved trials. `gguf_*`: the GGUF blocks kept (`gguf_int8act_*`: int8 rows of x, "
        "llama.cpp's numerics); the others multiply the same weights dequantised."
    ]
    for w in result["workloads"]:
        header = ["kernel", "weight MB", "M=1 GB/s (of copy)"]
        header += [f"M={r['rows']} ms" for r in w["rows"]]
        rows = []
        for k in w["kernels"]:
            bw = w["m1_weight_bandwidth"].get(k)
            m1 = f"{bw['GB/s']:.1f} ({bw['of_copy']:.0%})" if bw else "-"
            ms = [f"{r[f'{k}_ms']:.2f}" for r in w["rows"]]
            rows.append([str(k), f"{w['weight_bytes'][k] / 1e6:.1f}", m1, *ms])
        parts.append(f"**{w['name']}**\n\n" + markdown_table(header, rows, COMPACT))
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p, "quant_linear", dtype=None)
    p.add_argument("--rows", default="1,2,4,8,16,32,64")
    p.add_argument("--trials", type=int, default=7)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: as set)")
    p.add_argument("--formats", default="Q4_0,Q4_1,Q4_K,Q6_K,Q8_0", help="for the 1B-shape layer")
    a = p.parse_args(argv)
    if a.threads is not None:
        torch.set_num_threads(a.threads)
    formats = [f for f in a.formats.split(",") if f]
    for f in formats:
        if f not in FORMATS:
            p.error(f"--formats: {f!r} has no kernel; choose from {', '.join(FORMATS)}")
    result = run(a.model, [int(r) for r in a.rows.split(",")], a.trials, formats)
    write_results(result, a.out, plot, dtype="float32,bfloat16")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
