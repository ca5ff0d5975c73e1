"""The README's result tables, one renderer per result file of bench/results/ (used by
bench/readme_results.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def engine_label(d: dict[str, Any]) -> str:
    """What ``bench/forward.py``'s engine column ran: the dtype, its quantisation and packing
    (``int8_max_rows``: results recorded before ``quantization`` replaced int8 by rows)."""
    parts = [d.get("dtype", "")]
    if d.get("quantization"):
        parts.append(f"{d['quantization']} weights")
    if d.get("int8_max_rows"):
        parts.append(f"int8 <= {d['int8_max_rows']} rows")
    if d.get("packed"):
        parts.append("packed weights")
    return ", ".join(parts)


def forward_table(d: dict[str, Any]) -> str:
    engine = "baton_engine_ms" in d["rows"][0]
    header = ["case", "baton ms", "transformers ms", "baton / transformers"]
    if engine:
        header += [
            f"baton as the engine builds it ({engine_label(d)}) ms",
            "transformers float32 ms",
            "engine / transformers float32",
        ]
    rows = []
    for r in d["rows"]:
        row = [
            r["case"],
            f"{r['baton_ms']:.1f}",
            f"{r['transformers_ms']:.1f}",
            f"{r['ratio']:.2f}",
        ]
        if engine:
            row += [
                f"{r['baton_engine_ms']:.1f}",
                f"{r['transformers_float32_ms']:.1f}",
                f"{r['engine_vs_transformers_float32']:.2f}",
            ]
        rows.append(row)
    return markdown_table(header, rows)


def throughput_table(d: dict[str, Any]) -> str:
    rows = []
    for r in d["rows"]:
        vs32 = r.get("ratio_vs_transformers_float32")
        rows.append(
            [
                r["dtype"],
                f"{r['baton']['tok_per_s']:.0f}",
                f"{r['transformers']['tok_per_s']:.0f}",
                f"{r['ratio']:.2f}",
                "" if vs32 is None else f"{vs32:.2f}",
            ]
        )
    header = ["dtype", "baton tok/s", "transformers tok/s", "same dtype", "vs transformers fp32"]
    caption = f"{d['num_prompts']} prompts x {d['output_len']} tokens, greedy.\n\n"
    return caption + markdown_table(header, rows)


def structured_table(d: dict[str, Any]) -> str:
    cfg = d["config"]
    rows = [
        [
            r["workload"],
            r["mode"],
            str(r["batch"]),
            f"{r['free_tpot_ms']:.1f}",
            f"{r['structured_tpot_ms']:.1f}",
            f"{r['ratio']:.3f}",
            f"{r['bitmask_ms_per_step']:.2f}",
            f"{r['stopped'] - len(r['invalid'])}/{r['stopped']}",
            str(len(r["errors"])),
        ]
        for r in d["rows"]
    ]
    header = [
        "schemas",
        "scheduling",
        "batch",
        "free TPOT ms",
        "JSON TPOT ms",
        "structured / free",
        "bitmask ms / step",
        "valid / stopped",
        "errors",
    ]
    caption = (
        f"Model {Path(cfg['model']).name}, greedy, at most {cfg['max_tokens']} tokens, "
        f"median of {cfg['rounds']} rounds; each round's free run decodes as many tokens per "
        "request as its structured run"
        + (
            ", and the structured TPOT is the mean of a run before and a run after the free one"
            if all("repeat_same" in r for r in d["rows"])
            else ""
        )
        + ". `peers`: the schema of `baton bench peers`; `shared`: "
        f"{len(cfg['sample'])} schemas of the shared data, mixed in each batch; {cfg['dtype']}. "
        f"Load average at the start: {cfg['load_avg'][0]:.1f}.\n\n"
    )
    notes = goal_lines(d.get("goals") or [], digits=3)
    notes += [f"- dropped at warm-up ({x['mode']}): {x['schema']}" for x in d.get("dropped", [])]
    return caption + markdown_table(header, rows) + ("\n\n" + "\n".join(notes) if notes else "")


def _cell(text: str) -> str:
    """``text`` as inline code that a Markdown table cell can hold."""
    return "`" + text.replace("`", "'").replace("|", "\\|") + "`"


def masks_table(d: dict[str, Any]) -> str:
    cfg = d["config"]
    names = list(d["families"])
    first = d["families"][names[0]]
    rows = []
    for family in first:
        row = [family]
        for n in names:
            s = d["families"][n][family]
            row.append(
                f"{num_cell(s['p50'], '.1f')} / {num_cell(s['p99'], '.1f')} / "
                f"{num_cell(s['max'], '.0f')}"
            )
        row.append(" / ".join(str(d["families"][n][family]["states"]) for n in names))
        rows.append(row)
    header = ["family", *(f"{n} p50 / p99 / max µs" for n in names), "states"]
    caption = (
        f"{cfg['schemas']} schemas and {cfg['tests']} instances of the shared data, each "
        f"walked with {cfg['rows']} matchers filled together per state; time per row. A state "
        "counts in every family it stands inside (`bench/mask_families.py`). Compiled: "
        + ", ".join(
            f"{n} {d['compiled'][n]['compiled']}/{d['compiled'][n]['schemas']}" for n in names
        )
        + (" (with allow_unenforced)" if cfg.get("allow_unenforced") else "")
        + f". Load average at the start: {cfg['load_avg'][0]:.1f}.\n\n"
    )
    worst_rows = []
    for n in names:
        for w in d["worst"][n][: 10 if n == names[0] else 3]:
            worst_rows.append(
                [n, w["schema"], f"{w['max_us']:.0f}", ", ".join(w["families"]), _cell(w["before"])]
            )
    worst = markdown_table(
        ["backend", "schema", "slowest state µs", "families", "after"], worst_rows
    )
    lines = goal_lines(d.get("goals") or [], digits=1)
    lines += [
        f"- slowest {g['goal'].split(' ')[0]} schema: {g['worst_schema']} "
        f"({g['worst_schema_us']:.0f} µs per row at its slowest state)"
        for g in d.get("goals") or []
        if g.get("worst_schema")
    ]
    return (
        caption
        + markdown_table(header, rows)
        + "\n\nThe schemas with the slowest states:\n\n"
        + worst
        + ("\n\n" + "\n".join(lines) if lines else "")
    )


def grammar_table(d: dict[str, Any]) -> str:
    summary = d["summary"]
    names = list(summary)
    metrics: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("schemas passing", lambda s: f"{s['passing']} ({s['passing_pct']:.1f}%)"),
        ("compiled", lambda s: str(s["compiled"])),
        ("compile errors (unsupported)", lambda s: f"{s['compile_errors']} ({s['unsupported']})"),
        ("time-outs / crashes", lambda s: f"{s['timeouts']} / {s['crashes']}"),
        ("valid rejected", lambda s: f"{s['valid_rejected']} of {s['valid_tests']}"),
        ("valid rejected by policy", lambda s: str(s.get("policy_rejected", "-"))),
        ("invalid accepted", lambda s: f"{s['invalid_accepted']} of {s['invalid_tests']}"),
        ("mask/accept mismatches", lambda s: str(s["mask_mismatches"])),
        (
            "compile ms avg / p50 / p99",
            lambda s: "{avg:.0f} / {p50:.1f} / {p99:.0f}".format(**s["compile_ms"]),
        ),
        (
            "mask µs/token avg / p50 / p99",
            lambda s: "{avg:.1f} / {p50:.1f} / {p99:.1f}".format(**s["mask_us"]),
        ),
    ]
    rows = [[label] + [fn(summary[n]) for n in names] for label, fn in metrics]
    text = markdown_table([""] + names, rows)
    text += (
        "\n\nValid rejected by policy: valid instances refused only because baton closes "
        "objects that do not say `additionalProperties` (invalid against the schema as "
        "`close_object_schemas` reads it); not counted as misses."
    )
    lenient = d.get("lenient")
    if lenient:
        text += "\n\n" + _grammar_lenient_table(lenient["summary"])
    return text


def _grammar_lenient_table(summary: dict[str, Any]) -> str:
    names = list(summary)
    metrics: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("schemas refused as unsupported", lambda s: str(s["schemas"])),
        ("compiled with strict: false", lambda s: str(s["compiled"])),
        ("still unsupported", lambda s: str(s["unsupported"])),
        ("time-outs / crashes", lambda s: f"{s['timeouts']} / {s['crashes']}"),
        ("invalid accepted", lambda s: f"{s['invalid_accepted']} of {s['invalid_tests']}"),
        ("valid rejected (policy)", lambda s: f"{s['valid_rejected']} ({s['policy_rejected']})"),
    ]
    rows = [[label] + [fn(summary[n]) for n in names] for label, fn in metrics]
    return (
        "Lenient mode (`strict: false`, `allow_unenforced`) on the schemas each refused as "
        "unsupported: the keywords it does not enforce are dropped, so invalid instances may "
        "be accepted (counted apart from the strict figures above).\n\n"
        + markdown_table([""] + names, rows)
    )


def grammar_overhead_table(d: dict[str, Any]) -> str:
    rows = [
        [
            "1",
            f"{d['raw_us_per_token']:.1f}",
            f"{d['wrapper_us_per_token']:.1f}",
            f"{d['ratio']:.2f}",
        ],
        [
            str(d["batch"]),
            f"{d['batch_raw_us_per_token']:.1f}",
            f"{d['batch_wrapper_us_per_token']:.1f}",
            f"{d['batch_ratio']:.2f}",
        ],
    ]
    return markdown_table(["batch", "raw xgrammar µs/token", "baton µs/token", "ratio"], rows)


def pct_cell(value: float | None) -> str:
    """A share as a whole percentage; "-" for none."""
    return "-" if value is None else f"{value:.0%}"


def num_cell(value: float | None, spec: str) -> str:
    """A number in ``spec``'s format; "-" for none."""
    return "-" if value is None else format(value, spec)


def goal_lines(goals: list[Any], digits: int = 2) -> list[str]:
    """One line per goal: met, MISSED (with the measured value) or not measured."""
    lines = []
    for g in goals:
        if not isinstance(g, dict):
            continue
        if g.get("value") is None:
            lines.append(f"- not measured: {g['goal']} {g['target']}")
        else:
            verdict = "met" if g["met"] else "MISSED"
            lines.append(f"- {verdict}: {g['goal']} {g['target']}: {g['value']:.{digits}f}")
    return lines


def _spread(r: dict[str, Any]) -> str:
    if r.get("tok_per_s_min") is None or r.get("runs", 1) < 2:
        return "-"
    return f"{r['tok_per_s_min']:.1f}-{r['tok_per_s_max']:.1f}"


def peers_table(d: dict[str, Any]) -> str:
    rows = [
        [
            r["label"],
            str(r["concurrency"]),
            num_cell(r["tok_per_s"], ".1f"),
            _spread(r),
            num_cell(r["tpot_ms"], ".1f"),
            pct_cell(r["valid_share"]),
        ]
        for r in d["rows"]
    ]
    header = ["engine", "concurrency", "output tok/s", "spread", "TPOT ms", "valid JSON"]
    table = markdown_table(header, rows)
    skipped = [f"- skipped {s['label']}: {s['reason']}" for s in d.get("skipped", [])]
    repeats = d.get("repeats", 1)
    runs = (
        f" {repeats} runs, the engines' order reversed every other run; medians, with the "
        "spread of output tok/s over the runs."
        if repeats > 1
        else ""
    )
    caption = (
        f"The same JSON-schema workload (same token ids, greedy, at most {d['max_tokens']} "
        f"tokens) on every engine, measured in one run; baton and its Python peers in the same "
        f"dtype, llama-cpp-python on the GGUF's own quantized weights.{runs}"
        + (
            f" baton with its defaults: speculative decoding {d['baton_speculative']}."
            if "baton_speculative" in d
            else ""
        )
        + "\n\n"
    )
    notes = goal_lines(d.get("goals") or []) + skipped
    return caption + table + ("\n\n" + "\n".join(notes) if notes else "")


def serve_table(d: dict[str, Any]) -> str:
    rows = [
        [
            str(r["concurrency"]),
            f"{r['done']}/{r['issued']}",
            num_cell(r["tok_per_s"], ".0f"),
            f"{num_cell(r['ttft_p50_ms'], '.0f')} / {num_cell(r['ttft_p99_ms'], '.0f')}",
            f"{num_cell(r['tpot_p50_ms'], '.1f')} / {num_cell(r['tpot_p99_ms'], '.1f')}",
            f"{r['json_valid']}/{r['json_checked']}",
            str(r.get("json_length_cut", "-")),
        ]
        for r in d["rows"]
    ]
    header = [
        "concurrency",
        "done",
        "output tok/s",
        "TTFT p50 / p99 ms",
        "TPOT p50 / p99 ms",
        "valid JSON / stopped",
        "JSON cut by length",
    ]
    caption = (
        f"Streaming clients against `baton serve` over loopback: model {d['model']} "
        f"({d['dtype']}), {d['json_fraction']:.0%} JSON-schema requests, at most "
        f"{d['max_tokens']} tokens each.\n\n"
    )
    return caption + markdown_table(header, rows)


def soak_table(d: dict[str, Any]) -> str:
    # Results from before the worker processes were sampled measured the server alone.
    samples = d.get("samples") or [{}]
    whose = "server + workers" if "server_rss_mb" in samples[0] else "server process"
    f, c = d["figures"], d["config"]
    rows = [
        ["requests sent", f"{f['requests_sent']} in {f['seconds']:.0f} s"],
        ["valid requests completed", f"{f['valid_completed']} / {f['valid']}"],
        [
            "structured outputs checked / invalid",
            f"{f['structured_stopped_checked']} / {f['structured_invalid_output']}",
        ],
        ["invalid requests answered 400", f"{f['invalid_400']} / {f['invalid']}"],
        ["clients that hung up, ended cleanly", f"{f['disconnect_clean']} / {f['disconnect']}"],
        ["5xx responses", str(f["http_5xx"])],
        ["KV blocks free after", f"{f['kv_free_blocks']:.0f} / {f['kv_total_blocks']:.0f}"],
        [f"RSS growth ({whose}), first to last quarter", f"{f['rss_growth']:.1%}"],
        ["/health after, SIGTERM exit code", f"{f['health_after']}, {f['sigterm_exit_code']}"],
    ]
    failed = [name for name, ok in d["criteria"].items() if not ok]
    verdict = "passed" if d["passed"] else "FAILED: " + ", ".join(failed)
    caption = (
        f"{c['requests']} mixed requests at concurrency {c['concurrency']} on model "
        f"{c['model']}, at most {c['max_tokens']} tokens each: {verdict}.\n\n"
    )
    return caption + markdown_table(["figure", "value"], rows)


def tensor_parallel_table(d: dict[str, Any]) -> str:
    c = d["config"]
    caption = (
        f"Greedy decode, {c['output_len']} tokens per request, float32, sync scheduling, on "
        f"{c['cpu_cores']} cores; collectives: rank 0's time in all-reduces, the logits gather "
        "and the token broadcast (waiting for the other ranks included) over its device time."
        "\n\n"
    )
    rows = [
        [
            r["model"],
            str(r["batch"]),
            f"{r['tp']} x {r['threads_per_rank']}",
            f"{r['step_ms']:.1f}",
            f"{100 * r['collective_share']:.0f}%" if r["tp"] > 1 else "-",
        ]
        for r in d["rows"]
    ]
    header = ["model", "batch", "ranks x threads", "ms / step", "collectives"]
    return caption + markdown_table(header, rows)


def compile_burst_table(d: dict[str, Any]) -> str:
    rows = []
    for r in d["runs"]:
        causes = ", ".join(f"{n} {c}" for c, n in sorted(r["error_causes"].items())) or "-"
        rows.append(
            [
                r["label"],
                r["run"]["commit"][:10],
                str(r["hog_processes"]),
                f"{r['accepted']} of {r['schemas']}",
                f"{r['finishes'].get('stop', 0)} / {r['finishes'].get('length', 0)}",
                f"{r['errors']} ({causes})",
                f"{r['wall_s']:.0f}",
                f"{r['load_avg_before'][0]:.1f}" if r.get("load_avg_before") else "",
            ]
        )
    header = [
        "run",
        "commit",
        "busy processes",
        "schemas accepted",
        "stop / length",
        '"error" finishes',
        "wall s",
        "load before",
    ]
    caption = (
        "Every shared schema that passes submission, each once, in one `LLM.generate` call on "
        "a tiny random-weight model (grammar compile limit 10 s); beside it, busy-looping "
        "processes when the run says so.\n\n"
    )
    return caption + markdown_table(header, rows)


def data_parallel_table(d: dict[str, Any]) -> str:
    c = d["config"]
    caption = (
        f"Throughput: {c['requests']} greedy requests, {c['max_tokens']} tokens each, "
        f"{c['concurrency']} at a time, default model and dtype. Grammar affinity: "
        f"{c['schemas']} JSON-Schema test suite schemas x {c['repeats']} requests, shuffled, "
        "2 replicas with empty caches; hit rate = (cache hits + joined compiles) / lookups over "
        "both replicas.\n\n"
    )
    rows = [[r["label"], f"{r['tok_s']:.1f}", str(r["failures"])] for r in d["throughput"]]
    table = markdown_table(["engine", "output tok/s", "failed"], rows)
    rows = [
        [
            r["label"],
            f"{100 * r['cache_hit_rate']:.1f}%",
            " + ".join(str(int(n)) for n in r["grammars_compiled"]),
            str(r["failures"]),
            f"{r['wall_s']:.1f}",
        ]
        for r in d["affinity"]
    ]
    header = ["routing", "cache hit rate", "grammars compiled", "failed", "wall s"]
    return caption + table + "\n\n" + markdown_table(header, rows)


def open_objects_table(d: dict[str, Any]) -> str:
    c = d["config"]
    caption = (
        f"{c['schemas']} SchemaStore schemas with an object that declares properties and says "
        "nothing of others (JSON Schema: open; xgrammar's strict mode: closed), the default "
        f"model ({c['dtype']}), greedy, at most {c['max_tokens']} tokens, one chat request per "
        "schema and backend.\n\n"
    )
    rows = [
        [
            r["backend"],
            str(r["stopped"]),
            str(r["cut"]),
            str(r["valid"]),
            f"{r['with_undeclared']} ({r['undeclared_keys']} keys)",
            str(r["tokens"]),
        ]
        for r in d["rows"]
    ]
    header = [
        "backend",
        "ended by itself",
        "cut at the limit",
        "valid",
        "with undeclared keys",
        "tokens",
    ]
    return caption + markdown_table(header, rows)
