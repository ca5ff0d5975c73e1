"""Peers benchmark: the same JSON-schema workload on baton and its peers.

One run, one workload: the same chat prompts (as the same token ids), the same
JSON schema, greedy decoding, the same ``--max-tokens``, at each
``--concurrency`` N (N prompts submitted at once), on the same weights, through

* baton (``LLM.generate``, as its engine runs by default in that dtype, without weight
  quantisation),
* transformers batched ``generate`` (left padding) with xgrammar's Hugging Face
  logits processor,
* Outlines 1.x over the same transformers model (skipped with a note when
  ``outlines`` is not installed),
* llama-cpp-python with a JSON-schema grammar on the GGUF file, threads = CPU cores
  (skipped with a note when ``llama_cpp`` is not installed or the model is not a GGUF
  file). Its Python API decodes one sequence at a time, so concurrency N runs the N
  prompts one after another, and it computes on the GGUF's quantized weights as stored.

baton and its Python peers run in the same dtype, once per ``--dtypes`` entry ("auto":
what baton's ``dtype="auto"`` picks on this machine); every baton row is set against the
Python peers of its own dtype and against llama-cpp-python. Each engine is built, warmed
up on prompts of its own, measured at every concurrency, and closed before the next one
starts; with ``--repeats`` R the engines run R times, in the opposite order every other
time, and each figure is the median over the repeats (with its spread). No engine reuses
a cached prompt prefix (baton runs with prefix caching off, llama-cpp-python's state is
reset before each prompt), so every prompt is prefilled in full. Reports per engine and
concurrency: output tokens/s, TPOT (ms) and the share of outputs that parse as JSON and
validate against the schema; the ratios baton / each peer; and whether each goal of the
issue is met (nothing is asserted). Writes JSON and a PNG.

    baton bench peers [--model PATH | --tiny] [--concurrency 1,16] [--max-tokens 96]
        [--dtypes auto] [--engines ...] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jsonschema
import torch

from baton.bench.common import (
    add_common_args,
    config_from_args,
    csv_of,
    run_order,
    write_results,
)
from baton.bench.offline.peer_runners import (
    ENGINES,
    GGUF_DTYPE,
    WARMUP_PROMPTS,
    BatonRunner,
    Completion,
    LlamaCppRunner,
    OutlinesRunner,
    Runner,
    TransformersXgrammarRunner,
    Workload,
    build_hf_model,
    check_same_ids,
    hf_tokenizer,
    package_version,
    unavailable,
)
from baton.bench.offline.peers_config import PeersConfig, resolve_dtypes
from baton.bench.offline.peers_report import compute_ratios, evaluate_goals, plot, print_report
from baton.engine.config import EngineConfig, num_cpu_cores
from baton.engine.loader import Checkpoint, load_checkpoint, load_tokenizer
from baton.engine.tokenizer import Tokenizer

# A small object the default model fills in well under the default --max-tokens
# (about 40 tokens), with keywords every peer enforces (lengths, bounds, counts).
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
        "skills": {
            "type": "array",
            "items": {"type": "string", "maxLength": 16},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["name", "age", "city", "skills"],
    "additionalProperties": False,
}
SUBJECTS = (
    "a baker",
    "a pilot",
    "a chess player",
    "a gardener",
    "a painter",
    "a doctor",
    "a sailor",
    "a librarian",
)


def conversation(index: int) -> list[dict[str, str]]:
    """The ``index``-th chat prompt asking for a JSON person; each index is unique text."""
    fields = ", ".join(SCHEMA["required"])
    subject = SUBJECTS[index % len(SUBJECTS)]
    return [
        {
            "role": "user",
            "content": f"Invent {subject} (person #{index}) and describe them "
            f"as a JSON object with {fields}.",
        }
    ]


def build_workload(tokenizer: Tokenizer, num_prompts: int, max_tokens: int) -> Workload:
    """``num_prompts`` measured prompts plus ``WARMUP_PROMPTS`` different ones, rendered with
    the model's chat template. Raises ``ValueError`` when the tokenizer has no EOS id."""
    if not tokenizer.eos_token_ids:
        raise ValueError("the tokenizer has no EOS token id: requests could never stop")
    texts = [
        tokenizer.apply_chat_template(conversation(i), tokenize=False)
        for i in range(num_prompts + WARMUP_PROMPTS)
    ]
    ids = [tuple(tokenizer.encode(t, add_special_tokens=False)) for t in texts]
    pad = (
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_ids[0]
    )
    return Workload(
        texts=tuple(texts[:num_prompts]),
        prompt_ids=tuple(ids[:num_prompts]),
        warmup_texts=tuple(texts[num_prompts:]),
        warmup_ids=tuple(ids[num_prompts:]),
        schema=SCHEMA,
        max_tokens=max_tokens,
        eos_token_ids=tuple(tokenizer.eos_token_ids),
        pad_token_id=pad,
    )


def is_valid(text: str, schema: dict[str, Any]) -> bool:
    """True when ``text`` parses as JSON and validates against ``schema``."""
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


@dataclass
class CaseMeasure:
    """The repetitions of one (engine, concurrency) case: per run, its seconds and its
    completions."""

    seconds: list[float] = field(default_factory=list)
    runs: list[list[Completion]] = field(default_factory=list)

    def add(self, seconds: float, completions: list[Completion]) -> None:
        self.seconds.append(seconds)
        self.runs.append(completions)


def summarize(
    label: str, engine: str, dtype: str, concurrency: int, case: CaseMeasure, schema: dict
) -> dict[str, Any]:
    """One table row: medians over the runs (output tok/s, per-run mean TPOT), their spread,
    and validity pooled over every completion."""
    completions = [c for run in case.runs for c in run]
    per_run_tps = [
        sum(c.tokens for c in run) / s for s, run in zip(case.seconds, case.runs, strict=True)
    ]
    per_run_tpot = [
        statistics.fmean(t) * 1e3
        for t in ([c.tpot_s for c in run if c.tpot_s is not None] for run in case.runs)
        if t
    ]
    tokens = sum(c.tokens for c in completions)
    valid = sum(is_valid(c.text, schema) for c in completions)
    n = len(completions)
    return {
        "engine": engine,
        "label": label,
        "dtype": dtype,
        "concurrency": concurrency,
        "runs": len(case.seconds),
        "requests": n,
        "seconds": sum(case.seconds),
        "output_tokens": tokens,
        "tok_per_s": statistics.median(per_run_tps) if per_run_tps else None,
        "tok_per_s_runs": per_run_tps,
        "tok_per_s_min": min(per_run_tps, default=None),
        "tok_per_s_max": max(per_run_tps, default=None),
        "tpot_ms": statistics.median(per_run_tpot) if per_run_tpot else None,
        "valid": valid,
        "valid_share": valid / n if n else None,
        "mean_output_tokens": tokens / n if n else None,
    }


# ------------------------------------------------------------------ running
@dataclass(frozen=True)
class Unit:
    """One engine in one dtype: what is built, measured and closed as a whole."""

    engine: str
    dtype: str


def plan_units(cfg: PeersConfig) -> list[Unit]:
    """Every engine of ``cfg`` in every dtype (llama-cpp-python once, in the GGUF's own
    weights), in ``cfg.engines`` order."""
    units = []
    for engine in cfg.engines:
        if engine == "llama-cpp":
            units.append(Unit(engine, GGUF_DTYPE))
        else:
            units += [Unit(engine, d) for d in cfg.dtypes]
    return units


def measure_once(runner: Runner, cfg: PeersConfig, cases: dict[int, CaseMeasure]) -> None:
    """Every concurrency of ``cfg`` once on one engine, added to ``cases``."""
    for c in cfg.concurrency:
        t0 = time.perf_counter()
        completions = runner.run(range(c))
        seconds = time.perf_counter() - t0
        cases.setdefault(c, CaseMeasure()).add(seconds, completions)
        tps = sum(x.tokens for x in completions) / seconds
        print(f"  {runner.label} c={c}: {tps:.1f} tok/s", flush=True)


def _skip_reason(engine: str, ckpt: Checkpoint) -> str | None:
    """Returns why ``engine`` cannot run here (its package missing, or llama-cpp-python on a
    model that is not a GGUF file), or None when it can."""
    module = {
        "transformers": "xgrammar.contrib.hf",
        "outlines": "outlines",
        "llama-cpp": "llama_cpp",
    }[engine]
    reason = unavailable(module)
    if reason is None and engine == "llama-cpp" and ckpt.path.suffix != ".gguf":
        reason = f"llama-cpp-python needs a GGUF file; the model is {ckpt.path}"
    return reason


def plan_builders(
    cfg: PeersConfig, ckpt: Checkpoint, tokenizer: Tokenizer, workload: Workload
) -> tuple[dict[Unit, Callable[[], Runner]], list[dict[str, str]]]:
    """Returns a runner builder for every unit of ``cfg`` that can run here, and the engines
    skipped (engine, label, reason; each printed once). The transformers model and tokenizer
    are built at the first builder call that needs them and shared by the later ones."""
    skipped: list[dict[str, str]] = []
    hf_models: dict[str, Any] = {}
    hf_tok: Any = None

    def hf_parts(dtype: str) -> tuple[Any, Any]:
        nonlocal hf_tok
        if hf_tok is None:
            hf_tok = hf_tokenizer(tokenizer)
            check_same_ids(hf_tok, workload)
        if dtype not in hf_models:
            hf_models[dtype] = build_hf_model(ckpt, dtype)
        return hf_models[dtype], hf_tok

    max_batch = max(cfg.concurrency)
    builders: dict[Unit, Callable[[], Runner]] = {}
    for unit in plan_units(cfg):
        engine, dtype = unit.engine, unit.dtype
        if engine == "baton":
            builders[unit] = lambda d=dtype: BatonRunner(ckpt, d, workload, max_batch)
            continue
        reason = _skip_reason(engine, ckpt)
        if reason is not None:
            if all(s["engine"] != engine for s in skipped):
                skipped.append({"engine": engine, "label": ENGINES[engine], "reason": reason})
                print(f"{ENGINES[engine]}: skipped: {reason}", flush=True)
            continue
        if engine == "transformers":
            builders[unit] = lambda d=dtype: TransformersXgrammarRunner(*hf_parts(d), workload, d)
        elif engine == "outlines":
            builders[unit] = lambda d=dtype: OutlinesRunner(*hf_parts(d), workload, d)
        else:
            builders[unit] = lambda: LlamaCppRunner(ckpt.path, workload)
    return builders, skipped


def measure_repeats(
    cfg: PeersConfig, builders: dict[Unit, Callable[[], Runner]]
) -> tuple[dict[Unit, dict[int, CaseMeasure]], dict[Unit, str], list[dict[str, Any]]]:
    """Builds, measures and closes every unit once per repeat (in ``run_order``); returns the
    measures per unit and concurrency, each unit's runner label, and one entry per build
    (engine, label, repeat, set-up seconds)."""
    cases: dict[Unit, dict[int, CaseMeasure]] = {u: {} for u in builders}
    labels: dict[Unit, str] = {}
    engines: list[dict[str, Any]] = []
    for repeat in range(cfg.repeats):
        order = run_order(list(builders), repeat)
        print(
            f"run {repeat + 1}/{cfg.repeats}: " + ", ".join(f"{u.engine} {u.dtype}" for u in order),
            flush=True,
        )
        for unit in order:
            t0 = time.perf_counter()
            runner = builders[unit]()
            setup_s = time.perf_counter() - t0
            labels[unit] = runner.label
            engines.append(
                {"engine": unit.engine, "label": runner.label, "run": repeat, "setup_s": setup_s}
            )
            print(f"{runner.label}: set up and warmed up in {setup_s:.1f} s", flush=True)
            try:
                measure_once(runner, cfg, cases[unit])
            finally:
                runner.close()
    return cases, labels, engines


def _run_info(cfg: PeersConfig, ckpt: Checkpoint, workload: Workload) -> dict[str, Any]:
    """Returns what describes the run besides its measures: model, settings, method notes,
    threads, package versions, schema and prompt lengths (the result's leading keys)."""
    return {
        "model": str(ckpt.path),
        "tiny": cfg.tiny,
        "concurrency": list(cfg.concurrency),
        "max_tokens": cfg.max_tokens,
        "repeats": cfg.repeats,
        "dtypes": list(cfg.dtypes),
        "order": "engines in --engines order, reversed on every other repeat",
        "figures": "median over the repeats; tok_per_s_min/max give the spread",
        "prefix_caching": False,
        "whitespace": "compact JSON for baton, xgrammar and Outlines; llama.cpp's own grammar",
        "threads": torch.get_num_threads(),
        "llama_cpp_threads": num_cpu_cores(),
        "versions": {
            p: package_version(p)
            for p in (
                "torch",
                "transformers",
                "xgrammar",
                "outlines",
                "outlines_core",
                "llama_cpp_python",
            )
        },
        "schema": SCHEMA,
        "prompt_tokens": [len(p) for p in workload.prompt_ids],
    }


def run(cfg: PeersConfig) -> dict[str, Any]:
    """Runs every engine of ``cfg``; returns the result dict (rows, ratios, goals, notes)."""
    tokenizer = load_tokenizer(cfg.model)
    if cfg.tiny:
        from baton.bench.offline.engine import tiny_checkpoint

        ckpt = tiny_checkpoint(tokenizer)
    else:
        ckpt = load_checkpoint(cfg.model)
    workload = build_workload(tokenizer, max(cfg.concurrency), cfg.max_tokens)
    builders, skipped = plan_builders(cfg, ckpt, tokenizer, workload)
    cases, labels, engines = measure_repeats(cfg, builders)
    rows = [
        summarize(labels[u], u.engine, u.dtype, c, case, workload.schema)
        for u in builders
        for c, case in sorted(cases[u].items())
    ]
    ratios = compute_ratios(rows)
    return {
        **_run_info(cfg, ckpt, workload),
        "engines": engines,
        "skipped": skipped,
        "rows": rows,
        "ratios": ratios,
        "goals": evaluate_goals(rows, ratios, cfg),
    }


# ------------------------------------------------------------- ratios, goals


# ------------------------------------------------------------------ output


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark, prints the report and writes ``--out`` (JSON) and its PNG.

    Loads the model (or builds the tiny one), starts baton's model worker process, and exits
    through argparse (SystemExit 2) on a bad argument.
    """
    p = argparse.ArgumentParser(prog="baton bench peers", description=__doc__.splitlines()[0])
    add_common_args(p, "peers", dtype=None)
    p.add_argument(
        "--tiny",
        action="store_true",
        help="random-weight 2-layer model over --model's tokenizer (smoke runs; no llama-cpp)",
    )
    p.add_argument("--concurrency", type=csv_of(int), default=(1, 16), help="default: 1,16")
    p.add_argument("--max-tokens", type=int, default=96, help="max output tokens (default: 96)")
    p.add_argument(
        "--dtypes",
        type=csv_of(str),
        default=("auto",),
        help="dtypes of baton and its Python peers: auto (baton's pick on this CPU), float32, "
        "bfloat16; the first one is judged against the goals (default: auto)",
    )
    p.add_argument(
        "--engines",
        type=csv_of(str),
        default=tuple(ENGINES),
        help=f"subset of {','.join(ENGINES)} (default: all)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="runs of every engine, the order reversed every other run (default: 3)",
    )
    a = p.parse_args(argv)
    cfg = config_from_args(p, a, PeersConfig, dtypes=resolve_dtypes(a.dtypes))
    result = run(cfg)
    # What baton ran with by default here (BatonRunner leaves it to the engine): structured
    # requests get speculative drafts where the engine schedules synchronously.
    spec = EngineConfig().speculative_config
    result["baton_speculative"] = (
        "off"
        if spec is None
        else f"{spec.method}, {spec.num_speculative_tokens} drafts per step"
        + (", structured requests only" if spec.structured_only else "")
    )
    print_report(result)
    write_results(result, a.out, plot, dtype=",".join(cfg.dtypes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
