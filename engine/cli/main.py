"""The ``baton`` command line: ``baton generate``, ``baton serve``, and the commands other
distributions add (``baton bench NAME`` from baton-bench)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from functools import partial
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path

from baton.engine.entrypoints.args import add_engine_args, config_from_args
from baton.engine.server.serve import add_serve_parser


def _generate(args: argparse.Namespace) -> int:
    from baton.engine.entrypoints.llm import LLM

    structured = _structured_outputs(args)
    llm = LLM.from_config(config_from_args(args))
    try:
        # Options left out come from the model's generation config; temperature falls back
        # to greedy when the model ships none.
        given = {name: getattr(args, name) for name in SAMPLING_OPTIONS}
        fields = {k: v for k, v in given.items() if v is not None}
        if "temperature" not in llm.engine.sampling_defaults:
            fields.setdefault("temperature", 0.0)
        params = llm.engine.default_sampling_params(
            max_tokens=args.max_tokens, structured_outputs=structured, **fields
        )
        prompt: str | list[int] = args.prompt
        if not args.raw:
            messages = [{"role": "user", "content": args.prompt}]
            prompt = list(llm.get_tokenizer().apply_chat_template(messages, tokenize=True))
        if args.stream:
            _stream(llm, prompt, params)
        else:
            print(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text)
    finally:
        llm.shutdown()
    return 0


SAMPLING_OPTIONS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed")


def _stream(llm: object, prompt: str | list[int], params: object) -> None:
    """Prints the text as it is generated."""
    engine = llm.engine  # type: ignore[attr-defined]
    engine.add_request("cli", prompt, params)
    shown = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text
            print(text[shown:], end="", flush=True)
            shown = len(text)
    print()


def _structured_outputs(args: argparse.Namespace) -> object | None:
    """The constraint asked for on the command line, if any.

    Raises:
        ValueError: an unreadable schema file or schema text that is not JSON.
    """
    from baton.grammar.spec import StructuredOutputsParams

    if args.json_schema is not None:
        text = args.json_schema
        if not text.lstrip().startswith("{"):
            try:
                text = Path(text).read_text()
            except OSError as exc:
                message = f"--json-schema: cannot read {args.json_schema!r}: {exc}"
                raise ValueError(message) from None
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--json-schema: not valid JSON: {exc}") from None
        return StructuredOutputsParams(json=schema)
    if args.regex is not None:
        return StructuredOutputsParams(regex=args.regex)
    if args.choice is not None:
        choices = [c for c in args.choice.split(",") if c]
        if not choices:
            raise ValueError("--choice needs at least one non-empty choice, comma-separated")
        return StructuredOutputsParams(choice=choices)
    return None


# Commands that other distributions add to `baton`: each registers `NAME = module:function` in
# this entry point group, and the function, given `baton`'s subparsers, adds the subcommand `NAME`.
# Its parser's defaults name `func(args) -> int`; `passes_unknown_args=True` hands the arguments
# the parser does not know over as `args.passthrough`. engine/ never imports one by name.
PLUGIN_GROUP = "baton.cli_plugins"
# The ones this checkout ships beside baton, and how to install each when it is missing.
OPTIONAL_COMMANDS = {
    "bench": "the benchmarks are the baton-bench distribution: pip install -e ./bench "
    "(or make setup)",
}


def cli_plugins() -> dict[str, EntryPoint]:
    """The installed distributions' subcommands (entry point group ``baton.cli_plugins``)."""
    return {ep.name: ep for ep in entry_points(group=PLUGIN_GROUP)}


def _add_plugins(sub: argparse._SubParsersAction) -> None:
    """Adds every installed plugin's subcommand, and a stand-in for each missing one that
    says how to install it (a one-line error, exit status 2). A plugin that fails to load
    gets a stand-in that names the failure: the other commands keep working."""
    plugins = cli_plugins()
    for name in sorted(plugins):
        try:
            plugins[name].load()(sub)
        except Exception as exc:  # noqa: BLE001 - another package's bug, reported when used
            why = f"its plugin {plugins[name].value} failed to load: {type(exc).__name__}: {exc}"
            stand_in = sub.add_parser(name, add_help=False, help=f"broken: {why}")
            stand_in.set_defaults(func=partial(_missing, name, why), passes_unknown_args=True)
    for name, hint in OPTIONAL_COMMANDS.items():
        if name not in plugins:
            stand_in = sub.add_parser(name, add_help=False, help=f"not installed: {hint}")
            stand_in.set_defaults(func=partial(_missing, name, hint), passes_unknown_args=True)


def _missing(name: str, hint: str, args: argparse.Namespace) -> int:
    """Raises ValueError, which ``main`` prints as one line with exit status 2."""
    if hint.startswith("its plugin "):
        raise ValueError(f"`baton {name}` cannot run: {hint}")
    raise ValueError(f"`baton {name}` is not installed: {hint}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="baton", description="baton: structured-output LLM engine"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="answer one prompt with the model and print the text")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="default: the model's generation config, else 0 (greedy)",
    )
    gen.add_argument("--top-p", type=float, default=None, help="default: the model's, else 1")
    gen.add_argument("--top-k", type=int, default=None, help="default: the model's, else off")
    gen.add_argument("--min-p", type=float, default=None, help="default: the model's, else off")
    gen.add_argument(
        "--repetition-penalty", type=float, default=None, help="default: the model's, else 1"
    )
    gen.add_argument("--seed", type=int, default=None)
    add_engine_args(gen, max_model_len=2048)
    gen.add_argument("--raw", action="store_true", help="no chat template: complete the text as is")
    gen.add_argument("--stream", action="store_true", help="print the text as it is generated")
    constraint = gen.add_mutually_exclusive_group()
    constraint.add_argument(
        "--json-schema", metavar="FILE", help="a JSON schema file (or inline JSON) to follow"
    )
    constraint.add_argument("--regex", metavar="R", help="a regular expression the output matches")
    constraint.add_argument("--choice", metavar="A,B", help="the output is one of these strings")
    gen.set_defaults(func=_generate)

    add_serve_parser(sub)

    _add_plugins(sub)
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
