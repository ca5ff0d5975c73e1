"""Structured vs free decoding cost on the same engine, in one run, on real schemas.

Two workloads, each at every ``--batches`` size, with async scheduling off (sync, the
default on this 2-core machine) and on (the model in a worker process):

* ``peers``: ``bench/offline/peers.py``'s schema (length-bounded strings, integer bounds, an array
  with item counts) and its prompts;
* ``shared``: a sample of ``--sample`` schemas from the shared data (``--data``): the
  maskbench files whose schema a default request accepts (``backend="auto"``), sorted by
  name, taken evenly spaced; request j of a batch gets schema (start + j) mod the sample, so
  a batch mixes schemas and successive rounds move through the sample. A schema whose
  warm-up request fails (a compile error or time-out) is dropped and named in the result.

Each round runs the batch constrained (greedy, at most ``--max-tokens``), then the same
prompts free (EOS ignored), each request limited to the length its constrained run produced,
then the constrained batch once more: both sides decode the same tokens per request, so the
batch shrinks alike and the comparison is like for like, and the structured TPOT is the mean
of the runs before and after the free one (on this machine step times drift by 10-15%
within minutes; with the structured run always first, that drift read as a structured cost).
TPOT is the mean time per output token after the first, per request; the ratio structured /
free is the median over ``--rounds`` of each round's means. Every
constrained output that stops must parse and validate against its schema (``jsonschema``
with format checks); failures are counted. Prefix caching is off (the free run repeats the
constrained run's prompts). Speculative drafts stay off (``structured_drafts=False``): this
measures the constraint's own cost per token. Goal: structured / free <= 1.05 at every batch
size, per workload and mode. Writes JSON and a PNG.

    baton bench structured [--batches 1,8,32] [--max-tokens 64] [--rounds 3] [--sample 16]
        [--modes sync,async] [--workloads peers,shared] [--worker-threads N]
        [--out bench/results/structured.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema

from baton.bench import common
from baton.bench.grammars.grammar import default_data_dir, load_cases
from baton.bench.offline import peers
from baton.bench.plotting import pyplot
from baton.engine import LLM, SamplingParams, StructuredOutputsParams
from baton.engine.loader import Checkpoint, load_checkpoint

GOAL_RATIO = 1.05
WORKLOADS = ("peers", "shared")
MODES = {"sync": False, "async": True}
WARMUP_TOKENS = 4
COMPILE_TIMEOUT_S = 300.0  # the sample's largest schemas compile eagerly in tens of seconds


@dataclass(frozen=True)
class StructuredConfig:
    """What one run measures; raises ``ValueError`` naming a bad field.

    Attributes:
        batches: requests submitted at once, one measured case each.
        max_tokens: most output tokens of a constrained request.
        rounds: structured + free pairs per case; the ratio uses their medians.
        sample: schemas of the ``shared`` workload.
        modes: "sync" and/or "async" scheduling.
        workloads: "peers" and/or "shared".
        data: the shared schema data (maskbench files).
        model: GGUF file or Hugging Face folder (None: the default model).
        dtype: "float32" or "bfloat16".
        worker_threads: torch threads of the async mode's model worker process (None: the
            engine's default, every core on a 2-core machine and one left to the engine
            thread above that).
    """

    batches: tuple[int, ...] = (1, 8, 32)
    max_tokens: int = 64
    rounds: int = 3
    sample: int = 16
    modes: tuple[str, ...] = ("sync", "async")
    workloads: tuple[str, ...] = WORKLOADS
    data: Path | None = None
    model: str | None = None
    dtype: str = "float32"
    worker_threads: int | None = None

    def __post_init__(self) -> None:
        if not self.batches or any(not isinstance(b, int) or b < 1 for b in self.batches):
            raise ValueError(f"batches must be positive ints, got {self.batches!r}")
        common.require_positive_ints(self, "max_tokens", "rounds", "sample")
        if self.worker_threads is not None:
            common.require_positive_ints(self, "worker_threads")
        if not self.modes or any(m not in MODES for m in self.modes):
            raise ValueError(f"modes must be some of {', '.join(MODES)}, got {self.modes!r}")
        if not self.workloads or any(w not in WORKLOADS for w in self.workloads):
            raise ValueError(
                f"workloads must be some of {', '.join(WORKLOADS)}, got {self.workloads!r}"
            )


@dataclass(frozen=True)
class Workload:
    """Named schemas and a prompt per request index."""

    name: str
    schemas: tuple[tuple[str, dict[str, Any]], ...]

    def request(self, index: int) -> tuple[str, dict[str, Any], list[dict[str, str]]]:
        """(schema name, schema, chat prompt) of request ``index``."""
        name, schema = self.schemas[index % len(self.schemas)]
        if self.name == "peers":
            return name, schema, peers.conversation(index)
        title = schema.get("title") if isinstance(schema.get("title"), str) else None
        label = title or Path(name).stem
        content = f"Write an example JSON document (#{index}) for the schema '{label}'."
        return name, schema, [{"role": "user", "content": content}]


def shared_sample(llm: LLM, data: Path, size: int) -> list[tuple[str, dict[str, Any]]]:
    """``size`` evenly spaced schemas (by file name) among those a default request accepts."""
    accepted = []
    for case in sorted(load_cases([data]), key=lambda c: c.id):
        if not isinstance(case.schema, dict):
            continue
        spec = StructuredOutputsParams(json=case.schema)
        try:
            llm.engine.validate_params(SamplingParams(structured_outputs=spec))
        except ValueError:
            continue
        accepted.append((case.id, case.schema))
    if not accepted:
        raise ValueError(f"no schema in {data} is accepted by a default request")
    step = len(accepted) / min(size, len(accepted))
    return [accepted[int(i * step)] for i in range(min(size, len(accepted)))]


def _validator(schema: dict[str, Any]) -> Any:
    cls = jsonschema.validators.validator_for(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def _structured_params(schema: dict[str, Any], max_tokens: int) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        structured_outputs=StructuredOutputsParams(json=schema),
    )


def warm_up(llm: LLM, workload: Workload) -> tuple[Workload, list[dict[str, str]]]:
    """Compiles every schema of ``workload`` (one short request each); returns the workload
    without the schemas whose request failed, and those failures."""
    prompts, params = [], []
    for i in range(len(workload.schemas)):
        _, schema, prompt = workload.request(i)
        prompts.append(prompt)
        params.append(_structured_params(schema, WARMUP_TOKENS))
    outs = llm.chat(prompts, params, use_tqdm=False)
    kept, dropped = [], []
    for (name, schema), out in zip(workload.schemas, outs, strict=True):
        c = out.outputs[0]
        if c.finish_reason == "error":
            dropped.append({"schema": name, "error": c.error or "error"})
        else:
            kept.append((name, schema))
    if not kept:
        raise RuntimeError(f"every schema of the {workload.name} workload failed: {dropped}")
    return Workload(workload.name, tuple(kept)), dropped


def _tpot_ms(outs: Sequence[Any]) -> float:
    values = [o.metrics.time_per_output_token for o in outs]
    values = [v for v in values if v is not None]
    return statistics.fmean(values) * 1e3 if values else float("nan")


def run_round(
    llm: LLM, workload: Workload, batch: int, start: int, max_tokens: int
) -> dict[str, Any]:
    """One structured run of ``batch`` requests, then the same prompts free at the lengths the
    structured run produced, then the structured run again: its TPOT is the mean of the two,
    so a drift of the machine's speed during the round counts alike on both sides."""
    requests = [workload.request(start + j) for j in range(batch)]
    prompts = [r[2] for r in requests]
    params = [_structured_params(r[1], max_tokens) for r in requests]
    before = llm.stats()
    outs = llm.chat(prompts, params, use_tqdm=False)
    after = llm.stats()
    stopped = 0
    invalid: list[str] = []
    errors: list[str] = []
    for (name, schema, _), out in zip(requests, outs, strict=True):
        c = out.outputs[0]
        if c.finish_reason == "error":
            errors.append(f"{name}: {c.error}")
        elif c.finish_reason == "stop":
            stopped += 1
            try:
                valid = _validator(schema).is_valid(json.loads(c.text))
            except json.JSONDecodeError:
                valid = False
            if not valid:
                invalid.append(name)
    lengths = [max(2, len(o.outputs[0].token_ids)) for o in outs]
    free = llm.chat(
        prompts,
        [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths],
        use_tqdm=False,
    )
    again = llm.chat(prompts, params, use_tqdm=False)
    steps = after["steps"] - before["steps"]
    return {
        "structured_tpot_ms": (_tpot_ms(outs) + _tpot_ms(again)) / 2,
        "free_tpot_ms": _tpot_ms(free),
        # Greedy: the repeat decodes the same tokens, unless batch numerics differ.
        "repeat_same": sum(
            a.outputs[0].token_ids == b.outputs[0].token_ids
            for a, b in zip(outs, again, strict=True)
        ),
        "tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        "free_tokens": sum(len(o.outputs[0].token_ids) for o in free),
        "steps": steps,
        "bitmask_ms_per_step": (after["bitmask_s"] - before["bitmask_s"]) * 1e3 / max(1, steps),
        "stopped": stopped,
        "invalid": invalid,
        "errors": errors,
    }


def build_workloads(cfg: StructuredConfig, llm: LLM) -> list[Workload]:
    """The workloads ``cfg`` names (the shared sample depends only on the data and on what
    a default request accepts, so every engine picks the same one)."""
    workloads = []
    if "peers" in cfg.workloads:
        workloads.append(Workload("peers", (("peers", peers.SCHEMA),)))
    if "shared" in cfg.workloads:
        picked = shared_sample(llm, cfg.data or default_data_dir(), cfg.sample)
        workloads.append(Workload("shared", tuple(picked)))
    return workloads


def run_mode(
    cfg: StructuredConfig, ckpt: Checkpoint, mode: str
) -> tuple[list[dict[str, Any]], list[dict[str, str]], list[Workload]]:
    """Every workload and batch size on one engine (``mode`` scheduling); returns the rows,
    the schemas dropped at warm-up and the workloads as built."""
    llm = LLM.from_checkpoint(
        ckpt,
        dtype=cfg.dtype,
        async_scheduling=MODES[mode],
        max_num_seqs=max(cfg.batches),
        max_model_len=1024,
        enable_prefix_caching=False,
        grammar_compile_timeout_s=COMPILE_TIMEOUT_S,
        worker_threads=cfg.worker_threads,
        # The constraint's own cost per token: speculative drafts (on by default for
        # structured requests in sync mode) would make structured steps yield more tokens.
        structured_drafts=False,
    )
    rows, dropped_all = [], []
    try:
        workloads = build_workloads(cfg, llm)
        for workload in workloads:
            workload, dropped = warm_up(llm, workload)
            dropped_all += [{"mode": mode, "workload": workload.name, **d} for d in dropped]
            start = 0
            for batch in cfg.batches:
                rounds = []
                for _ in range(cfg.rounds):
                    rounds.append(run_round(llm, workload, batch, start, cfg.max_tokens))
                    start += batch
                s = statistics.median(r["structured_tpot_ms"] for r in rounds)
                f = statistics.median(r["free_tpot_ms"] for r in rounds)
                row = {
                    "workload": workload.name,
                    "mode": mode,
                    "batch": batch,
                    "rounds": len(rounds),
                    "free_tpot_ms": f,
                    "structured_tpot_ms": s,
                    "ratio": s / f,
                    "bitmask_ms_per_step": statistics.median(
                        r["bitmask_ms_per_step"] for r in rounds
                    ),
                    "structured_tokens": sum(r["tokens"] for r in rounds),
                    "free_tokens": sum(r["free_tokens"] for r in rounds),
                    "stopped": sum(r["stopped"] for r in rounds),
                    "invalid": [name for r in rounds for name in r["invalid"]],
                    "errors": [text for r in rounds for text in r["errors"]],
                    "requests": batch * len(rounds),
                    "repeat_same": sum(r["repeat_same"] for r in rounds),
                }
                rows.append(row)
                print(
                    f"{workload.name:>6} {mode:>5} batch {batch:>3}: free {f:7.2f} ms  "
                    f"structured {s:7.2f} ms  ratio {s / f:5.2f}  bitmask "
                    f"{row['bitmask_ms_per_step']:.2f} ms/step  stopped {row['stopped']}/"
                    f"{row['requests']} invalid {len(row['invalid'])} errors {len(row['errors'])}",
                    flush=True,
                )
    finally:
        llm.shutdown()
    return rows, dropped_all, workloads


def evaluate_goals(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One goal per workload and mode: the worst ratio over its batch sizes."""
    goals = []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        for mode in dict.fromkeys(r["mode"] for r in rows):
            mine = [r for r in rows if r["workload"] == workload and r["mode"] == mode]
            if not mine:
                continue
            worst = max(mine, key=lambda r: r["ratio"])
            batches = "/".join(str(r["batch"]) for r in mine)
            goals.append(
                {
                    "goal": f"structured / free TPOT, {workload} schemas, {mode}, batch "
                    f"{batches} (worst: batch {worst['batch']})",
                    "target": f"<= {GOAL_RATIO:g}",
                    "value": worst["ratio"],
                    "met": worst["ratio"] <= GOAL_RATIO,
                }
            )
    return goals


def run(cfg: StructuredConfig) -> dict[str, Any]:
    """Runs every mode; returns the result (config, rows, goals, dropped schemas)."""
    load_avg = list(os.getloadavg())  # before the run, not what the run adds
    ckpt = load_checkpoint(cfg.model)
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    dropped: list[dict[str, str]] = []
    sample: list[str] = []
    for mode in cfg.modes:
        mode_rows, mode_dropped, workloads = run_mode(cfg, ckpt, mode)
        rows += mode_rows
        dropped += mode_dropped
        sample = [name for w in workloads if w.name == "shared" for name, _ in w.schemas]
    return {
        "config": {
            "model": str(ckpt.path),
            "batches": list(cfg.batches),
            "max_tokens": cfg.max_tokens,
            "rounds": cfg.rounds,
            "modes": list(cfg.modes),
            "workloads": list(cfg.workloads),
            "sample": sample,
            "dtype": cfg.dtype,
            "worker_threads": cfg.worker_threads,
            "load_avg": load_avg,
            "wall_s": time.perf_counter() - t0,
        },
        "rows": rows,
        "dropped": dropped,
        "goals": evaluate_goals(rows),
    }


def _plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    rows = result["rows"]
    groups = list(dict.fromkeys((r["workload"], r["mode"]) for r in rows))
    fig, ax = plt.subplots(figsize=(8, 3.6))
    width = 0.8 / max(1, len(groups))
    batches = list(dict.fromkeys(r["batch"] for r in rows))
    for k, (workload, mode) in enumerate(groups):
        xs, ys = [], []
        for i, batch in enumerate(batches):
            for r in rows:
                if (r["workload"], r["mode"], r["batch"]) == (workload, mode, batch):
                    xs.append(i + (k - (len(groups) - 1) / 2) * width)
                    ys.append(r["ratio"])
        ax.bar(xs, ys, width, label=f"{workload}, {mode}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(GOAL_RATIO, color="red", linestyle="--", label=f"goal {GOAL_RATIO:g}")
    ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
    ax.set_ylabel("structured / free TPOT")
    low = min([r["ratio"] for r in rows] + [0.9])
    ax.set_ylim(max(0.0, low - 0.05), max([r["ratio"] for r in rows] + [GOAL_RATIO]) + 0.05)
    ax.legend(fontsize=8)
    ax.set_title("Structured vs free TPOT, same engine, same run")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def main(argv: list[str] | None = None) -> int:
    """Runs ``baton bench structured``; exits through argparse on a bad argument."""
    p = argparse.ArgumentParser(prog="baton bench structured", description=__doc__.splitlines()[0])
    common.add_common_args(p, "structured")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sample", type=int, default=16, help="schemas of the shared workload")
    p.add_argument("--modes", default="sync,async", help="sync and/or async")
    p.add_argument("--workloads", default="peers,shared", help="peers and/or shared")
    p.add_argument("--data", type=Path, default=None, help="default: ../shared/data")
    p.add_argument(
        "--worker-threads",
        type=int,
        default=None,
        help="torch threads of the async mode's model worker process (default: the engine's, "
        "every core on a 2-core machine, one left to the engine thread above that); 1 keeps a "
        "smoke run from stalling beside other busy processes",
    )
    a = p.parse_args(argv)
    cfg = common.config_from_args(
        p,
        a,
        StructuredConfig,
        batches=tuple(int(b) for b in _names(a.batches)),
        modes=_names(a.modes),
        workloads=_names(a.workloads),
    )
    result = run(cfg)
    for g in result["goals"]:
        print(f"{'met' if g['met'] else 'MISSED'}: {g['goal']} {g['target']}: {g['value']:.3f}")
    for d in result["dropped"]:
        print(f"dropped at warm-up ({d['mode']}): {d['schema']}: {d['error']}")
    common.write_results(result, a.out, _plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
