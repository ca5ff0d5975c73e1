"""What each JSON backend's reading of open objects does to the model's output.

JSON Schema leaves an object with declared ``properties`` and no ``additionalProperties``
open to other keys; baton closes it by default in every backend, and a request opens it with
``open_objects``. This compares xgrammar with the default (closed) against llguidance
(``guidance``) with ``open_objects``. This runs the default model on the shared
SchemaStore schemas that have such an object and that both backends take (``--schemas`` of
them, evenly spaced by name), greedy, one request per schema and backend, the same chat
prompt for both ("Write an example JSON document for the schema 'TITLE'."), at most
``--max-tokens`` tokens, and counts per backend: outputs that ended by themselves, outputs cut
at the token limit, those valid against the schema (``jsonschema``), and keys the schema
declares nowhere (the open objects' doing). The question it answers: whether open objects
(fewer valid instances refused by the grammar) cost output quality.

    baton bench open_objects [--schemas 40] [--max-tokens 256]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import jsonschema

from baton.bench.common import add_common_args, write_results
from baton.bench.grammars.grammar import default_data_dir
from baton.bench.plotting import pyplot
from baton.engine import LLM, SamplingParams, StructuredOutputsParams

BACKENDS = ("xgrammar", "guidance")
BATCH = 16


def _walk(node: Any) -> list[dict[str, Any]]:
    """Every dict below ``node`` (itself included)."""
    out: list[dict[str, Any]] = []
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, dict):
            out.append(n)
            stack.extend(n.values())
        elif isinstance(n, list):
            stack.extend(n)
    return out


def has_open_object(schema: Any) -> bool:
    """Whether some object in ``schema`` declares properties and says nothing of others."""
    return any(
        isinstance(n.get("properties"), dict)
        and n["properties"]
        and "additionalProperties" not in n
        and "unevaluatedProperties" not in n
        for n in _walk(schema)
    )


def declared_keys(schema: Any) -> set[str]:
    """Every property name the schema declares anywhere."""
    keys: set[str] = set()
    for n in _walk(schema):
        if isinstance(n.get("properties"), dict):
            keys.update(n["properties"])
    return keys


def undeclared(value: Any, keys: set[str]) -> int:
    """Keys of objects in ``value`` that are not in ``keys``."""
    count = 0
    for n in _walk(value):
        count += sum(1 for k in n if k not in keys)
    return count


def pick_schemas(llm: LLM, data: Path, count: int) -> list[tuple[str, dict[str, Any]]]:
    """``count`` SchemaStore schemas with an open object that every backend accepts."""
    found = []
    for path in sorted((data / "schemastore").glob("*.json")):
        schema = json.loads(path.read_text())["schema"]
        if not isinstance(schema, dict) or not has_open_object(schema):
            continue
        try:
            for backend in BACKENDS:
                spec = StructuredOutputsParams(
                    json=schema, backend=backend, open_objects=backend == "guidance"
                )
                llm.engine.validate_params(SamplingParams(structured_outputs=spec))
        except ValueError:
            continue
        found.append((path.stem, schema))
    step = max(1, len(found) // count)
    return found[::step][:count]


def run_backend(
    llm: LLM, cases: list[tuple[str, dict[str, Any]]], backend: str, max_tokens: int
) -> dict[str, Any]:
    """One greedy request per schema on ``backend``; the counts."""
    tok = llm.get_tokenizer()
    prompts, params = [], []
    for name, schema in cases:
        title = schema.get("title") if isinstance(schema.get("title"), str) else name
        content = f"Write an example JSON document for the schema '{title}'."
        prompts.append(tok.apply_chat_template([{"role": "user", "content": content}]))
        spec = StructuredOutputsParams(
            json=schema, backend=backend, open_objects=backend == "guidance"
        )
        params.append(
            SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_outputs=spec)
        )
    t0 = time.perf_counter()
    outs = []
    for i in range(0, len(prompts), BATCH):
        outs += llm.generate(prompts[i : i + BATCH], params[i : i + BATCH], use_tqdm=False)
    row = {"backend": backend, "schemas": len(cases), "stopped": 0, "cut": 0, "errors": 0}
    row.update(valid=0, with_undeclared=0, undeclared_keys=0, tokens=0)
    for (_, schema), out in zip(cases, outs, strict=True):
        c = out.outputs[0]
        row["tokens"] += len(c.token_ids)
        if c.finish_reason == "length":
            row["cut"] += 1
            continue
        if c.finish_reason != "stop":
            row["errors"] += 1
            continue
        row["stopped"] += 1
        try:
            value = json.loads(c.text)
            jsonschema.validate(value, schema)
        except (ValueError, jsonschema.ValidationError, jsonschema.SchemaError):
            continue
        row["valid"] += 1
        extra = undeclared(value, declared_keys(schema))
        row["undeclared_keys"] += extra
        row["with_undeclared"] += extra > 0
    row["seconds"] = time.perf_counter() - t0
    return row


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    rows = result["rows"]
    labels = ["ended by itself", "cut at the limit", "with undeclared keys"]
    keys = ["stopped", "cut", "with_undeclared"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / len(rows)
    for j, row in enumerate(rows):
        xs = [i + j * width for i in range(len(keys))]
        ax.bar(xs, [row[k] for k in keys], width, label=row["backend"])
    ax.set_xticks([i + width * (len(rows) - 1) / 2 for i in range(len(keys))], labels)
    ax.set_ylabel(f"outputs (of {rows[0]['schemas']} schemas)")
    ax.set_title(
        "Open objects: xgrammar (closed) vs guidance (open_objects), default model, greedy"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="baton bench open_objects", description=__doc__)
    add_common_args(parser, "open_objects", model=False, dtype=None)
    parser.add_argument("--schemas", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--data", type=Path, default=None, help="shared data folder")
    args = parser.parse_args(argv)
    llm = LLM(max_model_len=2048, enable_prefix_caching=False)
    try:
        cases = pick_schemas(llm, args.data or default_data_dir(), args.schemas)
        rows = []
        for backend in BACKENDS:
            rows.append(run_backend(llm, cases, backend, args.max_tokens))
            print({k: round(v, 1) if isinstance(v, float) else v for k, v in rows[-1].items()})
        dtype = str(llm.stats()["dtype"])
    finally:
        llm.shutdown()
    result = {
        "config": {"schemas": len(cases), "max_tokens": args.max_tokens, "dtype": dtype},
        "cases": [name for name, _ in cases],
        "rows": rows,
    }
    write_results(result, args.out, plot, dtype=dtype)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
