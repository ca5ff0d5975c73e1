"""Same request, same answer? Each request alone against the same request under other loads.

The probe of the same-answer issue: 16 prompts ("Write a short paragraph about X."), greedy
and seeded sampling, 64 tokens. The reference is each prompt run alone on a fresh engine; each
setting then runs all of them again and counts the requests whose tokens are identical to the
reference, and the first token where the others differ:

  batch        the 16 in one ``generate`` call
  strangers    the 16 among 16 other prompts of other lengths
  chunked      prefill in chunks of 16 tokens (``max_num_batched_tokens``)
  warm cache   the batch again on the same engine (prefixes from the prefix cache)
  async        async scheduling in the model worker process (``executor="mp"``)
  ngram drafts n-gram speculative decoding (``speculative_config``)
  1 thread     one torch thread
  grammar drafts  with ``--json`` only: grammar-forced drafts (``structured_drafts``)

for each dtype asked for (bfloat16 forced where the machine's default is float32), and each
``--engine-args`` variant (e.g. ``quantization=int8``). With ``--json`` every request, the
reference included, is constrained to ``bench/offline/peers.py``'s schema (grammar drafts off but in
their own setting). Writes JSON and a plot.

    baton bench invariance [--dtypes float32,bfloat16] [--max-tokens 64] [--settings a,b]
        [--json]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from baton.bench.common import RESULTS_DIR, csv_of, write_results
from baton.bench.offline.peers import SCHEMA
from baton.bench.tables import COMPACT, markdown_table, where_run
from baton.engine import LLM, SamplingParams, StructuredOutputsParams

TOPICS = (
    "the sea", "a cat", "mountains", "coffee", "rain", "trains", "chess", "music",
    "bread", "winter", "bees", "clocks", "rivers", "paper", "glass", "owls",
)  # fmt: skip
STRANGERS = (
    tuple(
        f"List {n} facts about {t}, one per line, each with a short reason." * (1 + n % 3)
        for n, t in enumerate(("volcanoes", "tea", "maps", "bridges"), 2)
    )
    * 4
)
SETTINGS = ("batch", "strangers", "chunked", "warm cache", "async", "ngram drafts", "1 thread")
JSON_SETTINGS = (*SETTINGS, "grammar drafts")


def prompts() -> list[str]:
    return [f"Write a short paragraph about {t}." for t in TOPICS]


def params(
    max_tokens: int, sampled: bool, schema: dict[str, Any] | None = None
) -> list[SamplingParams]:
    """Greedy, or temperature 0.8 with a seed per request (sampling is a pure function of
    seed, position and logits, so only the logits can make it differ); constrained to
    ``schema`` when given."""
    structured = None if schema is None else StructuredOutputsParams(json=schema)
    if not sampled:
        greedy = SamplingParams(
            max_tokens=max_tokens, temperature=0.0, structured_outputs=structured
        )
        return [greedy] * len(TOPICS)
    return [
        SamplingParams(
            max_tokens=max_tokens, temperature=0.8, seed=1000 + i, structured_outputs=structured
        )
        for i in range(len(TOPICS))
    ]


def _engine(dtype: str, extra: dict[str, Any], **kwargs: Any) -> LLM:
    args = {
        "dtype": dtype,
        "async_scheduling": False,
        "executor": "uni",
        "structured_drafts": False,
        **extra,
        **kwargs,
    }
    return LLM(**args)


def _tokens(llm: LLM, texts: Sequence[str], sps: Sequence[SamplingParams]) -> list[list[int]]:
    outs = llm.generate(list(texts), list(sps), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def run_setting(
    name: str, dtype: str, extra: dict[str, Any], sps: list[SamplingParams]
) -> list[list[int]]:
    """The 16 requests' tokens under setting ``name``."""
    texts = prompts()
    n = len(texts)
    if name == "chunked":
        llm = _engine(dtype, extra, max_num_batched_tokens=16)
    elif name == "async":
        llm = _engine(dtype, extra, async_scheduling=True, executor="mp")
    elif name == "ngram drafts":
        llm = _engine(dtype, extra, speculative_config={"method": "ngram"})
    elif name == "1 thread":
        llm = _engine(dtype, extra, worker_threads=1, executor="mp")
    elif name == "grammar drafts":
        llm = _engine(dtype, extra, structured_drafts=True)
    else:
        llm = _engine(dtype, extra)
    try:
        if name == "strangers":
            mixed = [t for pair in zip(texts, STRANGERS, strict=True) for t in pair]
            other = SamplingParams(
                max_tokens=sps[0].max_tokens,
                temperature=0.0,
                structured_outputs=sps[0].structured_outputs,
            )
            mixed_sps = [p for sp in sps for p in (sp, other)]
            return _tokens(llm, mixed, mixed_sps)[::2]
        if name == "warm cache":
            _tokens(llm, texts, sps)
        return _tokens(llm, texts, sps)[:n]
    finally:
        llm.shutdown()


def compare(reference: list[list[int]], other: list[list[int]]) -> dict[str, Any]:
    """How many requests match the reference exactly, and where the others first differ."""
    first = []
    for a, b in zip(reference, other, strict=True):
        diff = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if diff is None and len(a) != len(b):
            diff = min(len(a), len(b))
        first.append(diff)
    return {"identical": sum(d is None for d in first), "of": len(first), "first_diff": first}


def run(
    dtypes: Sequence[str],
    variants: Sequence[dict[str, Any]],
    settings: Sequence[str],
    max_tokens: int,
    schema: dict[str, Any] | None = None,
) -> dict[str, Any]:
    rows = []
    for dtype in dtypes:
        for extra in variants:
            for sampled in (False, True):
                sps = params(max_tokens, sampled, schema)
                llm = _engine(dtype, extra)
                try:
                    reference = [
                        _tokens(llm, [t], [sp])[0] for t, sp in zip(prompts(), sps, strict=True)
                    ]
                finally:
                    llm.shutdown()
                for name in settings:
                    row = {
                        "json": schema is not None,
                        "dtype": dtype,
                        "engine_args": extra,
                        "sampling": "seeded" if sampled else "greedy",
                        "setting": name,
                        **compare(reference, run_setting(name, dtype, extra, sps)),
                    }
                    print(
                        f"{dtype:9s} {json.dumps(extra):28s} {row['sampling']:6s} "
                        f"{name:13s} {row['identical']}/{row['of']} identical; first "
                        f"differences {[d for d in row['first_diff'] if d is not None]}",
                        flush=True,
                    )
                    rows.append(row)
    return {
        "max_tokens": max_tokens,
        "json": schema is not None,
        "settings": list(settings),
        "rows": rows,
    }


def readme_table(result: dict[str, Any]) -> str:
    """The README's section body: identical requests per setting, a row per dtype, engine
    arguments and sampling."""
    settings = result["settings"]
    head = (
        f"{len(TOPICS)} prompts, {result['max_tokens']} tokens each, each alone on a fresh "
        "engine against the same under each setting"
        f"{' (every request constrained to the peers schema)' if result.get('json') else ''}; "
        f"{where_run(result)}. Cells: requests with identical tokens."
    )
    groups: dict[tuple[str, str, str], dict[str, str]] = {}
    for r in result["rows"]:
        key = (r["dtype"], json.dumps(r["engine_args"]) if r["engine_args"] else "-", r["sampling"])
        groups.setdefault(key, {})[r["setting"]] = f"{r['identical']}/{r['of']}"
    rows = [
        [*map(str, key), *(cells.get(s, "") for s in settings)] for key, cells in groups.items()
    ]
    header = ["dtype", "engine args", "sampling", *settings]
    return head + "\n\n" + markdown_table(header, rows, COMPACT)


def plot(result: dict[str, Any], path: Path) -> None:
    """Identical requests per setting, one bar group per dtype / variant / sampling."""
    from baton.bench.plotting import pyplot

    plt = pyplot()
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in result["rows"]:
        key = f"{r['dtype']} {json.dumps(r['engine_args'])} {r['sampling']}"
        groups.setdefault(key, []).append(r)
    fig, ax = plt.subplots(figsize=(9, 4))
    settings = result["settings"]
    width = 0.8 / max(1, len(groups))
    for g, (key, rows) in enumerate(groups.items()):
        by = {r["setting"]: r["identical"] / r["of"] for r in rows}
        xs = [i + g * width for i in range(len(settings))]
        ax.bar(xs, [by.get(s, 0) for s in settings], width, label=key)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(settings))], settings, fontsize=8)
    ax.set_ylabel("requests identical to alone")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=7)
    run = result.get("run", {})
    ax.set_title(f"{run.get('commit', '')[:7]} on {run.get('cpu', '')}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _variant(text: str) -> dict[str, Any]:
    """``key=value,key=value`` as engine keyword arguments (values JSON where they parse)."""
    out: dict[str, Any] = {}
    for part in filter(None, text.split(",")):
        key, _, value = part.partition("=")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def main(argv: list[str] | None = None) -> int:
    """Runs the probe, prints a line per setting and writes ``--out`` and its plot."""
    p = argparse.ArgumentParser(prog="baton bench invariance", description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", type=csv_of(str), default=("float32", "bfloat16"))
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--settings", type=csv_of(str), default=None, help="default: every one")
    p.add_argument("--json", action="store_true", help="constrain every request to a schema")
    p.add_argument(
        "--engine-args",
        action="append",
        type=_variant,
        default=None,
        help="a variant's engine arguments, key=value[,key=value] (repeatable; default: none)",
    )
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "invariance.json")
    a = p.parse_args(argv)
    known = JSON_SETTINGS if a.json else SETTINGS
    settings = a.settings or known
    if unknown := set(settings) - set(known):
        p.error(f"unknown settings {sorted(unknown)}; expected some of {list(known)}")
    schema = SCHEMA if a.json else None
    result = run(a.dtypes, a.engine_args or [{}], settings, a.max_tokens, schema)
    write_results(result, a.out, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
