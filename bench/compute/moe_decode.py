"""Mixture-of-experts decode: an MoE model's step against dense models of the same active and
of the same total parameters, on the engine's CPU kernels, interleaved trial by trial.

Random-weight models built from a config (nothing is read from disk): an MoE shape, a dense
model whose MLP is as wide as the k experts a token uses (the same active parameters) and one
as wide as all experts (the same total parameters). Each is prefilled with ``--context`` tokens
per sequence, then timed over ``--steps`` decode steps at each batch size; the median step of
each trial, the median over trials. At batch 1 an MoE step reads k experts a layer; at batch 16
each token picks its own, so the step reads nearly every expert of a small pool: the dense model
of the same total parameters bounds it from above, the one of the same active parameters from
below. Prints the table and the issue's goal line (MoE / dense-active step at batch 16 <= 1.3),
writes JSON and a PNG.

    baton bench moe_decode [--shapes mixtral,qwen3moe] [--batches 1,16] [--trials 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from pathlib import Path
from typing import Any

import torch

from baton.bench.common import RESULTS_DIR, csv_of, judge_goal, print_goals, write_results
from baton.bench.offline.forward import BatonCase
from baton.bench.plotting import pyplot
from baton.bench.tables import COMPACT, markdown_table, where_run
from baton.engine.config import auto_dtype
from baton.engine.models.config import ModelConfig
from baton.engine.models.llama import LlamaForCausalLM
from baton.engine.worker.build import add_cpu_kernels

GOAL_BATCH = 16
GOAL = 1.3

# Scaled-down shapes that keep each family's expert layout: Mixtral (8 wide experts, top 2)
# and Qwen3-MoE (many narrow experts, top 8; here 64 of width 256).
_COMMON = dict(
    architecture="llama",
    vocab_size=32000,
    hidden_size=1024,
    num_layers=8,
    num_heads=16,
    num_kv_heads=4,
    head_dim=64,
    max_position_embeddings=4096,
)
SHAPES: dict[str, dict[str, Any]] = {
    "mixtral": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=2816),
    "qwen3moe": dict(num_experts=64, num_experts_per_tok=8, moe_intermediate_size=256),
}
# The models of a shape (`configs`), in the order the table and the plot show them.
MOE_ROLES = ("moe", "dense_active", "dense_total")


def configs(shape: str) -> dict[str, ModelConfig]:
    """The MoE config of ``shape`` and its two dense references, by role."""
    moe = SHAPES[shape]
    ff, k, e = moe["moe_intermediate_size"], moe["num_experts_per_tok"], moe["num_experts"]
    # One architecture for all three (Qwen3's per-head q/k norms would cost the MoE alone).
    return {
        "moe": ModelConfig(**{**_COMMON, "architecture": "mixtral"}, intermediate_size=ff, **moe),
        "dense_active": ModelConfig(**_COMMON, intermediate_size=k * ff),
        "dense_total": ModelConfig(**_COMMON, intermediate_size=e * ff),
    }


def build(config: ModelConfig, dtype: torch.dtype, seed: int) -> LlamaForCausalLM:
    """A random-weight model of ``config`` in ``dtype`` with the engine's CPU kernels."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02)
    model = model.to(dtype).eval()
    add_cpu_kernels(model, None)
    return model


def run(
    shapes: tuple[str, ...], batches: tuple[int, ...], trials: int, context: int, steps: int
) -> dict[str, Any]:
    """Every (shape, role, batch) cell's decode step, the roles interleaved in each trial."""
    dtype, _ = auto_dtype("cpu")
    rows = []
    for shape in shapes:
        models = {role: build(c, dtype, seed=0) for role, c in configs(shape).items()}
        # bench forward's case: prefill ``context`` tokens a sequence, the median decode step.
        cases = {
            (role, b): BatonCase(m, b, context, steps)
            for role, m in models.items()
            for b in batches
        }
        times: dict[tuple[str, int], list[float]] = {key: [] for key in cases}
        for trial in range(trials):
            for (role, b), case in cases.items():
                gen = torch.Generator().manual_seed(trial)
                ids = torch.randint(0, models[role].config.vocab_size, (b, context), generator=gen)
                with torch.inference_mode():
                    times[role, b].append(case.decode_time(ids))
        for (role, b), samples in times.items():
            cfg = models[role].config
            rows.append(
                {
                    "shape": shape,
                    "role": role,
                    "batch": b,
                    "step_ms": statistics.median(samples) * 1e3,
                    "trials_ms": [t * 1e3 for t in samples],
                    "config": dataclasses.asdict(cfg),
                    "params": sum(p.numel() for p in models[role].parameters()),
                }
            )
        del models, cases
    result: dict[str, Any] = {
        "dtype": str(dtype).removeprefix("torch."),
        "context": context,
        "steps": steps,
        "trials": trials,
        "rows": rows,
    }
    result["ratios"] = ratios(rows)
    result["goals"] = goals(result["ratios"])
    return result


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (shape, batch): the MoE step over each dense reference's."""
    step = {(r["shape"], r["role"], r["batch"]): r["step_ms"] for r in rows}
    out = []
    for shape, role, b in step:
        if role != "moe":
            continue
        out.append(
            {
                "shape": shape,
                "batch": b,
                "moe_over_dense_active": step[shape, "moe", b] / step[shape, "dense_active", b],
                "moe_over_dense_total": step[shape, "moe", b] / step[shape, "dense_total", b],
            }
        )
    return out


def goals(ratio_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's goal: at batch 16 the MoE step within 1.3x of the dense-active one."""
    values: dict[str, float | None] = {
        r["shape"]: r["moe_over_dense_active"] for r in ratio_rows if r["batch"] == GOAL_BATCH
    }
    name = f"MoE decode step / dense step of the same active parameters, batch {GOAL_BATCH}"
    return [judge_goal(name, f"<= {GOAL}", values, "max", GOAL)]


def print_table(result: dict[str, Any]) -> None:
    print(f"decode step ms ({result['dtype']}, context {result['context']}):")
    print(
        f"{'shape':>9} {'batch':>5} {'moe':>8} {'dense act':>9} {'dense tot':>9} "
        f"{'/act':>6} {'/tot':>6}"
    )
    step = {(r["shape"], r["role"], r["batch"]): r["step_ms"] for r in result["rows"]}
    for r in result["ratios"]:
        s, b = r["shape"], r["batch"]
        print(
            f"{s:>9} {b:>5} {step[s, 'moe', b]:8.2f} {step[s, 'dense_active', b]:9.2f} "
            f"{step[s, 'dense_total', b]:9.2f} {r['moe_over_dense_active']:6.2f} "
            f"{r['moe_over_dense_total']:6.2f}"
        )
    print_goals(result["goals"])


def readme_table(result: dict[str, Any]) -> str:
    """The README's section body: what ran where, then each shape's steps and ratios."""
    run = result.get("run", {})
    head = (
        f"Random-weight models (hidden 1024, 8 layers) in {result['dtype']} on the engine's "
        f"CPU kernels, {run.get('torch_threads', run.get('threads', '?'))} threads, context "
        f"{result['context']}, median of {result['trials']} interleaved trials; "
        f"{where_run(result)}. dense act: the MLP as wide as the k experts a "
        "token uses (same active parameters); dense tot: as wide as all experts (same total)."
    )
    step = {(r["shape"], r["role"], r["batch"]): r["step_ms"] for r in result["rows"]}
    rows = [
        [
            f"{r['shape']}-like",
            str(r["batch"]),
            *(f"{step[r['shape'], role, r['batch']]:.1f}" for role in MOE_ROLES),
            f"{r['moe_over_dense_active']:.2f}",
            f"{r['moe_over_dense_total']:.2f}",
        ]
        for r in result["ratios"]
    ]
    header = ["shape", "batch", "MoE ms", "dense act ms", "dense tot ms", "MoE / act", "MoE / tot"]
    return head + "\n\n" + markdown_table(header, rows, COMPACT)


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    shapes = sorted({r["shape"] for r in result["rows"]})
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 3.6), squeeze=False)
    for ax, shape in zip(axes[0], shapes, strict=True):
        for role in MOE_ROLES:
            rows = sorted(
                (r for r in result["rows"] if r["shape"] == shape and r["role"] == role),
                key=lambda r: r["batch"],
            )
            ax.plot([r["batch"] for r in rows], [r["step_ms"] for r in rows], "o-", label=role)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch")
        ax.set_ylabel("decode step ms")
        ax.set_title(f"{shape}-like MoE ({result['dtype']})")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark, prints its table and writes ``--out`` and its PNG."""
    p = argparse.ArgumentParser(prog="baton bench moe_decode", description=__doc__)
    p.add_argument("--shapes", type=csv_of(str), default=tuple(SHAPES))
    p.add_argument("--batches", type=csv_of(int), default=(1, GOAL_BATCH))
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "moe_decode.json")
    a = p.parse_args(argv)
    unknown = [s for s in a.shapes if s not in SHAPES]
    if unknown:
        p.error(f"unknown shapes {unknown}; expected some of {', '.join(SHAPES)}")
    result = run(a.shapes, a.batches, a.trials, a.context, a.steps)
    print_table(result)
    write_results(result, a.out, plot, threads=torch.get_num_threads())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
