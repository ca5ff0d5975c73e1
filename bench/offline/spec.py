"""Speculative decoding benchmark: spec off / grammar / ngram / auto, side by side in one run.

Two greedy JSON workloads on one model, at each ``--concurrency`` N (prompts submitted N at a
time through ``LLM.generate``; at least ``--num-prompts`` prompts per concurrency):

* ``peers``: bench/offline/peers.py's workload (invent a person as JSON; its schema),
* ``extraction``: facts about a person in the prompt, a schema to fill from them (JSON
  extraction copies from its prompt, which prompt lookup drafts).

Plus free text (the peers prompts without a schema, spec off) at concurrency 1, for the
structured / free ratio. Each mode gets its own engine (same weights, same dtype, prefix
caching off), warmed up on prompts of its own; every mode runs ``--repeats`` times (default 3)
in alternating order, since this machine's speed drifts over minutes. Reports per workload,
mode and concurrency: output tok/s (the median of the runs, and each run's), output tokens
per engine step, drafts per step, acceptance rate, valid JSON
share, and whether the tokens equal spec off's (they must in float32; in bfloat16 the dense
GEMMs may compute a row differently in a step of more rows, as with drafts, so a near-tie can
go the other way). The goals of the issue are judged on the measured ratios (nothing asserted).
Then the same prompts run on the simulated accelerator (``--sim-device sim:h200 --sim-shape
llama-3.1-8b``; ``--sim-device none`` skips it), replaying the spec-off outputs measured here
as traces (``bench/sim/spec_sim.py``): what the drafts are worth at GPU speed.

    baton bench spec [--concurrency 1,16] [--num-prompts 8] [--max-tokens 96]
        [--num-speculative-tokens 5] [--modes off,grammar,ngram,auto] [--dtype auto]
        [--quantization gguf]
        [--sim-device sim:h200] [--sim-shape llama-3.1-8b] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema

from baton.bench.common import (
    add_common_args,
    config_from_args,
    csv_of,
    fmt,
    judge_goal,
    ratio,
    require_positive_ints,
    run_order,
    write_results,
)
from baton.bench.offline.peers import SCHEMA as PEERS_SCHEMA
from baton.bench.offline.peers import conversation
from baton.bench.plotting import pyplot
from baton.bench.sim.spec_sim import (
    ASYNC,
    ASYNC_OFF,
    FIXED,
    SimRun,
    measure_sim,
    spec_config,
    step_figures,
    trace_of,
)
from baton.engine import LLM, SamplingParams, StructuredOutputsParams
from baton.engine.loader import Checkpoint, load_checkpoint
from baton.engine.sim_specs import GPUS, SHAPES
from baton.engine.tokenizer import Tokenizer

DEFAULT_MODES = ("off", "grammar", "ngram", "auto")
# Each drafting method with the adaptive draft policy, and "-fixed": always every draft.
MODES = (*DEFAULT_MODES, *(f"{m}{FIXED}" for m in DEFAULT_MODES[1:]))
WORKLOADS = ("peers", "extraction")
WARMUP = 2

EXTRACTION_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "maxLength": 60},
        "city": {"type": "string", "maxLength": 30},
        "employer": {"type": "string", "maxLength": 40},
        "skills": {
            "type": "array",
            "items": {"type": "string", "maxLength": 20},
            "maxItems": 4,
        },
    },
    "required": ["name", "age", "email", "city", "employer", "skills"],
    "additionalProperties": False,
}
_FIRST = ("Maria", "John", "Aiko", "Pedro", "Fatima", "Liam", "Chen", "Olga", "Kwame", "Sofia")
_LAST = ("Lopez", "Smith", "Tanaka", "Silva", "Haddad", "Murphy", "Wei", "Ivanova", "Mensah")
_CITIES = ("Lisbon", "Chicago", "Osaka", "Recife", "Beirut", "Dublin", "Shanghai", "Kazan")
_EMPLOYERS = ("Acme Robotics", "Blue River Bank", "Northwind Foods", "Helix Labs", "Orbit Air")
_SKILLS = ("Python", "SQL", "welding", "accounting", "French", "negotiation", "Rust", "drawing")

# Goals of the issue: (name, workload, concurrency, numerator, denominator, minimum ratio).
GOALS = (
    ("auto / spec off, peers, concurrency 1", "peers", 1, "auto", "off", 1.6),
    ("auto / spec off, peers, concurrency 16", "peers", 16, "auto", "off", 1.3),
)
JSON_VS_FREE_GOAL = 1.2


def extraction_conversation(index: int) -> list[dict[str, str]]:
    """The ``index``-th extraction prompt: a short text about a person, and the fields to
    extract from it as JSON."""
    first, last = _FIRST[index % len(_FIRST)], _LAST[(index * 7) % len(_LAST)]
    city = _CITIES[(index * 3) % len(_CITIES)]
    employer = _EMPLOYERS[(index * 5) % len(_EMPLOYERS)]
    skills = [_SKILLS[(index + j) % len(_SKILLS)] for j in range(2)]
    age = 23 + (index * 11) % 40
    text = (
        f"{first} {last} is {age} years old and lives in {city}. {first} works at {employer} "
        f"and is good at {skills[0]} and {skills[1]}. Contact: "
        f"{first.lower()}.{last.lower()}@example.com."
    )
    fields = ", ".join(EXTRACTION_SCHEMA["required"])
    return [
        {
            "role": "user",
            "content": f"Extract {fields} from this text as a JSON object.\n\n{text}",
        }
    ]


@dataclass(frozen=True)
class SpecBenchConfig:
    """What ``baton bench spec`` measures (see the module docstring)."""

    model: str | None = None
    dtype: str = "auto"
    concurrency: tuple[int, ...] = (1, 16)
    num_prompts: int = 8
    max_tokens: int = 96
    num_speculative_tokens: int = 5
    modes: tuple[str, ...] = DEFAULT_MODES
    quantization: str | None = None
    workloads: tuple[str, ...] = WORKLOADS
    sim_device: str | None = "sim:h200"
    sim_shape: str = "llama-3.1-8b"
    repeats: int = 3

    def __post_init__(self) -> None:
        require_positive_ints(
            self, "num_prompts", "max_tokens", "num_speculative_tokens", "repeats"
        )
        if self.sim_device is not None and self.sim_device.removeprefix("sim:") not in GPUS:
            raise ValueError(
                f"sim_device must be none or one of {[f'sim:{g}' for g in GPUS]}, "
                f"got {self.sim_device!r}"
            )
        if self.sim_shape not in SHAPES:
            raise ValueError(f"sim_shape must be one of {list(SHAPES)}, got {self.sim_shape!r}")
        if self.sim_device is not None and "off" not in self.modes:
            raise ValueError("the simulated runs replay spec off's outputs: modes must hold off")
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise ValueError(f"concurrency must be ints >= 1, got {self.concurrency}")
        for name, allowed in (("modes", MODES), ("workloads", WORKLOADS)):
            bad = [m for m in getattr(self, name) if m not in allowed]
            if bad or not getattr(self, name):
                raise ValueError(f"{name} must be from {list(allowed)}, got {getattr(self, name)}")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"dtype must be auto, float32 or bfloat16, got {self.dtype!r}")


def _prompts(tokenizer: Tokenizer, workload: str, count: int, offset: int = 0) -> list[str]:
    make = conversation if workload in ("peers", "free") else extraction_conversation
    return [tokenizer.apply_chat_template(make(offset + i), tokenize=False) for i in range(count)]


def _schema(workload: str) -> dict[str, Any] | None:
    return {"peers": PEERS_SCHEMA, "extraction": EXTRACTION_SCHEMA}.get(workload)


def _params(workload: str, max_tokens: int) -> SamplingParams:
    schema = _schema(workload)
    so = StructuredOutputsParams(json=schema) if schema is not None else None
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_outputs=so)


def _valid(text: str, schema: dict[str, Any]) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def measure(
    llm: LLM, tokenizer: Tokenizer, workload: str, concurrency: int, cfg: SpecBenchConfig
) -> dict[str, Any]:
    """One workload at one concurrency on one engine: prompts in waves of ``concurrency``."""
    count = max(cfg.num_prompts, concurrency)
    prompts = _prompts(tokenizer, workload, count)
    sp = _params(workload, cfg.max_tokens)
    before = llm.stats()
    tokens: list[list[int]] = []
    texts: list[str] = []
    prompt_ids: list[tuple[int, ...]] = []
    finish: list[str | None] = []
    # The 1-minute load average beside each row: this machine's steps slow several-fold when
    # another process holds a core, so a row measured beside one must be visible as such.
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    for start in range(0, count, concurrency):
        outs = llm.generate(prompts[start : start + concurrency], sp, use_tqdm=False)
        tokens += [list(o.outputs[0].token_ids) for o in outs]
        texts += [o.outputs[0].text for o in outs]
        prompt_ids += [tuple(o.prompt_token_ids) for o in outs]
        finish += [o.outputs[0].finish_reason for o in outs]
    wall = time.perf_counter() - t0
    after = llm.stats()
    schema = _schema(workload)
    return {
        "workload": workload,
        "concurrency": concurrency,
        "prompts": count,
        **step_figures(before, after, sum(len(t) for t in tokens), wall),
        "valid_share": (
            sum(_valid(t, schema) for t in texts) / len(texts) if schema is not None else None
        ),
        "load_avg_1m": [load_before, os.getloadavg()[0]],
        "tokens": tokens,
        # Kept for the simulated runs' traces, dropped from the result.
        "prompt_ids": prompt_ids,
        "finish": finish,
    }


def _engine(checkpoint: Any, mode: str, cfg: SpecBenchConfig, max_model_len: int) -> LLM:
    return LLM.from_checkpoint(
        checkpoint,
        dtype=cfg.dtype,
        quantization=cfg.quantization,
        max_model_len=max_model_len,
        enable_prefix_caching=False,
        async_scheduling=False,
        speculative_config=spec_config(mode, cfg.num_speculative_tokens),
        # "off" means off: not the engine's default drafts for structured requests.
        structured_drafts=False,
    )


def _median_row(mode: str, measured: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from a mode's repeats: the first run's figures (greedy: the same tokens every
    time; the grammar drafter's learned tokenisations may save a few steps in later runs)
    with its tok/s the median of the runs, and every run's tok/s."""
    speeds = [r["tok_per_s"] for r in measured]
    row = {**measured[0], "mode": mode, "tok_per_s": statistics.median(speeds)}
    row["tok_per_s_runs"] = speeds
    row["load_avg_1m"] = [measured[0]["load_avg_1m"][0], measured[-1]["load_avg_1m"][1]]
    return row


def _mode_workloads(cfg: SpecBenchConfig, mode: str) -> list[str]:
    """Returns the workloads ``mode`` runs: every configured one, plus free text for spec off."""
    return [*cfg.workloads, *(["free"] if mode == "off" else [])]


def _max_prompt_len(cfg: SpecBenchConfig, tokenizer: Tokenizer) -> int:
    """Returns the longest prompt in tokens over every workload's measured and warm-up prompts
    (free text included)."""
    return max(
        len(tokenizer.encode(p, add_special_tokens=False))
        for w in (*cfg.workloads, "free")
        for p in _prompts(tokenizer, w, max(cfg.num_prompts, *cfg.concurrency) + WARMUP)
    )


def _measure_repeats(
    cfg: SpecBenchConfig, engines: dict[str, LLM], tokenizer: Tokenizer
) -> dict[tuple[str, str, int], list[dict[str, Any]]]:
    """Returns every run's row per (mode, workload, concurrency), each mode measured once per
    repeat in alternating order (printing a line per run)."""
    runs: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for rep in range(cfg.repeats):
        for mode in run_order(cfg.modes, rep):
            for workload in _mode_workloads(cfg, mode):
                for c in (1,) if workload == "free" else cfg.concurrency:
                    row = measure(engines[mode], tokenizer, workload, c, cfg)
                    runs.setdefault((mode, workload, c), []).append(row)
                    print(
                        f"{workload:10s} {mode:8s} c={c:<3d} run {rep + 1}/{cfg.repeats}"
                        f" {fmt(row['tok_per_s'], '7.1f')} tok/s"
                        f"  {fmt(row['tokens_per_step'], '.2f')} tok/step"
                        f"  acceptance {fmt(row['acceptance_rate'], '.2f')}",
                        flush=True,
                    )
    return runs


def _measure_modes(
    cfg: SpecBenchConfig, checkpoint: Checkpoint, tokenizer: Tokenizer, max_model_len: int
) -> tuple[dict[tuple[str, str, int], list[dict[str, Any]]], str]:
    """Builds an engine per mode, warms each up, measures the repeats and shuts every engine
    down (also on errors); returns the runs per (mode, workload, concurrency) and the dtype
    the engines computed in."""
    engines: dict[str, LLM] = {}
    try:
        for mode in cfg.modes:
            engines[mode] = _engine(checkpoint, mode, cfg, max_model_len)
        dtype_name = engines[cfg.modes[0]].stats()["dtype"]
        for mode, llm in engines.items():
            for workload in _mode_workloads(cfg, mode):
                warm = _prompts(tokenizer, workload, WARMUP, offset=1000)
                llm.generate(warm, _params(workload, cfg.max_tokens), use_tqdm=False)
        # This machine's speed drifts over minutes: every mode runs once per repeat, in
        # alternating order, and a row reports the median.
        runs = _measure_repeats(cfg, engines, tokenizer)
    finally:
        for llm in engines.values():
            llm.engine.shutdown()
    return runs, dtype_name


def _simulate(
    cfg: SpecBenchConfig, rows: list[dict[str, Any]], tokenizer: Tokenizer, max_model_len: int
) -> dict[str, Any]:
    """Returns the simulated runs' result: spec off's measured outputs replayed as traces on
    ``cfg.sim_device`` for every mode (printing a line per row), with their ratios; or a note
    that nothing was simulated when ``cfg.sim_device`` is None."""
    if cfg.sim_device is None:
        return {"measured": False, "reason": "--sim-device none"}
    eos = set(tokenizer.eos_token_ids)
    runs = [
        SimRun(
            r["workload"],
            r["concurrency"],
            tuple(r["prompt_ids"]),
            tuple(trace_of(t, f, eos) for t, f in zip(r["tokens"], r["finish"], strict=True)),
            _params(r["workload"], cfg.max_tokens),
        )
        for r in rows
        if r["mode"] == "off" and r["workload"] != "free"
    ]
    sim = measure_sim(
        cfg.model,
        cfg.sim_device,
        cfg.sim_shape,
        runs,
        cfg.modes,
        cfg.num_speculative_tokens,
        max_model_len,
    )
    sim["ratios"] = _sim_ratios(sim["rows"])
    for r in sim["rows"]:
        print(
            f"sim {r['workload']:10s} {r['mode']:11s} c={r['concurrency']:<3d} "
            f"{fmt(r['tok_per_s'], '8.1f')} tok/s  {fmt(r['tokens_per_step'], '.2f')} tok/step",
            flush=True,
        )
    return sim


def _config_of(cfg: SpecBenchConfig) -> dict[str, Any]:
    """Returns the run's settings as the result's ``config`` entry."""
    return {
        "concurrency": list(cfg.concurrency),
        "num_prompts": cfg.num_prompts,
        "max_tokens": cfg.max_tokens,
        "num_speculative_tokens": cfg.num_speculative_tokens,
        "modes": list(cfg.modes),
        "quantization": cfg.quantization,
        # Modes without "-fixed" draft as the engine's draft policy chooses.
        "draft_policy": True,
        "workloads": list(cfg.workloads),
        "repeats": cfg.repeats,
    }


def run(cfg: SpecBenchConfig) -> dict[str, Any]:
    """Measures every mode on every workload and concurrency; returns the result dict."""
    checkpoint = load_checkpoint(cfg.model, keep_quantized=cfg.quantization == "gguf")
    tokenizer = checkpoint.tokenizer
    max_model_len = _max_prompt_len(cfg, tokenizer) + cfg.max_tokens + 1
    runs, dtype_name = _measure_modes(cfg, checkpoint, tokenizer, max_model_len)
    rows = [_median_row(mode, measured) for (mode, _, _), measured in runs.items()]
    _compare_tokens(rows)
    sim = _simulate(cfg, rows, tokenizer, max_model_len)
    for row in rows:
        del row["tokens"], row["prompt_ids"], row["finish"]
    return {
        "config": _config_of(cfg),
        "rows": rows,
        "goals": _goals(rows),
        "sim": sim,
        "run": {"dtype": dtype_name},
    }


def _compare_tokens(rows: list[dict[str, Any]]) -> None:
    off = {(r["workload"], r["concurrency"]): r["tokens"] for r in rows if r["mode"] == "off"}
    for r in rows:
        ref = off.get((r["workload"], r["concurrency"]))
        r["same_tokens_as_off"] = None if ref is None else r["tokens"] == ref


def _find(rows: list[dict[str, Any]], workload: str, mode: str, c: int) -> dict | None:
    for r in rows:
        if r["workload"] == workload and r["mode"] == mode and r["concurrency"] == c:
            return r
    return None


def _sim_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each drafting mode's tok/s over spec off's with the same scheduling on the simulator,
    per workload and concurrency, and async over sync for every mode (the CPU's goals are not
    judged there)."""
    out = []
    for r in rows:
        mode, w, c = r["mode"], r["workload"], r["concurrency"]
        async_on = mode.endswith(ASYNC)
        if mode not in ("off", ASYNC_OFF):
            base = _find(rows, w, ASYNC_OFF if async_on else "off", c)
            value = ratio(r["tok_per_s"], base and base["tok_per_s"])
            out.append(
                {"name": f"{mode} / {base and base['mode']}, {w}, concurrency {c}", "value": value}
            )
        if async_on:
            sync = _find(rows, w, mode.removesuffix(ASYNC), c)
            value = ratio(r["tok_per_s"], sync and sync["tok_per_s"])
            out.append(
                {"name": f"{mode} / {sync and sync['mode']}, {w}, concurrency {c}", "value": value}
            )
    return out


def _goals(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    goals = []
    for name, workload, c, num, den, threshold in GOALS:
        a, b = _find(rows, workload, num, c), _find(rows, workload, den, c)
        value = ratio(a and a["tok_per_s"], b and b["tok_per_s"])
        goals.append(judge_goal(name, f">= {threshold}", {f"c={c}": value}, "min", threshold))
    free = _find(rows, "free", "off", 1)
    for mode in ("off", "auto"):
        js = _find(rows, "peers", mode, 1)
        value = ratio(js and js["tok_per_s"], free and free["tok_per_s"])
        goals.append(
            judge_goal(
                f"JSON schema ({mode}) / free text (spec off), concurrency 1",
                f">= {JSON_VS_FREE_GOAL}",
                {"c=1": value},
                "min",
                JSON_VS_FREE_GOAL,
            )
        )
    return goals


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    rows = [r for r in result["rows"] if r["workload"] != "free"]
    groups = sorted({(r["workload"], r["concurrency"]) for r in rows})
    modes = result["config"]["modes"]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(modes)
    for j, mode in enumerate(modes):
        values = []
        for workload, c in groups:
            r = _find(rows, workload, mode, c)
            values.append(r["tok_per_s"] if r and r["tok_per_s"] else 0.0)
        ax.bar([i + j * width for i in range(len(groups))], values, width, label=mode)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))])
    ax.set_xticklabels([f"{w}\nconcurrency {c}" for w, c in groups])
    ax.set_ylabel("output tok/s")
    quant = result["config"].get("quantization")
    kind = result["run"].get("dtype") + (f", {quant}" if quant else "")
    ax.set_title(f"Speculative decoding ({kind}, greedy JSON)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="baton bench spec", description=__doc__.split("\n")[0])
    add_common_args(parser, "spec", dtype=None)
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    parser.add_argument("--concurrency", type=csv_of(int), default=(1, 16))
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--num-speculative-tokens", type=int, default=5)
    parser.add_argument(
        "--modes",
        type=csv_of(str),
        default=DEFAULT_MODES,
        help=f"from {', '.join(MODES)} (-fixed: every draft, no draft policy)",
    )
    parser.add_argument(
        "--quantization", default=None, choices=("gguf", "int8"), help="EngineConfig's"
    )
    parser.add_argument("--workloads", type=csv_of(str), default=WORKLOADS)
    parser.add_argument("--sim-device", default="sim:h200", help="'none' skips the sim runs")
    parser.add_argument("--sim-shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    parser.add_argument("--repeats", type=int, default=3, help="runs per mode, medians")
    args = parser.parse_args(argv)
    if args.sim_device == "none":
        args.sim_device = None
    cfg = config_from_args(parser, args, SpecBenchConfig)
    result = run(cfg)
    for goal in result["goals"]:
        value = fmt(goal["value"], ".2f")
        print(f"goal {goal['goal']}: {value} ({goal['target']}) met={goal['met']}")
    write_results(result, args.out, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
