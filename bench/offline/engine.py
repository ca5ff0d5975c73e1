"""Engine benchmark: async vs sync scheduling, free vs JSON-schema requests, two regimes.

Regime "a" runs the default model (on a CPU the forward dominates a step).
Regime "b" ("gpu-like") runs a tiny random-weight model with the real vocabulary,
whose forward takes a few ms, so the engine's CPU work (scheduling, grammar
bitmasks, detokenization) weighs more, as it does next to a GPU. For each
regime, one engine with async scheduling and one without are built once, warmed
up, and measured interleaved over the batch sizes, free (EOS ignored) and
JSON-schema requests, all greedy. On a CPU both modes run the model in the worker
process (``executor="mp"``), so the difference is the scheduling alone, not the
executor. Every JSON output that stopped by itself is
validated against the schema. Prints a table, the ratios the goals need and
whether each goal was met (it asserts nothing); writes JSON and a PNG.

    python -m baton.bench.offline.engine [--regimes a,b] [--batches 1,8,32,64]
        [--output-len 64] [--json-fractions 0,1] [--repeats 2] [--worker-threads N]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import torch

from baton.bench import common
from baton.bench.common import csv_of, require_positive_ints, write_results
from baton.bench.offline.engine_report import compute_ratios, evaluate_goals, plot, print_report
from baton.bench.offline.forward import RESULTS
from baton.bench.sim.engine_sim import add_sim_args, main_sim
from baton.engine import LLM, SamplingParams, StructuredOutputsParams
from baton.engine.core.stats import StepRecord
from baton.engine.loader import Checkpoint, expected_weight_shapes, load_checkpoint, load_tokenizer
from baton.engine.models.config import ModelConfig
from baton.engine.outputs import RequestOutput
from baton.engine.tokenizer import Tokenizer

REGIMES = {"a": "default model", "b": "gpu-like (tiny random model)"}
# Steps left out at each end of a run for the steady-state figures: the prefill
# steps at the start, the draining batch at the end.
STEADY_TRIM = 3
BLOCK_SIZE = 16
WARMUP_TOKENS = 4

# Long-ish objects (about 50-60 tokens from the default model) so that, at the default
# --output-len, some finish by themselves and their validity gets checked.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
        "occupation": {"type": "string", "maxLength": 24},
        "hobbies": {
            "type": "array",
            "items": {"type": "string", "maxLength": 16},
            "minItems": 1,
            "maxItems": 2,
        },
        "bio": {"type": "string", "maxLength": 40},
    },
    "required": ["name", "age", "city", "occupation", "hobbies", "bio"],
    "additionalProperties": False,
}
PEOPLE = ("a baker", "a pilot", "a chess player", "a gardener", "a painter", "a doctor")

# Goal thresholds (targets, not measurements).


@dataclass(frozen=True)
class TinyModelShape:
    """Shape of the regime-b model: small enough that a batch-32 forward takes a few ms."""

    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    init_std: float = 0.02
    seed: int = 0

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of "
                f"num_heads ({self.num_heads})"
            )
        if not self.init_std > 0:
            raise ValueError(f"init_std must be > 0, got {self.init_std}")


@dataclass(frozen=True)
class BenchConfig:
    """What one benchmark run measures; raises ``ValueError`` naming a bad field.

    ``worker_threads`` is the torch threads of the model worker process (None: the engine's
    default, every core on a 2-core machine and one left to the engine thread above that).
    """

    regimes: tuple[str, ...] = ("a", "b")
    batches: tuple[int, ...] = (1, 8, 32, 64)
    json_fractions: tuple[float, ...] = (0.0, 1.0)
    output_len: int = 64
    repeats: int = 2
    goal_batch: int = 32
    model: str | None = None
    device: str = "cpu"
    worker_threads: int | None = None
    enforce_eager: bool = False  # CUDA: no decode graphs (EngineConfig.enforce_eager)

    def __post_init__(self) -> None:
        if not isinstance(self.device, str) or not self.device.startswith(("cpu", "cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if not self.regimes or any(r not in REGIMES for r in self.regimes):
            raise ValueError(
                f"regimes must be a non-empty subset of {sorted(REGIMES)}, got {list(self.regimes)}"
            )
        if not self.batches or any(b <= 0 for b in self.batches):
            raise ValueError(f"batches must be positive ints, got {list(self.batches)}")
        if not self.json_fractions or any(not 0.0 <= f <= 1.0 for f in self.json_fractions):
            raise ValueError(f"json fractions must lie in [0, 1], got {list(self.json_fractions)}")
        if self.output_len < 2:
            raise ValueError(
                f"output_len must be >= 2 (TPOT needs two tokens), got {self.output_len}"
            )
        for name in ("regimes", "batches", "json_fractions"):
            values = getattr(self, name)
            if len(set(values)) != len(values):
                raise ValueError(f"{name} must not repeat a value, got {list(values)}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if self.goal_batch <= 0:
            raise ValueError(f"goal_batch must be a positive int, got {self.goal_batch}")
        if self.worker_threads is not None:
            require_positive_ints(self, "worker_threads")
            if self.device != "cpu":
                raise ValueError(
                    f"worker_threads applies to the CPU model worker, not to device {self.device}"
                )


@dataclass
class RunMeasure:
    """One ``generate`` call: its wall time, outputs and the engine statistics it added."""

    seconds: float
    tokens: int
    tpots: list[float]
    checked: int
    invalid: int
    stats: dict[str, float]
    records: list[StepRecord] = field(default_factory=list)
    # torch threads at the end of the run where a CPU thread governor runs (None: none).
    cpu_threads: int | None = None


# ------------------------------------------------------------------ models
def tiny_checkpoint(tokenizer: Tokenizer, shape: TinyModelShape | None = None) -> Checkpoint:
    """A random-weight Llama over ``tokenizer``'s whole vocabulary, built in memory (seeded)."""
    shape = shape or TinyModelShape()
    config = ModelConfig(
        architecture="llama",
        vocab_size=tokenizer.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_layers=shape.num_layers,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.hidden_size // shape.num_heads,
        rope_theta=100000.0,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tuple(tokenizer.eos_token_ids),
    )
    generator = torch.Generator().manual_seed(shape.seed)
    weights = {}
    for name, dims in expected_weight_shapes(config).items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(dims)
        else:
            weights[name] = torch.randn(dims, generator=generator) * shape.init_std
    return Checkpoint(Path("tiny-random-llama"), config, weights, tokenizer)


def conversations(start: int, n: int) -> list[list[dict[str, str]]]:
    """``n`` chat prompts asking for a JSON person; the index ``start + i`` makes each unique
    (past the shared chat-template prefix) so that no run reuses another run's prefix cache."""
    fields = ", ".join(SCHEMA["required"])
    return [
        [
            {
                "role": "user",
                "content": f"Invent {PEOPLE[(start + i) % len(PEOPLE)]} (person #{start + i}) "
                f"and describe them as a JSON object with {fields}.",
            }
        ]
        for i in range(n)
    ]


def request_params(n: int, json_fraction: float, output_len: int) -> list[SamplingParams]:
    """Greedy params: the first ``round(n * json_fraction)`` JSON-constrained, the rest free."""
    n_json = round(n * json_fraction)
    free = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    structured = SamplingParams(
        max_tokens=output_len,
        temperature=0.0,
        structured_outputs=StructuredOutputsParams(json=SCHEMA),
    )
    return [structured] * n_json + [free] * (n - n_json)


# ---------------------------------------------------------------- measuring
def invalid_json(
    outputs: Sequence[RequestOutput], params: Sequence[SamplingParams]
) -> tuple[int, int]:
    """(checked, invalid): JSON requests that stopped by themselves, and those whose text does
    not parse or does not validate against ``SCHEMA``."""
    checked = invalid = 0
    for out, sp in zip(outputs, params, strict=True):
        completion = out.outputs[0]
        if sp.structured_outputs is None or completion.finish_reason != "stop":
            continue
        checked += 1
        try:
            jsonschema.validate(json.loads(completion.text), SCHEMA)
        except (json.JSONDecodeError, jsonschema.ValidationError):
            invalid += 1
    return checked, invalid


def measure(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> RunMeasure:
    """Runs one batch to the end; the engine statistics are deltas over this call only."""
    core_stats = llm.engine.core.stats
    # The recent steps are bounded: emptying them makes "this run's steps" exact.
    core_stats.clear_recent()
    before = llm.stats()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    after = llm.stats()
    # Counters and times only (stats() also names the dtype and its reason; a figure that
    # appears during the run, such as the draft policy's fitted step cost, has no delta).
    delta = {
        k: after[k] - before[k]
        for k, v in after.items()
        if k != "device_busy_fraction" and isinstance(v, (int, float)) and k in before
    }
    tpots = [o.metrics.time_per_output_token for o in outs]
    checked, invalid = invalid_json(outs, params)
    return RunMeasure(
        seconds=seconds,
        tokens=sum(len(o.outputs[0].token_ids) for o in outs),
        tpots=[t for t in tpots if t is not None],
        checked=checked,
        invalid=invalid,
        stats=delta,
        records=core_stats.recent_steps(),
        cpu_threads=int(after["cpu_threads"]) if "cpu_threads" in after else None,
    )


def host_cpu_s(record: StepRecord, inline_device: bool) -> float:
    """The engine's own CPU time in a step. With an in-process executor on the CPU the forward
    runs on the engine thread and is not a wait, so ``cpu_s`` holds it too and it is taken out
    (on CUDA the same executor only queues the forward: nothing to take out)."""
    return max(0.0, record.cpu_s - record.device_s) if inline_device else record.cpu_s


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def summarize(
    runs: Sequence[RunMeasure], regime: str, llm: LLM, json_fraction: float, batch: int
) -> dict[str, Any]:
    """One table row from the repetitions of one case."""
    inline = llm.config.executor == "uni" and llm.config.device == "cpu"
    seconds = sum(r.seconds for r in runs)
    tokens = sum(r.tokens for r in runs)
    engine_s = sum(r.stats["engine_s"] for r in runs)
    device_s = sum(r.stats["device_s"] for r in runs)
    steady = [rec for r in runs for rec in r.records[STEADY_TRIM : len(r.records) - STEADY_TRIM]]
    steady_wall = sum(rec.wall_s for rec in steady)
    mean_wall = _mean([rec.wall_s for rec in steady])
    mean_cpu = _mean([host_cpu_s(rec, inline) for rec in steady])
    mean_device = _mean([rec.device_s for rec in steady])
    bound = max(mean_cpu, mean_device) if mean_cpu is not None and mean_device is not None else 0
    tpot = _mean([t for r in runs for t in r.tpots])
    # A one-off stall (a kernel compiled on first use, a collection) shows as one long step.
    walls = [(rec.wall_s, i) for r in runs for i, rec in enumerate(r.records)]
    longest = max(walls, default=(0.0, -1))
    return {
        "regime": regime,
        "async": bool(llm.config.async_scheduling),
        "executor": llm.config.executor,
        "dtype": str(llm.config.dtype).removeprefix("torch."),
        "json_fraction": json_fraction,
        "batch": batch,
        "runs": len(runs),
        "seconds": seconds,
        "output_tokens": tokens,
        "tok_per_s": tokens / seconds if seconds > 0 else None,
        "tpot_ms": tpot * 1e3 if tpot is not None else None,
        # Both busy figures are capped at 1 like EngineStats: a step's device time may
        # overlap the output processing that runs between steps, outside their wall time.
        "device_busy": min(1.0, device_s / engine_s) if engine_s > 0 else None,
        "device_busy_of_wall": device_s / seconds if seconds > 0 else None,
        "outside_steps_s": seconds - engine_s,
        "run_seconds": [r.seconds for r in runs],
        "longest_step_ms": longest[0] * 1e3,
        "longest_step_at": longest[1],
        "steady_steps": len(steady),
        "steady_device_busy": (
            min(1.0, sum(rec.device_s for rec in steady) / steady_wall) if steady_wall > 0 else None
        ),
        "steps": sum(int(r.stats["steps"]) for r in runs),
        "deferred_steps": sum(int(r.stats["deferred_steps"]) for r in runs),
        "step_wall_ms": mean_wall * 1e3 if mean_wall is not None else None,
        "step_cpu_ms": mean_cpu * 1e3 if mean_cpu is not None else None,
        "step_device_ms": mean_device * 1e3 if mean_device is not None else None,
        "step_over_bound": mean_wall / bound if mean_wall is not None and bound > 0 else None,
        "json_checked": sum(r.checked for r in runs),
        "json_invalid": sum(r.invalid for r in runs),
        # The thread governor (engine/worker/cpu_threads.py): a change in a run means other
        # processes took cores during it, and the row measured fewer threads.
        "cpu_threads": [r.cpu_threads for r in runs],
        "cpu_thread_changes": sum(int(r.stats.get("cpu_thread_changes", 0)) for r in runs),
    }


def step_trace(run: RunMeasure, llm: LLM) -> dict[str, list[float]]:
    """Per-step wall, engine CPU and device time (ms) of one run, for the plot."""
    inline = llm.config.executor == "uni" and llm.config.device == "cpu"
    return {
        "wall_ms": [rec.wall_s * 1e3 for rec in run.records],
        "cpu_ms": [host_cpu_s(rec, inline) * 1e3 for rec in run.records],
        "device_ms": [rec.device_s * 1e3 for rec in run.records],
        "deferred": [rec.deferred for rec in run.records],
    }


# ------------------------------------------------------------------ running
def build_llm(
    ckpt: Checkpoint,
    async_on: bool,
    max_batch: int,
    max_len: int,
    warm: list[list[int]],
    device: str = "cpu",
    worker_threads: int | None = None,
    enforce_eager: bool = False,
    fill_thread: bool | None = None,
) -> LLM:
    """An engine over ``ckpt`` sized for the benchmark (``worker_threads`` torch threads in
    its model worker, None: the engine's default; ``enforce_eager``: no CUDA graphs;
    ``fill_thread``: the grammar fill thread on or off, None: the engine's default), warmed
    up on ``warm`` (first-call costs, the schema's grammar compile)."""
    extra = {} if fill_thread is None else {"grammar_fill_thread": fill_thread}
    blocks_per_seq = math.ceil(max_len / BLOCK_SIZE) + 1
    llm = LLM.from_checkpoint(
        ckpt,
        async_scheduling=async_on,
        device=device,
        # Like with like: on a CPU both modes run the model in the worker process (the
        # in-process executor would also change the engine's mask-fill threads, 2 vs 1), so
        # the difference is the scheduling alone.
        executor="mp" if device == "cpu" else None,
        worker_threads=worker_threads,
        max_num_seqs=max_batch,
        max_model_len=max_len,
        block_size=BLOCK_SIZE,
        num_kv_blocks=max_batch * blocks_per_seq + 8,
        enforce_eager=enforce_eager,
        **extra,
    )
    llm.generate(warm, request_params(len(warm), 0.5, WARMUP_TOKENS), use_tqdm=False)
    return llm


def run_regime(
    cfg: BenchConfig, regime: str, ckpt: Checkpoint, trace_case: tuple[int, float] | None
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """All cases of one regime; returns its rows and, for ``trace_case`` (batch, json
    fraction), the per-step traces of the last repetition with async on and off."""
    tok = ckpt.tokenizer
    cases = [
        (b, f, rep) for b in cfg.batches for rep in range(cfg.repeats) for f in cfg.json_fractions
    ]
    prompts: dict[tuple[int, float, int], list[list[int]]] = {}
    start = 0
    for case in cases:
        batch = case[0]
        prompts[case] = [
            list(tok.apply_chat_template(c, tokenize=True)) for c in conversations(start, batch)
        ]
        start += batch
    warm = [list(tok.apply_chat_template(c, tokenize=True)) for c in conversations(start, 4)]
    longest = max(len(p) for p in [*warm, *(p for ps in prompts.values() for p in ps)])
    max_len = longest + max(cfg.output_len, WARMUP_TOKENS) + 1
    llms: dict[bool, LLM] = {}
    runs: dict[tuple[bool, int, float], list[RunMeasure]] = {}
    try:
        for mode in (True, False):
            llms[mode] = build_llm(
                ckpt,
                mode,
                max(cfg.batches),
                max_len,
                warm,
                cfg.device,
                cfg.worker_threads,
                cfg.enforce_eager,
            )
        for batch, fraction, rep in cases:
            params = request_params(batch, fraction, cfg.output_len)
            # Alternate which mode goes first, so drift in machine load hits both alike.
            order = (True, False) if rep % 2 == 0 else (False, True)
            for mode in order:
                run = measure(llms[mode], prompts[(batch, fraction, rep)], params)
                runs.setdefault((mode, batch, fraction), []).append(run)
        rows = [
            summarize(runs[(mode, b, f)], regime, llms[mode], f, b)
            for b in cfg.batches
            for f in cfg.json_fractions
            for mode in (True, False)
        ]
        trace = None
        if trace_case is not None and (True, *trace_case) in runs:
            trace = {
                "regime": regime,
                "batch": trace_case[0],
                "json_fraction": trace_case[1],
                "async": step_trace(runs[(True, *trace_case)][-1], llms[True]),
                "sync": step_trace(runs[(False, *trace_case)][-1], llms[False]),
            }
    finally:
        for llm in llms.values():
            llm.shutdown()
    return rows, trace


# ------------------------------------------------------------- ratios, goals


# ------------------------------------------------------------------ output


def build_parser() -> argparse.ArgumentParser:
    """Returns the parser of ``baton bench engine``'s options (the simulator's included)."""
    p = argparse.ArgumentParser(prog="baton bench engine", description=__doc__.splitlines()[0])
    p.add_argument(
        "--model",
        default=None,
        help="regime a's model and regime b's tokenizer (default: SmolLM2-135M)",
    )
    p.add_argument(
        "--regimes",
        type=csv_of(str),
        default=("a", "b"),
        help="a = default model, b = gpu-like tiny model (default: a,b)",
    )
    p.add_argument(
        "--batches", type=csv_of(int), default=None, help="default: 1,8,32,64 (sim: 1,16,64,256)"
    )
    p.add_argument(
        "--json-fractions",
        type=csv_of(float),
        default=None,
        help="share of JSON-schema requests in a batch (default: 0,1; sim: 0,0.5,1)",
    )
    p.add_argument("--output-len", type=int, default=64, help="max tokens per request")
    p.add_argument(
        "--device",
        default="cpu",
        help="cpu (default), cuda[:N], or sim:<gpu> (a simulated accelerator: h200, h100, l4)",
    )
    p.add_argument("--repeats", type=int, default=2, help="runs per case, interleaved")
    p.add_argument(
        "--worker-threads",
        type=int,
        default=None,
        help="torch threads of the CPU model worker process (default: the engine's, every "
        "core on a 2-core machine, one left to the engine thread above that); 1 keeps a smoke "
        "run from stalling beside other busy processes",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="CUDA: run every step op by op, without the decode CUDA graphs",
    )
    p.add_argument(
        "--goal-batch",
        type=int,
        default=32,
        help="batch size at which the per-batch goals are judged (default: 32)",
    )
    p.add_argument(
        "--out", type=Path, default=RESULTS / "engine.json", help="JSON path; the PNG goes beside"
    )
    add_sim_args(p)
    return p


def run_regimes(
    cfg: BenchConfig,
) -> tuple[list[dict[str, Any]], dict[str, Any] | None, dict[str, str], TinyModelShape]:
    """Runs every regime of ``cfg`` in turn; returns all rows, the step trace (of regime b when
    it runs, else of the first regime), each regime's model path and the tiny model's shape."""
    trace_regime = "b" if "b" in cfg.regimes else cfg.regimes[0]
    trace_batch = cfg.goal_batch if cfg.goal_batch in cfg.batches else max(cfg.batches)
    trace_case = (trace_batch, max(cfg.json_fractions))
    rows: list[dict[str, Any]] = []
    trace = None
    models: dict[str, str] = {}
    tiny = TinyModelShape()
    for regime in cfg.regimes:
        if regime == "a":
            ckpt = load_checkpoint(cfg.model)
        else:
            ckpt = tiny_checkpoint(load_tokenizer(cfg.model), tiny)
        models[regime] = str(ckpt.path)
        regime_rows, regime_trace = run_regime(
            cfg, regime, ckpt, trace_case if regime == trace_regime else None
        )
        rows += regime_rows
        trace = regime_trace or trace
        del ckpt
    return rows, trace, models, tiny


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark, prints the report and writes ``--out`` (JSON) and its PNG.

    Loads the default model (regime a), starts one model worker process per
    regime, and exits through argparse (SystemExit 2) on a bad argument.
    """
    p = build_parser()
    a = p.parse_args(argv)
    if a.device.startswith("sim:"):
        if a.worker_threads is not None:
            p.error("--worker-threads applies to the CPU model worker, not to a simulated device")
        return main_sim(p, a)
    cfg = common.config_from_args(
        p,
        a,
        BenchConfig,
        batches=a.batches or BenchConfig.batches,
        json_fractions=a.json_fractions or BenchConfig.json_fractions,
    )
    rows, trace, models, tiny = run_regimes(cfg)
    ratios = compute_ratios(rows)
    result = {
        "regimes": {r: REGIMES[r] for r in cfg.regimes},
        "models": models,
        "tiny_model": asdict(tiny),
        "batches": list(cfg.batches),
        "json_fractions": list(cfg.json_fractions),
        "output_len": cfg.output_len,
        "repeats": cfg.repeats,
        "goal_batch": cfg.goal_batch,
        "steady_trim_steps": STEADY_TRIM,
        "device": cfg.device,
        "threads": torch.get_num_threads(),
        "worker_threads": cfg.worker_threads,
        "enforce_eager": cfg.enforce_eager,
        "torch": torch.__version__,
        "schema": SCHEMA,
        "rows": rows,
        "ratios": ratios,
        "goals": evaluate_goals(rows, ratios, cfg.goal_batch),
        "step_trace": trace,
    }
    print_report(result)
    write_results(result, a.out, plot, dtype=",".join(sorted({r["dtype"] for r in rows})))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
