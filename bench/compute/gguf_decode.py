"""Weight quantisations side by side on a GGUF model: ``quantization`` None (dequantised at
load, packed for oneDNN), "gguf" (the file's blocks kept, ``kernels/quant_linear.py``) and
"int8" (``aten._weight_int8pack_mm``), in float32 and bfloat16; "gguf" with int8 activations
for its K-quant weights (the default, llama.cpp's numerics) or, with the ``float-activations``
option, float32 ones (``EngineConfig.gguf_activations``).

Each configuration runs in a fresh interpreter (so its peak RSS is its own), ``--threads``
torch threads (default 1), the in-process executor, configurations interleaved and their
order reversed every other repeat: the engine's start time (load, build, pack or repack),
greedy decode tok/s at batch 1 and at batch 16 (``--steps`` tokens per request, after a
warm-up), the peak RSS (``ru_maxrss``) and the RSS after the imports, the memory on
transparent huge pages at the end (``AnonHugePages``; where the GGUF blocks are kept, their
buffers ask for them: ``kernels/huge_pages.py``), and the load average when it started.
For the configurations that keep the GGUF blocks it also reports the bandwidth a batch-1
step reads the weights at (the file's bytes a step reads, times b1 tok/s) against this
machine's copy and read bandwidth with the same threads (``bench/compute/memory_bandwidth.py``).
Writes JSON.

    baton bench gguf_decode [--model PATH] [--steps 32] [--repeats 2]
        [--configs bfloat16:none,bfloat16:gguf,bfloat16:gguf:torch-ops,...] [--threads 1]

A configuration is ``dtype:quantization`` and options after further colons: ``torch-ops``
(RMSNorm and RoPE as torch ops), ``float-activations`` (gguf_activations="float32").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from baton.bench.common import add_common_args, run_order, write_results
from baton.bench.compute.memory_bandwidth import memory_bandwidth, weight_bytes_per_token
from baton.bench.tables import COMPACT, markdown_table, where_run
from baton.engine.loader import default_model_path

DEFAULT_CONFIGS = tuple(
    f"{d}:{q}" for d in ("bfloat16", "float32") for q in ("none", "gguf", "int8")
)
BATCHES = (1, 16)

# Run in a fresh interpreter per configuration: argv is model (or ""), dtype, quantization,
# steps; the last line of stdout is the result as JSON.
_CHILD = r"""
import json, resource, sys, time
import torch
torch.set_num_threads(int(sys.argv[5]))
from baton.engine import LLM, SamplingParams
import baton.kernels.quant_linear, baton.engine.loader.gguf_quant  # in the RSS baseline
rss_imports = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
model, dtype, quant, steps = sys.argv[1] or None, sys.argv[2], sys.argv[3], int(sys.argv[4])
t0 = time.perf_counter()
llm = LLM(model, dtype=getattr(torch, dtype), quantization=None if quant == "none" else quant,
          executor="uni", adapt_cpu_threads=False, max_num_seqs=16, num_kv_blocks=256,
          gguf_activations=sys.argv[6])
out = {"start_s": time.perf_counter() - t0, "rss_imports_mib": rss_imports}
prompts = [f"Item {i} of the list is" for i in range(16)]
params = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
llm.generate(prompts[:2], params(4), use_tqdm=False)  # warm-up (the kernel's first call)
for batch in BATCHES:
    t = time.perf_counter()
    res = llm.generate(prompts[:batch], params(steps), use_tqdm=False)
    tokens = sum(len(r.outputs[0].token_ids) for r in res)
    out[f"b{batch}_tok_s"] = tokens / (time.perf_counter() - t)
out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
out["quantization"] = llm.engine.stats()["quantization"]
try:  # memory on transparent huge pages (kernels/huge_pages.py), Linux only
    with open("/proc/self/smaps_rollup") as f:
        huge = [line.split()[1] for line in f if line.startswith("AnonHugePages:")]
    out["anon_huge_mib"] = int(huge[0]) / 1024
except (OSError, IndexError):
    out["anon_huge_mib"] = None
llm.shutdown()
print(json.dumps(out))
""".replace("BATCHES", repr(BATCHES))


def run_config(
    model: str | None,
    dtype: str,
    quantization: str,
    steps: int,
    threads: int = 1,
    cpu_ops: bool = True,
    gguf_activations: str = "int8",
) -> dict[str, Any]:
    """One configuration in a fresh interpreter with ``threads`` OpenMP threads (``cpu_ops``
    False: RMSNorm and RoPE as torch ops, ``BATON_CPU_OPS=0``; ``gguf_activations`` as
    ``EngineConfig``'s); its measurements.

    Raises:
        RuntimeError: the child failed (its stderr's end in the message).
    """
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), BATON_CPU_OPS="1" if cpu_ops else "0")
    argv = [sys.executable, "-c", _CHILD, model or "", dtype, quantization, str(steps)]
    argv += [str(threads), gguf_activations]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        # From the traceback on: what the interpreter prints at exit may follow it.
        err = proc.stderr[proc.stderr.rfind("Traceback") :][:3000]
        raise RuntimeError(f"{dtype}/{quantization} failed: {err}")
    return json.loads(lines[-1])


def _huge(rows: list[dict[str, Any]]) -> str:
    values = [r["anon_huge_mib"] for r in rows if r.get("anon_huge_mib") is not None]
    return f"{min(values):.0f}" if values else "-"


GGUF_DECODE_HEADER = (
    "dtype:quantization",
    "start s (min)",
    "b1 tok/s (best)",
    "b16 tok/s (best)",
    "peak RSS MiB (after imports)",
    "on huge pages MiB",
    "b1 weights GB/s (of copy, of read)",
    "load avg",
)


def _table(rows: dict[str, list[dict[str, Any]]], result: dict[str, Any] | None = None) -> str:
    bandwidth = (result or {}).get("memory_bandwidth")
    weight_bytes = (result or {}).get("weight_bytes_per_token")
    out = []
    for name, rs in rows.items():
        best_b1 = max(r["b1_tok_s"] for r in rs)
        reads = "-"
        if bandwidth and weight_bytes and name.split(":")[1] == "gguf":
            gb_s = weight_bytes * best_b1 / 1e9
            reads = (
                f"{gb_s:.1f} ({gb_s / bandwidth['copy_gb_s']:.0%}, "
                f"{gb_s / bandwidth['read_gb_s']:.0%})"
            )
        out.append(
            [
                name,
                f"{min(r['start_s'] for r in rs):.2f}",
                f"{best_b1:.1f}",
                f"{max(r['b16_tok_s'] for r in rs):.1f}",
                f"{max(r['peak_rss_mib'] for r in rs):.0f} "
                f"({max(r['rss_imports_mib'] for r in rs):.0f})",
                _huge(rs),
                reads,
                ", ".join(f"{r['load_avg']:.1f}" for r in rs),
            ]
        )
    return markdown_table(GGUF_DECODE_HEADER, out, COMPACT)


def readme_table(result: dict[str, Any]) -> str:
    """The README's section body for a result file: what ran where, then the table."""
    run = result.get("run", {})
    model = Path(result["model"]).name if result["model"] != "default" else "the default model"
    head = (
        f"{model}, {result['steps']} greedy tokens per request, {run.get('torch_threads', '?')} "
        f"torch threads, the in-process executor, each configuration in a fresh process; "
        f"{where_run(result)}. Configurations: dtype:quantization, "
        '`float-activations` = `gguf_activations="float32"` (else int8 for the K-quants).'
    )
    bandwidth = result.get("memory_bandwidth")
    if bandwidth:
        head += (
            f" A batch-1 step reads {result['weight_bytes_per_token'] / 1e6:.0f} MB of weights "
            f"in the GGUF configurations; this machine copied at {bandwidth['copy_gb_s']:.1f} "
            f"GB/s (read + written) and read at {bandwidth['read_gb_s']:.1f} GB/s with the "
            "same threads."
        )
    return head + "\n\n" + _table(result["configs"], result)


def main(argv: Sequence[str] | None = None) -> None:
    """Runs the comparison, prints each result and a table, writes the JSON."""
    parser = argparse.ArgumentParser(prog="baton bench gguf_decode", description=__doc__)
    add_common_args(parser, "gguf_decode", dtype=None)
    parser.add_argument("--steps", type=int, default=32, help="tokens per request")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--configs",
        default=",".join(DEFAULT_CONFIGS),
        help="dtype:quant[:option...],... (options: torch-ops, float-activations)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per engine")
    args = parser.parse_args(argv)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    rows: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    bandwidth = memory_bandwidth(args.threads)
    weights = weight_bytes_per_token(args.model or default_model_path())
    print(f"memory: {json.dumps(bandwidth)}; weights read per token: {weights} bytes", flush=True)
    for repeat in range(args.repeats):
        for config in run_order(configs, repeat):
            dtype, quantization, *options = config.split(":")
            unknown = set(options) - {"torch-ops", "float-activations"}
            if unknown:
                parser.error(f"unknown option(s) {sorted(unknown)} in config {config!r}")
            load_avg = os.getloadavg()[0]
            result = run_config(
                args.model,
                dtype,
                quantization,
                args.steps,
                args.threads,
                cpu_ops="torch-ops" not in options,
                gguf_activations="float32" if "float-activations" in options else "int8",
            )
            result["load_avg"] = load_avg
            rows[config].append(result)
            print(repeat, config, json.dumps(result), flush=True)
    result = {
        "configs": rows,
        "steps": args.steps,
        "model": args.model or "default",
        "memory_bandwidth": bandwidth,
        "weight_bytes_per_token": weights,
    }
    print(_table(rows, result))
    write_results(
        result,
        Path(args.out),
        None,
        torch_threads=args.threads,
    )


if __name__ == "__main__":
    main()
