"""The README's result tables, one renderer per result file of bench/results/ (used by
bench/readme/readme_results.py), each a caption and its tables declared column by column
(bench/tables.py renders them)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from baton.bench.tables import (
    Column,
    code_cell,
    fixed,
    goal_lines,
    markdown_table,
    num_cell,
    pct_cell,
    section,
    string,
    table,
    text,
)


def engine_label(d: dict[str, Any]) -> str:
    """What ``bench/offline/forward.py``'s engine column ran: the dtype, its quantisation and
    packing (``int8_max_rows``: results recorded before ``quantization`` replaced int8 by rows)."""
    parts = [d.get("dtype", "")]
    if d.get("quantization"):
        parts.append(f"{d['quantization']} weights")
    if d.get("int8_max_rows"):
        parts.append(f"int8 <= {d['int8_max_rows']} rows")
    if d.get("packed"):
        parts.append("packed weights")
    return ", ".join(parts)


def forward_table(d: dict[str, Any]) -> str:
    columns = [
        Column("case", string("case")),
        Column("baton ms", fixed("baton_ms", ".1f")),
        Column("transformers ms", fixed("transformers_ms", ".1f")),
        Column("baton / transformers", fixed("ratio", ".2f")),
    ]
    if "baton_engine_ms" in d["rows"][0]:
        columns += [
            Column(
                f"baton as the engine builds it ({engine_label(d)}) ms",
                fixed("baton_engine_ms", ".1f"),
            ),
            Column("transformers float32 ms", fixed("transformers_float32_ms", ".1f")),
            Column("engine / transformers float32", fixed("engine_vs_transformers_float32", ".2f")),
        ]
    return table(d["rows"], columns)


THROUGHPUT = (
    Column("dtype", string("dtype")),
    Column("baton tok/s", lambda r: f"{r['baton']['tok_per_s']:.0f}"),
    Column("transformers tok/s", lambda r: f"{r['transformers']['tok_per_s']:.0f}"),
    Column("same dtype", fixed("ratio", ".2f")),
    Column(
        "vs transformers fp32",
        lambda r: "" if (x := r.get("ratio_vs_transformers_float32")) is None else f"{x:.2f}",
    ),
)


def throughput_table(d: dict[str, Any]) -> str:
    rows = table(d["rows"], THROUGHPUT)
    caption = f"{d['num_prompts']} prompts x {d['output_len']} tokens, greedy.\n\n"
    return section(caption, rows)


STRUCTURED = (
    Column("schemas", string("workload")),
    Column("scheduling", string("mode")),
    Column("batch", text("batch")),
    Column("free TPOT ms", fixed("free_tpot_ms", ".1f")),
    Column("JSON TPOT ms", fixed("structured_tpot_ms", ".1f")),
    Column("structured / free", fixed("ratio", ".3f")),
    Column("bitmask ms / step", fixed("bitmask_ms_per_step", ".2f")),
    Column("valid / stopped", lambda r: f"{r['stopped'] - len(r['invalid'])}/{r['stopped']}"),
    Column("errors", lambda r: str(len(r["errors"]))),
)


def structured_table(d: dict[str, Any]) -> str:
    rows = table(d["rows"], STRUCTURED)
    cfg = d["config"]
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
    return section(caption, rows, notes=notes)


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
        "counts in every family it stands inside (`bench/grammars/mask_families.py`). Compiled: "
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
                [
                    n,
                    w["schema"],
                    f"{w['max_us']:.0f}",
                    ", ".join(w["families"]),
                    code_cell(w["before"]),
                ]
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
    slowest = "The schemas with the slowest states:"
    return section(caption, markdown_table(header, rows), slowest, worst, notes=lines)


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


def _spread(r: dict[str, Any]) -> str:
    if r.get("tok_per_s_min") is None or r.get("runs", 1) < 2:
        return "-"
    return f"{r['tok_per_s_min']:.1f}-{r['tok_per_s_max']:.1f}"


PEERS = (
    Column("engine", string("label")),
    Column("concurrency", text("concurrency")),
    Column("output tok/s", lambda r: num_cell(r["tok_per_s"], ".1f")),
    Column("spread", _spread),
    Column("TPOT ms", lambda r: num_cell(r["tpot_ms"], ".1f")),
    Column("valid JSON", lambda r: pct_cell(r["valid_share"])),
)


def peers_table(d: dict[str, Any]) -> str:
    rows = table(d["rows"], PEERS)
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
    return section(caption, rows, notes=goal_lines(d.get("goals") or []) + skipped)


def _p50_p99(key: str, spec: str) -> Callable[[dict[str, Any]], str]:
    return lambda r: f"{num_cell(r[f'{key}_p50_ms'], spec)} / {num_cell(r[f'{key}_p99_ms'], spec)}"


SERVE = (
    Column("concurrency", text("concurrency")),
    Column("done", lambda r: f"{r['done']}/{r['issued']}"),
    Column("output tok/s", lambda r: num_cell(r["tok_per_s"], ".0f")),
    Column("TTFT p50 / p99 ms", _p50_p99("ttft", ".0f")),
    Column("TPOT p50 / p99 ms", _p50_p99("tpot", ".1f")),
    Column("valid JSON / stopped", lambda r: f"{r['json_valid']}/{r['json_checked']}"),
    Column("JSON cut by length", lambda r: str(r.get("json_length_cut", "-"))),
)


def serve_table(d: dict[str, Any]) -> str:
    rows = table(d["rows"], SERVE)
    caption = (
        f"Streaming clients against `baton serve` over loopback: model {d['model']} "
        f"({d['dtype']}), {d['json_fraction']:.0%} JSON-schema requests, at most "
        f"{d['max_tokens']} tokens each.\n\n"
    )
    return section(caption, rows)


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
    return section(caption, markdown_table(["figure", "value"], rows))


TENSOR_PARALLEL = (
    Column("model", string("model")),
    Column("batch", text("batch")),
    Column("ranks x threads", lambda r: f"{r['tp']} x {r['threads_per_rank']}"),
    Column("ms / step", fixed("step_ms", ".1f")),
    Column("collectives", lambda r: f"{100 * r['collective_share']:.0f}%" if r["tp"] > 1 else "-"),
)


def tensor_parallel_table(d: dict[str, Any]) -> str:
    c = d["config"]
    caption = (
        f"Greedy decode, {c['output_len']} tokens per request, float32, sync scheduling, on "
        f"{c['cpu_cores']} cores; collectives: rank 0's time in all-reduces, the logits gather "
        "and the token broadcast (waiting for the other ranks included) over its device time."
        "\n\n"
    )
    return section(caption, table(d["rows"], TENSOR_PARALLEL))


def _errors(r: dict[str, Any]) -> str:
    causes = ", ".join(f"{n} {c}" for c, n in sorted(r["error_causes"].items())) or "-"
    return f"{r['errors']} ({causes})"


COMPILE_BURST = (
    Column("run", string("label")),
    Column("commit", lambda r: r["run"]["commit"][:10]),
    Column("busy processes", text("hog_processes")),
    Column("schemas accepted", lambda r: f"{r['accepted']} of {r['schemas']}"),
    Column(
        "stop / length",
        lambda r: f"{r['finishes'].get('stop', 0)} / {r['finishes'].get('length', 0)}",
    ),
    Column('"error" finishes', _errors),
    Column("wall s", fixed("wall_s", ".0f")),
    Column(
        "load before",
        lambda r: f"{r['load_avg_before'][0]:.1f}" if r.get("load_avg_before") else "",
    ),
)


def compile_burst_table(d: dict[str, Any]) -> str:
    rows = table(d["runs"], COMPILE_BURST)
    caption = (
        "Every shared schema that passes submission, each once, in one `LLM.generate` call on "
        "a tiny random-weight model (grammar compile limit 10 s); beside it, busy-looping "
        "processes when the run says so.\n\n"
    )
    return section(caption, rows)


DATA_PARALLEL_THROUGHPUT = (
    Column("engine", string("label")),
    Column("output tok/s", fixed("tok_s", ".1f")),
    Column("failed", text("failures")),
)
DATA_PARALLEL_AFFINITY = (
    Column("routing", string("label")),
    Column("cache hit rate", lambda r: f"{100 * r['cache_hit_rate']:.1f}%"),
    Column("grammars compiled", lambda r: " + ".join(str(int(n)) for n in r["grammars_compiled"])),
    Column("failed", text("failures")),
    Column("wall s", fixed("wall_s", ".1f")),
)


def data_parallel_table(d: dict[str, Any]) -> str:
    c = d["config"]
    caption = (
        f"Throughput: {c['requests']} greedy requests, {c['max_tokens']} tokens each, "
        f"{c['concurrency']} at a time, default model and dtype. Grammar affinity: "
        f"{c['schemas']} JSON-Schema test suite schemas x {c['repeats']} requests, shuffled, "
        "2 replicas with empty caches; hit rate = (cache hits + joined compiles) / lookups over "
        "both replicas.\n\n"
    )
    throughput = table(d["throughput"], DATA_PARALLEL_THROUGHPUT)
    return section(caption, throughput, table(d["affinity"], DATA_PARALLEL_AFFINITY))


OPEN_OBJECTS = (
    Column("backend", string("backend")),
    Column("ended by itself", text("stopped")),
    Column("cut at the limit", text("cut")),
    Column("valid", text("valid")),
    Column(
        "with undeclared keys", lambda r: f"{r['with_undeclared']} ({r['undeclared_keys']} keys)"
    ),
    Column("tokens", text("tokens")),
)


def open_objects_table(d: dict[str, Any]) -> str:
    c = d["config"]
    caption = (
        f"{c['schemas']} SchemaStore schemas with an object that declares properties and says "
        "nothing of others (JSON Schema: open; xgrammar's strict mode: closed), the default "
        f"model ({c['dtype']}), greedy, at most {c['max_tokens']} tokens, one chat request per "
        "schema and backend.\n\n"
    )
    return section(caption, table(d["rows"], OPEN_OBJECTS))
