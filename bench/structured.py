"""Structured vs free decoding cost on the same engine, in one run.

For each batch size, the same prompts run twice: free text (EOS ignored) and
100% JSON-schema constrained. Reports TPOT (mean time per output token after
the first, per request) and the ratio structured / free (goal <= 1.10).

    python -m baton.bench.structured [--batches 1,8,32] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from baton.bench.forward import RESULTS
from baton.bench.plotting import pyplot, save_results
from baton.engine import LLM, SamplingParams, StructuredOutputsParams
from baton.engine.loader import load_checkpoint

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 40},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 8},
        "bio": {"type": "string"},
    },
    "required": ["name", "age", "city", "hobbies", "bio"],
}


def prompts(n: int) -> list[list[dict[str, str]]]:
    people = ["a baker", "a pilot", "a chess player", "a gardener", "a painter", "a doctor"]
    return [
        [
            {
                "role": "user",
                "content": f"Invent {people[i % len(people)]} (#{i}) and describe them as JSON.",
            }
        ]
        for i in range(n)
    ]


def tpot(outs) -> float:
    values = [o.metrics.time_per_output_token for o in outs]
    values = [v for v in values if v is not None]
    return statistics.mean(values) if values else float("nan")


def run_case(llm: LLM, batch: int, max_tokens: int, structured: bool) -> dict:
    spec = StructuredOutputsParams(json=SCHEMA) if structured else None
    sp = SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=not structured, structured_outputs=spec
    )
    t0 = time.perf_counter()
    outs = llm.chat(prompts(batch), sp, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    valid = 0
    if structured:
        for o in outs:
            try:
                json.loads(o.outputs[0].text)
                valid += o.outputs[0].finish_reason == "stop"
            except json.JSONDecodeError:
                pass
    return {"tpot_ms": tpot(outs) * 1e3, "tokens": tokens, "seconds": elapsed, "valid": valid}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", type=Path, default=RESULTS / "structured.json")
    a = p.parse_args(argv)
    ckpt = load_checkpoint(a.model)
    llm = LLM.from_checkpoint(ckpt, max_model_len=1024, max_num_seqs=64)
    run_case(llm, 2, 8, True)  # warm-up: compiles and caches the grammar
    rows = []
    for batch in (int(b) for b in a.batches.split(",")):
        free, structured = [], []
        for _ in range(a.repeats):  # interleaved
            free.append(run_case(llm, batch, a.max_tokens, False))
            structured.append(run_case(llm, batch, a.max_tokens, True))
        f = statistics.median(r["tpot_ms"] for r in free)
        s = statistics.median(r["tpot_ms"] for r in structured)
        rows.append(
            {
                "batch": batch,
                "free_tpot_ms": f,
                "structured_tpot_ms": s,
                "ratio": s / f,
                "structured_valid": structured[-1]["valid"],
            }
        )
        print(
            f"batch {batch:>3}: free {f:7.2f} ms  structured {s:7.2f} ms  ratio {s / f:5.2f}  "
            f"valid {structured[-1]['valid']}/{batch}"
        )
    result = {"model": str(ckpt.path), "threads": torch.get_num_threads(), "rows": rows}
    save_results(result, a.out, _plot)
    return 0


def _plot(result: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    rows = result["rows"]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.bar([i - 0.2 for i in x], [r["free_tpot_ms"] for r in rows], 0.4, label="free")
    ax.bar([i + 0.2 for i in x], [r["structured_tpot_ms"] for r in rows], 0.4, label="JSON schema")
    ax.set_xticks(list(x), [f"batch {r['batch']}" for r in rows])
    ax.set_ylabel("TPOT (ms)")
    ax.legend()
    ax.set_title("Structured vs free TPOT, same engine, same run")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
