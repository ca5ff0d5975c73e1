"""``baton bench NAME ...``: the benchmarks' subcommand of the ``baton`` command line.

baton-bench registers :func:`register` in the ``baton.cli_plugins`` entry point group
(bench/pyproject.toml), so the engine's command line offers ``bench`` without importing this
package by name. Only argparse here: building ``baton``'s parser loads this module.
"""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Benchmark:
    """Where a benchmark lives and what it measures."""

    family: str  # its folder of bench/ (the subpackage of baton.bench)
    help: str


# `baton bench NAME ...` runs `main(argv)` of `baton.bench.FAMILY.NAME` (module_of): the family
# folder each benchmark lives in, and its one line of help.
BENCHMARKS: dict[str, Benchmark] = {
    "engine": Benchmark("offline", "async vs sync scheduling, free vs JSON requests"),
    "grammar": Benchmark(
        "grammars", "compile and mask times of the grammar backends on schema files (MaskBench)"
    ),
    "masks": Benchmark(
        "grammars", "mask fill time per row per schema feature family, every grammar backend"
    ),
    "forward": Benchmark("offline", "baton's forward pass vs transformers' on the same weights"),
    "linear_kernels": Benchmark(
        "compute", "the model's linear layers as float32, bfloat16 and int8 by rows"
    ),
    "quant_linear": Benchmark(
        "compute", "GGUF block-quantised linears (baton's kernel) vs the dense paths, by rows"
    ),
    "gguf_decode": Benchmark(
        "compute", "quantization none / gguf / int8 on a GGUF model: start, decode tok/s, RSS"
    ),
    "throughput": Benchmark(
        "offline", "offline throughput, baton vs transformers batched generate"
    ),
    "structured": Benchmark("offline", "structured vs free time per output token"),
    "serve": Benchmark("serving", "load test of baton serve: concurrent clients, TTFT and TPOT"),
    "peers": Benchmark("offline", "the same JSON-schema workload on baton and its peers"),
    "serve_peers": Benchmark(
        "llama_server", "baton serve vs llama.cpp's llama-server over HTTP on the same GGUF"
    ),
    "soak": Benchmark(
        "serving", "reliability soak of baton serve: mixed, invalid and disconnecting clients"
    ),
    "tensor_parallel": Benchmark(
        "offline", "tensor parallel vs one worker: decode step time, collective share"
    ),
    "compile_burst": Benchmark(
        "grammars", "every shared schema at once: failed requests and wall time of the burst"
    ),
    "spec": Benchmark(
        "offline", "speculative decoding off / grammar / ngram / auto on JSON workloads"
    ),
    "data_parallel": Benchmark(
        "offline", "replicas on Ray vs one engine; grammar affinity and the compile cache"
    ),
    "open_objects": Benchmark(
        "grammars", "xgrammar (objects closed) vs guidance (open): the model's outputs"
    ),
    "moe_decode": Benchmark(
        "compute", "mixture-of-experts decode step vs dense models of the same active / total size"
    ),
    "invariance": Benchmark(
        "offline", "same request alone and under other loads and settings: identical tokens?"
    ),
    "invariance_cost": Benchmark(
        "offline", "free and JSON tok/s of batch invariance against a base commit"
    ),
}


def module_of(name: str) -> str:
    """The dotted module that ``baton bench NAME`` runs. Raises KeyError for a name that
    :data:`BENCHMARKS` lacks (the parser has refused it before, listing the choices)."""
    return f"baton.bench.{BENCHMARKS[name].family}.{name}"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Adds ``bench`` and one subcommand per benchmark to ``baton``'s subparsers.

    Each benchmark's arguments, ``--help`` included, pass through to its own parser: the
    subcommand sets ``passes_unknown_args`` and the engine's CLI hands them over as
    ``args.passthrough``.
    """
    bench = subparsers.add_parser("bench", help="run a benchmark")
    bench_sub = bench.add_subparsers(dest="benchmark", required=True)
    # No -h here: every argument, --help included, belongs to the benchmark's own parser.
    for name, bench_info in BENCHMARKS.items():
        bench_sub.add_parser(
            name, add_help=False, help=f"{bench_info.help} (see baton bench {name} --help)"
        ).set_defaults(func=_run, passes_unknown_args=True)


def _run(args: argparse.Namespace) -> int:
    # Imported here: `baton generate` builds the same parser and needs no benchmark.
    module = importlib.import_module(module_of(args.benchmark))
    return module.main(list(args.passthrough))
