"""A burst of distinct JSON schemas at once: how many requests fail, and how long it takes.

Every shared schema (SchemaStore and the JSON-Schema test suite, maskbench files) that the
engine accepts at submission is sent in one ``LLM.generate`` call on a tiny random-weight
model, each schema once, the way a user sending a batch of schemas would. Reported: schemas,
accepted, finishes by reason, "error" finishes by cause, wall time, and the compile
service's statistics when the engine has them. ``--hog N`` runs N busy-looping processes
beside the burst (the loaded-machine case); they are stopped by pid afterwards.

    python -m baton.bench.grammars.compile_burst [--label NAME] [--hog N] [--out PATH]

Each run is kept in the JSON file under its label (a later run of the same label replaces
it), so the file holds e.g. a "before" and an "after" run side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from baton.bench.common import add_common_args, run_info, write_results
from baton.bench.grammars.grammar import default_data_dir
from baton.bench.offline.engine import TinyModelShape, tiny_checkpoint
from baton.bench.plotting import pyplot
from baton.engine import LLM, SamplingParams, StructuredOutputsParams
from baton.engine.loader import load_tokenizer

SUBSETS = ("schemastore", "json-schema-test-suite")


def load_schemas(root: Path) -> list[tuple[str, Any]]:
    """(name, schema) of every maskbench file in the shared subsets, sorted by path."""
    out = []
    for sub in SUBSETS:
        for path in sorted((root / sub).glob("*.json")):
            out.append((f"{sub}/{path.name}", json.loads(path.read_text())["schema"]))
    return out


def _cause(error: str | None) -> str:
    text = (error or "").lower()
    if "timed out" in text or "time limit" in text:
        return "time-out"
    if "killed" in text or "worker" in text:
        return "worker"
    return "compile error" if "compil" in text else "other"


def run_burst(
    data: Path, max_tokens: int, compile_timeout_s: float, model: str | None = None
) -> dict[str, Any]:
    """Sends every accepted shared schema at once; returns the counts and the wall time.

    The model is a tiny random-weight Llama over ``model``'s tokenizer (default model's)."""
    schemas = load_schemas(data)
    if not schemas:
        raise SystemExit(f"no schema files under {data}/{{{','.join(SUBSETS)}}}")
    ckpt = tiny_checkpoint(load_tokenizer(model), TinyModelShape())
    llm = LLM.from_checkpoint(
        ckpt,
        max_model_len=1024,
        max_num_seqs=128,
        grammar_dynamic_compilation=True,
        grammar_compile_timeout_s=compile_timeout_s,
    )
    try:
        params, names = [], []
        refused = 0
        for name, schema in schemas:
            sp = SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0,
                seed=0,
                structured_outputs=StructuredOutputsParams(json=schema),
            )
            try:
                llm.engine.validate_params(sp)
            except ValueError:
                refused += 1
                continue
            params.append(sp)
            names.append(name)
        t0 = time.perf_counter()
        outs = llm.generate([[1, 2, 3]] * len(params), params, use_tqdm=False)
        wall = time.perf_counter() - t0
        stats = llm.stats()
    finally:
        llm.shutdown()
    finishes = Counter(o.outputs[0].finish_reason for o in outs)
    failed = [(n, o.outputs[0].error) for n, o in zip(names, outs, strict=True)]
    failed = [(n, e) for n, e in failed if e is not None]
    causes = Counter(_cause(e) for _, e in failed)
    return {
        "schemas": len(schemas),
        "refused_at_submission": refused,
        "accepted": len(params),
        "finishes": dict(sorted(finishes.items())),
        "errors": finishes.get("error", 0),
        "error_causes": dict(sorted(causes.items())),
        "errors_listed": [{"schema": n, "error": e} for n, e in failed[:20]],
        "wall_s": round(wall, 2),
        "compile_stats": {
            k: v for k, v in stats.items() if k.startswith("grammar_") and "_le_" not in k
        },
    }


def _load_avg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def main(argv: list[str] | None = None) -> int:
    """Runs one burst (with ``--hog`` busy processes beside it), prints it and stores it
    under ``--label`` in ``--out`` (JSON; the PNG goes beside). Exits 2 on a bad argument."""
    p = argparse.ArgumentParser(
        prog="baton bench compile_burst", description=__doc__.splitlines()[0]
    )
    p.add_argument(
        "--data", type=Path, default=None, help="default: $BATON_DATA_DIR or ../shared/data"
    )
    p.add_argument("--label", default="current", help="the run's name in the JSON file")
    p.add_argument("--hog", type=int, default=0, help="busy-looping processes beside the burst")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--compile-timeout", type=float, default=10.0, help="seconds (engine default)")
    add_common_args(p, "compile_burst", dtype=None)
    a = p.parse_args(argv)
    if a.hog < 0 or a.max_tokens < 1 or a.compile_timeout <= 0:
        p.error("--hog must be >= 0, --max-tokens >= 1 and --compile-timeout > 0")
    data = a.data or default_data_dir()
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.hog)]
    load_before = _load_avg()
    try:
        run = run_burst(data, a.max_tokens, a.compile_timeout, a.model)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    run.update(
        label=a.label,
        run=run_info(),
        hog_processes=a.hog,
        load_avg_before=load_before,
        load_avg_after=_load_avg(),
        max_tokens=a.max_tokens,
        compile_timeout_s=a.compile_timeout,
    )
    print(json.dumps({k: v for k, v in run.items() if k != "errors_listed"}, indent=2))
    previous = json.loads(a.out.read_text()) if a.out.exists() else {"runs": []}
    runs = [r for r in previous.get("runs", []) if r.get("label") != a.label] + [run]
    write_results({"benchmark": "compile_burst", "runs": runs}, a.out, _plot)
    return 0


def _plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    runs = result["runs"]
    labels = [f"{r['label']}\n{r['run']['commit'][:10]}\nhog {r['hog_processes']}" for r in runs]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(5 + 1.5 * len(runs), 4))
    x = range(len(runs))
    ax1.bar(x, [r["accepted"] for r in runs], color="lightgray", label="accepted")
    ax1.bar(x, [r["errors"] for r in runs], color="tab:red", label='"error" finishes')
    ax1.set_xticks(list(x), labels, fontsize=8)
    ax1.set_ylabel("requests")
    ax1.set_title("burst of distinct schemas: failed requests")
    ax1.legend()
    ax2.bar(x, [r["wall_s"] for r in runs], color="tab:blue")
    ax2.set_xticks(list(x), labels, fontsize=8)
    ax2.set_ylabel("seconds")
    ax2.set_title("wall time of the burst")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
