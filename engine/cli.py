"""The ``baton`` command line: ``baton generate``, ``baton serve`` and ``baton bench NAME``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from baton.engine.server.serve import add_serve_parser


def _generate(args: argparse.Namespace) -> int:
    from baton.engine.llm import LLM
    from baton.engine.sampling_params import SamplingParams

    # None lets the engine decide (on unless an option rules it out).
    async_scheduling = False if args.no_async_scheduling else None
    llm = LLM(args.model, max_model_len=args.max_model_len, async_scheduling=async_scheduling)
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
        )
        if args.raw:
            out = llm.generate([args.prompt], params, use_tqdm=False)[0]
        else:
            out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)[0]
    finally:
        llm.shutdown()
    print(out.outputs[0].text)
    return 0


# `baton bench NAME ...` runs `baton.bench.NAME.main(argv)`.
BENCHMARKS = {
    "engine": "async vs sync scheduling, free vs JSON requests",
    "grammar": "compile and mask times of the grammar backends on schema files (MaskBench)",
    "forward": "baton's forward pass vs transformers' on the same weights",
    "throughput": "offline throughput, baton vs transformers batched generate",
    "structured": "structured vs free time per output token",
}


def _bench(args: argparse.Namespace) -> int:
    import importlib

    # Imported here: nothing in the product imports bench at module level.
    module = importlib.import_module(f"baton.bench.{args.benchmark}")
    return module.main(list(args.passthrough))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="baton", description="baton: structured-output LLM engine"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="answer one prompt with the model and print the text")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None, help="GGUF file or HF folder (default: SmolLM2-135M)")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--max-model-len", type=int, default=2048)
    gen.add_argument("--raw", action="store_true", help="no chat template: complete the text as is")
    gen.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="run each step to completion instead of planning the next one while the model runs",
    )
    gen.set_defaults(func=_generate)

    add_serve_parser(sub)

    bench = sub.add_parser("bench", help="run a benchmark")
    bench_sub = bench.add_subparsers(dest="benchmark", required=True)
    # No -h here: every argument, --help included, belongs to the benchmark's own parser.
    for name, help_text in BENCHMARKS.items():
        bench_sub.add_parser(
            name, add_help=False, help=f"{help_text} (see baton bench {name} --help)"
        ).set_defaults(func=_bench, passes_unknown_args=True)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``baton`` console script; returns the exit status."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "passes_unknown_args", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.passthrough = unknown
    try:
        return args.func(args)
    except ValueError as exc:  # bad input: one clear line, no traceback
        print(f"baton: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
