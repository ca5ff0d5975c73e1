"""What batch invariance costs: this tree against a base commit, side by side in one run.

The same-answer issue's cost goal: free and JSON tokens/s at concurrency 1 and 16 on the
peers workload (``bench/offline/peers.py``'s prompts and schema, greedy, the default model as the
engine loads it by default) must stay at or above 0.95x of the base, in each dtype. Three
sides are measured, each in its own Python process so that they share nothing:

  base          the engine at ``--base``
  invariant     the engine at ``--new`` as it runs by default (``batch_invariant=True``)
  not invariant the same with ``batch_invariant=False``

Both commits run from detached git worktrees, imported ahead of the installed tree through
``PYTHONPATH``, so that what is measured is committed code whatever the checkout holds
meanwhile.

Each round runs every side once per dtype, in an order that alternates from round to round
(step times drift by 10-15% within minutes on a shared 2-core VM); a cell's figure is the
median over ``--rounds``. A side's process loads the model, warms up, then for each
concurrency N runs N requests at once (N=1: ``--requests-at-1`` of them one after another)
free (EOS ignored, ``--max-tokens`` each) and constrained to the schema (every stopped output
validated), and reports output tokens / wall seconds; then prefills a ``--prefill-tokens``
prompt of random token ids (one output token, median of three) and reports prompt tokens /
second as cell "prefill N" (long prompts are where token-order attention costs most).
Writes JSON and a PNG.

    baton bench invariance_cost --base REF [--new HEAD] [--dtypes bfloat16,float32] [--rounds 3]
        [--concurrency 1,16] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

SIDES = ("base", "invariant", "not invariant")
GOAL = "invariant / base >= 0.95 in every free and JSON cell"
# baton's packages, as the worktree's shim folder maps them (the package-dir of pyproject.toml
# and bench/pyproject.toml).
PACKAGES = ("engine", "grammar", "sampler", "kernels", "bench")
_REPO = Path(__file__).resolve().parents[2]


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    """One side in this process: tokens/s per (mode, concurrency) for ``args.dtype``."""
    import jsonschema

    from baton.engine import LLM, SamplingParams, StructuredOutputsParams

    try:
        from baton.bench.offline.peers import SCHEMA, conversation
    except ImportError:  # a base commit from before bench/'s family folders
        from baton.bench.peers import SCHEMA, conversation  # type: ignore[no-redef]

    engine_args: dict[str, Any] = {"enable_prefix_caching": False}
    if args.not_invariant:
        engine_args["batch_invariant"] = False
    llm = LLM(dtype=args.dtype, **engine_args)
    free = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    json_params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=0.0,
        structured_outputs=StructuredOutputsParams(json=SCHEMA),
    )
    # Warm-up: the schema's grammar compiled and cached, the kernels built and loaded.
    llm.chat([conversation(99)] * 2, [free, json_params], use_tqdm=False)
    result: dict[str, Any] = {}
    for n in args.concurrency:
        batches = (
            [[conversation(i)] for i in range(args.requests_at_1)]
            if n == 1
            else [[conversation(i) for i in range(n)]]
        )
        for mode, params in (("free", free), ("json", json_params)):
            tokens, invalid, start = 0, 0, time.perf_counter()
            for batch in batches:
                for out in llm.chat(batch, params, use_tqdm=False):
                    tokens += len(out.outputs[0].token_ids)
                    if mode == "json" and out.outputs[0].finish_reason == "stop":
                        try:
                            jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
                        except (ValueError, jsonschema.ValidationError):
                            invalid += 1
            seconds = time.perf_counter() - start
            result[f"{mode} c{n}"] = {"tok_s": tokens / seconds, "invalid": invalid}
    gen = random.Random(0)
    long_prompt = {
        "prompt_token_ids": [gen.randrange(100, 40000) for _ in range(args.prefill_tokens)]
    }
    one = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([long_prompt], one, use_tqdm=False)
    seconds = []
    for _ in range(3):
        start = time.perf_counter()
        llm.generate([long_prompt], one, use_tqdm=False)
        seconds.append(time.perf_counter() - start)
    result[f"prefill {args.prefill_tokens}"] = {
        "tok_s": args.prefill_tokens / statistics.median(seconds),
        "invalid": 0,
    }
    llm.shutdown()
    import baton.engine

    result["engine_path"] = str(Path(baton.engine.__file__).parent)
    return result


@contextlib.contextmanager
def commit_tree(ref: str) -> Iterator[Path]:
    """A detached worktree of ``ref`` and a folder that maps ``baton.*`` onto it, to put
    first on ``PYTHONPATH``; both removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="baton-base-") as tmp:
        tree, shim = Path(tmp) / "tree", Path(tmp) / "shim" / "baton"
        subprocess.run(
            ["git", "-C", str(_REPO), "worktree", "add", "--detach", str(tree), ref],
            check=True,
            capture_output=True,
        )
        try:
            shim.mkdir(parents=True)
            for package in PACKAGES:
                (shim / package).symlink_to(tree / package)
            yield shim.parent
        finally:
            subprocess.run(
                ["git", "-C", str(_REPO), "worktree", "remove", "--force", str(tree)],
                check=False,
                capture_output=True,
            )


def _rev_parse(ref: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(_REPO), "rev-parse", ref], check=True, capture_output=True, text=True
    )
    return done.stdout.strip()


def _run_side(side: str, dtype: str, args: argparse.Namespace, shim: Path) -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(shim), env.get("PYTHONPATH"))))
    cmd = [sys.executable, "-P", __file__, "--side-process", "--dtype", dtype]
    cmd += ["--max-tokens", str(args.max_tokens), "--requests-at-1", str(args.requests_at_1)]
    cmd += ["--prefill-tokens", str(args.prefill_tokens)]
    cmd += ["--concurrency", ",".join(map(str, args.concurrency))]
    if side == "not invariant":
        cmd.append("--not-invariant")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the {side} side ({dtype}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(args: argparse.Namespace) -> dict[str, Any]:
    commits = {"base": _rev_parse(args.base), "new": _rev_parse(args.new)}
    with commit_tree(commits["base"]) as base_shim, commit_tree(commits["new"]) as new_shim:
        samples: dict[str, dict[str, dict[str, list[float]]]] = {}
        paths: dict[str, set[str]] = {}
        for r in range(args.rounds):
            for dtype in args.dtypes:
                order = SIDES if r % 2 == 0 else tuple(reversed(SIDES))
                for side in order:
                    shim = base_shim if side == "base" else new_shim
                    cells = _run_side(side, dtype, args, shim)
                    print(f"round {r} {dtype} {side}: {cells}", flush=True)
                    paths.setdefault(side, set()).add(cells.pop("engine_path"))
                    for cell, value in cells.items():
                        samples.setdefault(dtype, {}).setdefault(cell, {}).setdefault(
                            side, []
                        ).append(value["tok_s"])
    table = {
        dtype: {
            cell: {
                **{side: statistics.median(values) for side, values in by_side.items()},
                "invariant / base": statistics.median(by_side["invariant"])
                / statistics.median(by_side["base"]),
            }
            for cell, by_side in cells.items()
        }
        for dtype, cells in samples.items()
    }
    # The goal is the free and JSON cells' (the peers workload); prefill is reported beside.
    worst = min(
        c["invariant / base"]
        for cells in table.values()
        for name, c in cells.items()
        if not name.startswith("prefill")
    )
    return {
        "base": args.base,
        "commits": commits,
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "engine_paths": {side: sorted(p) for side, p in paths.items()},
        "samples_tok_s": samples,
        "tok_s_median": table,
        "goal": {
            GOAL: worst >= 0.95,
            "worst": worst,
        },
    }


def readme_table(result: dict[str, Any]) -> str:
    """The README's section body: tokens/s per side and the ratio, per dtype and cell."""
    from baton.bench.tables import COMPACT, markdown_table

    run, cfg = result.get("run", {}), result["config"]
    commits = result["commits"]
    head = (
        f"The default model, peers prompts and schema, {cfg['max_tokens']} tokens a request "
        f"(c1: {cfg['requests_at_1']} requests one after another; c16: 16 at once), median of "
        f"{cfg['rounds']} rounds in alternating order; base {commits['base'][:7]}, "
        f"batch-invariant {commits['new'][:7]} (not invariant: the same with "
        f"batch_invariant=False); {run.get('cpu', '?')}, "
        f"{str(run.get('date', '?'))[:10]}. Goal: invariant / base >= 0.95 in every free and "
        "JSON cell "
        f"({'met' if result['goal'][GOAL] else 'missed'}, "
        f"worst {result['goal']['worst']:.3f})."
    )
    rows = [
        [
            dtype,
            cell,
            f"{v['base']:.1f}",
            f"{v['invariant']:.1f}",
            f"{v['not invariant']:.1f}",
            f"{v['invariant / base']:.3f}",
        ]
        for dtype, cells in result["tok_s_median"].items()
        for cell, v in cells.items()
    ]
    header = ["dtype", "cell", "base tok/s", "invariant tok/s", "not invariant tok/s"]
    header.append("invariant / base")
    return head + "\n\n" + markdown_table(header, rows, COMPACT)


def plot(result: dict[str, Any], out: Path) -> None:
    from baton.bench.plotting import pyplot

    plt = pyplot()
    if plt is None:
        return
    table = result["tok_s_median"]
    fig, axes = plt.subplots(1, len(table), figsize=(6 * len(table), 4), squeeze=False)
    for ax, (dtype, cells) in zip(axes[0], table.items(), strict=True):
        names = list(cells)
        for k, side in enumerate(SIDES):
            xs = [i + (k - 1) * 0.27 for i in range(len(names))]
            ax.bar(xs, [cells[c][side] for c in names], width=0.27, label=side)
        ax.set_xticks(range(len(names)), names)
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"{dtype}: batch invariance vs {result['base']}")
        ax.legend()
    fig.suptitle(f"{result['run']['cpu']}, commit {result['run']['commit'][:10]}", fontsize=8)
    fig.tight_layout()
    fig.savefig(out)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", help="git ref of the base side (required)")
    p.add_argument("--new", default="HEAD", help="git ref of the batch-invariant side")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--requests-at-1", type=int, default=3)
    p.add_argument("--prefill-tokens", type=int, default=1000)
    p.add_argument("--out", type=Path, default=_REPO / "bench" / "results" / "invariance_cost.json")
    p.add_argument("--side-process", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dtype", help=argparse.SUPPRESS)
    p.add_argument("--not-invariant", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.concurrency = tuple(int(c) for c in args.concurrency.split(","))
    args.dtypes = tuple(args.dtypes.split(","))
    if args.side_process:
        print(json.dumps(_measure(args)))
        return 0
    if args.base is None:
        p.error("--base REF is required")
    from baton.bench.common import write_results

    result = run(args)
    write_results(result, args.out, plot)
    print(json.dumps(result["tok_s_median"], indent=1))
    print(json.dumps(result["goal"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
