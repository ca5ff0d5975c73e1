"""The ``baton`` command line: ``baton generate`` (more subcommands come later)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _generate(args: argparse.Namespace) -> int:
    from baton.engine.llm import LLM
    from baton.engine.sampling_params import SamplingParams

    llm = LLM(args.model, max_model_len=args.max_model_len)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
    )
    if args.raw:
        out = llm.generate([args.prompt], params, use_tqdm=False)[0]
    else:
        out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)[0]
    print(out.outputs[0].text)
    return 0


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
    gen.set_defaults(func=_generate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``baton`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:  # bad input: one clear line, no traceback
        print(f"baton: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
