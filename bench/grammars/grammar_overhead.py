"""Grammar layer overhead: mask fill + accept per token, baton's wrapper vs raw xgrammar.

Same compiled grammars, same token walks (valid instances of the shared
schemas), the two interleaved schema by schema. Prints µs per token for each
and the overhead ratio (goal: wrapper <= 1.10 x raw); writes JSON.

    python -m baton.bench.grammars.grammar_overhead [--data PATH] [--limit 60]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import xgrammar as xgr

from baton.bench.common import add_common_args, write_results
from baton.bench.plotting import pyplot
from baton.engine.loader import load_tokenizer
from baton.grammar.backend import GrammarError, allocate_bitmask
from baton.grammar.spec import StructuredOutputsParams
from baton.grammar.xgrammar.backend import XGrammarBackend

DEFAULT_DATA = Path(
    os.environ.get("BATON_DATA_DIR", Path(__file__).resolve().parents[3] / "shared" / "data")
)


def walks(tokenizer, backend, data: Path, limit: int):
    """(compiled grammar, token ids) for valid instances the grammar accepts."""
    out = []
    for path in sorted((data / "schemastore").glob("*.json")):
        doc = json.loads(path.read_text())
        spec = StructuredOutputsParams(json=doc["schema"], allow_unenforced=True)
        try:
            compiled = backend.compile(spec)
        except GrammarError:
            continue
        for test in doc.get("tests", []):
            if not test.get("valid"):
                continue
            text = json.dumps(test["data"], separators=(",", ":"), ensure_ascii=False)
            ids = tokenizer.encode(text, add_special_tokens=False)
            if compiled.new_matcher().validate_tokens(ids) == len(ids):
                out.append((compiled, ids))
                break
        if len(out) >= limit:
            break
    return out


def time_raw(compiled, ids, vocab_size: int) -> float:
    matcher = xgr.GrammarMatcher(compiled.compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    t0 = time.perf_counter()
    for tok in ids:
        matcher.fill_next_token_bitmask(bitmask, 0)
        matcher.accept_token(tok)
    return time.perf_counter() - t0


def time_wrapper(backend, compiled, ids, vocab_size: int) -> float:
    matcher = compiled.new_matcher()
    bitmask = allocate_bitmask(1, vocab_size)
    t0 = time.perf_counter()
    for tok in ids:
        backend.fill_bitmasks([matcher], bitmask, [0])
        matcher.accept_tokens([tok])
    return time.perf_counter() - t0


def time_raw_batch(group, vocab_size: int) -> tuple[float, int]:
    """Rows advanced together, as in an engine step: one native batch fill per step."""
    steps = min(len(ids) for _, ids in group)
    matchers = [xgr.GrammarMatcher(c.compiled) for c, _ in group]
    batch = xgr.BatchGrammarMatcher(1)
    bitmask = xgr.allocate_token_bitmask(len(group), vocab_size)
    rows = list(range(len(group)))
    t0 = time.perf_counter()
    for i in range(steps):
        batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        for m, (_, ids) in zip(matchers, group, strict=True):
            m.accept_token(ids[i])
    return time.perf_counter() - t0, steps * len(group)


def time_wrapper_batch(backend, group, vocab_size: int) -> tuple[float, int]:
    steps = min(len(ids) for _, ids in group)
    matchers = [c.new_matcher() for c, _ in group]
    bitmask = allocate_bitmask(len(group), vocab_size)
    rows = list(range(len(group)))
    t0 = time.perf_counter()
    for i in range(steps):
        backend.fill_bitmasks(matchers, bitmask, rows)
        for m, (_, ids) in zip(matchers, group, strict=True):
            m.accept_tokens([ids[i]])
    return time.perf_counter() - t0, steps * len(group)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, default=DEFAULT_DATA)
    p.add_argument("--limit", type=int, default=60, help="schemas to walk")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch", type=int, default=16, help="rows per step in the batched case")
    add_common_args(p, "grammar_overhead", model=False, dtype=None)
    a = p.parse_args(argv)
    tokenizer = load_tokenizer()
    vocab = 49152
    backend = XGrammarBackend(tokenizer, vocab, dynamic_compilation=False)
    cases = walks(tokenizer, backend, a.data, a.limit)
    raw_s = wrap_s = 0.0
    tokens = 0
    for compiled, ids in cases:
        for _ in range(a.repeats):  # interleaved
            raw_s += time_raw(compiled, ids, vocab)
            wrap_s += time_wrapper(backend, compiled, ids, vocab)
            tokens += len(ids)
    braw = bwrap = 0.0
    btokens = 0
    for start in range(0, len(cases) - a.batch + 1, a.batch):
        group = cases[start : start + a.batch]
        for _ in range(a.repeats):
            t, n = time_raw_batch(group, vocab)
            braw += t
            t, _ = time_wrapper_batch(backend, group, vocab)
            bwrap += t
            btokens += n
    result = {
        "schemas": len(cases),
        "tokens": tokens,
        "raw_us_per_token": raw_s / tokens * 1e6,
        "wrapper_us_per_token": wrap_s / tokens * 1e6,
        "ratio": wrap_s / raw_s,
        "batch": a.batch,
        "batch_tokens": btokens,
        "batch_raw_us_per_token": braw / max(btokens, 1) * 1e6,
        "batch_wrapper_us_per_token": bwrap / max(btokens, 1) * 1e6,
        "batch_ratio": bwrap / braw if braw else float("nan"),
    }
    print(
        f"{result['schemas']} schemas, batch 1, {tokens} tokens: raw xgrammar "
        f"{result['raw_us_per_token']:.1f} µs/token, baton wrapper "
        f"{result['wrapper_us_per_token']:.1f} µs/token, ratio {result['ratio']:.3f}"
    )
    print(
        f"batch {a.batch}, {btokens} tokens: raw xgrammar "
        f"{result['batch_raw_us_per_token']:.1f} µs/token, baton wrapper "
        f"{result['batch_wrapper_us_per_token']:.1f} µs/token, ratio {result['batch_ratio']:.3f}"
    )
    write_results(result, a.out, _plot)
    return 0


def _plot(result: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(4.5, 3))
    names = ["raw xgrammar", "baton wrapper"]
    values = [result["raw_us_per_token"], result["wrapper_us_per_token"]]
    ax.bar(names, values, color=["tab:gray", "tab:blue"])
    ax.set_ylabel("µs per token (fill + accept)")
    ax.set_title(f"{result['schemas']} schemas, ratio {result['ratio']:.2f}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
