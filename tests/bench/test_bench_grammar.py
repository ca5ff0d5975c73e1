"""``baton bench grammar``: input formats, the walk's verdicts, the summary, and that a crashing,
exiting or hanging backend is recorded while the run goes on.

The fake backends below are module-level classes so that the spawned workers can unpickle them
(by this module's name, which pytest puts on ``sys.path``).
"""

from __future__ import annotations

import csv
import json
import os
import resource
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
import torch

from baton.bench.grammars.grammar import (
    BACKENDS,
    GrammarBenchConfig,
    load_cases,
    main,
    parse_schema_file,
    run_benchmark,
)
from baton.bench.grammars.grammar_report import auto_rows, format_report
from baton.bench.grammars.grammar_worker import fed_as_written, serialize_instance
from baton.bench.readme.readme_tables import grammar_table
from baton.grammar.backend import CompiledGrammar, GrammarBackend, GrammarMatcher
from baton.grammar.spec import StructuredOutputsParams
from baton.grammar.vocab import VocabSource

VOCAB_SIZE = 49152
SUMMARY_KEYS = {
    "schemas",
    "compiled",
    "passing",
    "passing_pct",
    "compile_errors",
    "unsupported",
    "invalid_schema",
    "timeouts",
    "crashes",
    "oom",
    "timeouts_crashes",
    "tests_run",
    "valid_tests",
    "invalid_tests",
    "valid_rejected",
    "policy_rejected",
    "invalid_accepted",
    "instance_errors",
    "tokens",
    "mask_mismatches",
    "compile_ms",
    "mask_us",
}

# A schema whose verdicts are known: one mislabelled test makes exactly one valid instance
# rejected.
OBJECT_SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}},
    "required": ["a"],
    "additionalProperties": False,
}
OBJECT_TESTS = [
    {"description": "an integer", "valid": True, "data": {"a": 12}},
    {"description": "a string", "valid": False, "data": {"a": "x"}},
    {"description": "empty", "valid": False, "data": {}},
    {"description": "mislabelled", "valid": True, "data": {"a": [1]}},
]


# ------------------------------------------------------------------------------ fake backends


class _FakeMatcher(GrammarMatcher):
    """Allows everything; ``fill_bitmask`` ends the process (a crash mid-walk)."""

    def accept_tokens(self, tokens: Sequence[int]) -> bool:
        return True

    def validate_tokens(self, tokens: Sequence[int]) -> int:
        return len(tokens)

    def rollback(self, num_tokens: int) -> None:
        pass

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        os._exit(3)

    def is_terminated(self) -> bool:
        return False

    def reset(self) -> None:
        pass

    def jump_forward_string(self) -> str:
        return ""


class _FakeGrammar(CompiledGrammar):
    backend_name = "fake"

    def new_matcher(self) -> GrammarMatcher:
        return _FakeMatcher()


class _FakeBackend(GrammarBackend):
    name = "fake"

    def __init__(self, tokenizer: VocabSource, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def unsupported_reason(self, spec: StructuredOutputsParams) -> str | None:
        return None

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        return _FakeGrammar()


class SegfaultBackend(_FakeBackend):
    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file from this test
        os.kill(os.getpid(), signal.SIGSEGV)
        raise AssertionError("unreachable")


class HangBackend(_FakeBackend):
    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        time.sleep(3600)
        raise AssertionError("unreachable")


class ExitInWalkBackend(_FakeBackend):
    pass  # compiles; its matcher exits the process at the first bitmask fill


class BrokenBackend(_FakeBackend):
    def __init__(self, tokenizer: VocabSource, vocab_size: int) -> None:
        raise ValueError("this backend cannot be built")


# ------------------------------------------------------------------------------------ helpers


def _write(path: Path, content: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(content))
    return path


def _rows(result: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(r["schema"], r["backend"]): r for r in result["rows"]}


def _check_summary(summary: dict[str, Any]) -> None:
    assert set(summary) >= SUMMARY_KEYS
    assert summary["timeouts_crashes"] == summary["timeouts"] + summary["crashes"]
    # Every schema ends one way: walked to the end, compile error, time-out or crash; a time-out
    # or crash may come after the compile (during a test's walk).
    finished = summary["schemas"] - summary["compile_errors"] - summary["timeouts_crashes"]
    assert 0 <= finished <= summary["compiled"] <= summary["schemas"] - summary["compile_errors"]
    assert summary["unsupported"] + summary["invalid_schema"] <= summary["compile_errors"]
    assert summary["passing"] <= finished
    assert summary["valid_tests"] + summary["invalid_tests"] == summary["tests_run"]
    assert summary["valid_rejected"] <= summary["valid_tests"]
    assert summary["invalid_accepted"] <= summary["invalid_tests"]
    mask = summary["mask_us"]
    if summary["tokens"]:
        assert 0 < mask["p50"] <= mask["p99"] <= mask["max"]
    else:
        assert mask["avg"] is None


# --------------------------------------------------------------------------------- unit tests


def test_maskbench_and_bare_files_are_told_apart(tmp_path: Path) -> None:
    mask = _write(tmp_path / "m.json", {"description": "d", "schema": OBJECT_SCHEMA, "tests": []})
    bare = _write(tmp_path / "b.json", {"type": "object", "properties": {"schema": {}}})
    assert parse_schema_file(mask, "m").schema == OBJECT_SCHEMA
    case = parse_schema_file(bare, "b")
    assert case.tests == ()
    assert case.schema["properties"] == {"schema": {}}
    assert parse_schema_file(_write(tmp_path / "t.json", True), "t").schema is True
    (tmp_path / "bad.txt").write_text("{not json")
    with pytest.raises(ValueError, match="bad.txt"):
        parse_schema_file(tmp_path / "bad.txt", "bad")
    with pytest.raises(ValueError, match="expected a schema"):
        parse_schema_file(_write(tmp_path / "list.json", [1]), "list")
    bad_test = {"schema": {}, "tests": [{"description": "x", "data": 1}]}
    with pytest.raises(ValueError, match="test 0"):
        parse_schema_file(_write(tmp_path / "bt.json", bad_test), "bt")


def test_load_cases_recurses_sorts_and_limits(tmp_path: Path) -> None:
    _write(tmp_path / "z" / "b.json", {"type": "string"})
    _write(tmp_path / "a.json", {"type": "integer"})
    (tmp_path / "LICENSE").write_text("not a schema")
    assert [c.id for c in load_cases([tmp_path])] == ["a.json", "z/b.json"]
    assert [c.id for c in load_cases([tmp_path], limit=1)] == ["a.json"]
    with pytest.raises(ValueError, match="no such"):
        load_cases([tmp_path / "missing"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no \\*.json"):
        load_cases([tmp_path / "empty"])


def test_instances_are_serialised_as_the_whitespace_mode_expects() -> None:
    data = {"a": [1, "é"], "b": None}
    assert serialize_instance(data, "compact") == '{"a":[1,"é"],"b":null}'
    assert serialize_instance(data, "any") == '{"a": [1, "é"], "b": null}'


def test_instances_are_fed_as_the_grammar_writes_the_value() -> None:
    schema = {"properties": {"b": {}, "a": {"enum": [1]}}}
    data = {"a": 1.0, "b": [0.0, 2.5, -2.0, float(2**53)], "c": True}
    fed = fed_as_written(schema, data)
    assert serialize_instance(fed, "compact") == '{"b":[0,2.5,-2,9007199254740992],"a":1,"c":true}'
    # The same value, so the same verdict (draft 6 on), valid and invalid alike.
    validator = jsonschema.Draft202012Validator(schema)
    for value in (data, {"a": 2.0}):
        assert validator.is_valid(fed_as_written(schema, value)) == validator.is_valid(value)
    # Drafts 3 and 4 did not count 1.0 as an integer: left as it is.
    draft4 = {"$schema": "http://json-schema.org/draft-04/schema#", "type": "integer"}
    assert serialize_instance(fed_as_written(draft4, 1.0), "compact") == "1.0"


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="jobs"):
        GrammarBenchConfig(data=(Path("."),), jobs=0)
    with pytest.raises(ValueError, match="timeout"):
        GrammarBenchConfig(data=(Path("."),), timeout_s=0)
    with pytest.raises(ValueError, match="limit"):
        GrammarBenchConfig(data=(Path("."),), limit=0)
    with pytest.raises(SystemExit):
        main(["--backends", "nope", "--data", "."])


def _row(backend: str, status: str, compile_ms: float | None, **extra: Any) -> dict[str, Any]:
    return {
        "schema": "s",
        "backend": backend,
        "served_by": backend,
        "status": status,
        "error": None if status == "ok" else f"{backend} failed",
        "compiled": status == "ok",
        "compile_ms": compile_ms,
        **extra,
    }


def test_auto_falls_back_only_when_xgrammar_cannot_take_the_schema() -> None:
    times = {("s", "outlines"): np.array([1.0, 2.0]), ("s", "xgrammar"): np.array([3.0])}
    rows = [
        _row("xgrammar", "compile_error", 2.0),
        _row("outlines", "ok", 5.0),
        _row("guidance", "ok", 0.5),
    ]
    (auto,), auto_times = auto_rows(rows, times)
    assert (auto["backend"], auto["served_by"], auto["status"]) == ("auto", "outlines", "ok")
    assert auto["compile_ms"] == pytest.approx(7.0)  # the failed attempt counts
    assert auto_times[("s", "auto")].tolist() == [1.0, 2.0]

    rows = [
        _row("xgrammar", "timeout", None),
        _row("outlines", "ok", 5.0),
        _row("guidance", "ok", 1),
    ]
    (auto,), _ = auto_rows(rows, times)
    assert (auto["served_by"], auto["status"]) == ("xgrammar", "timeout")

    rows = [
        _row("xgrammar", "compile_error", 1.0),
        _row("outlines", "compile_error", 1.0),
        _row("guidance", "ok", 0.5),
    ]
    (auto,), _ = auto_rows(rows, times)
    assert (auto["served_by"], auto["compile_ms"]) == ("guidance", pytest.approx(2.5))

    rows = [_row(name, "compile_error", 1.0) for name in ("xgrammar", "outlines", "guidance")]
    (auto,), auto_times = auto_rows(rows, times)
    assert auto["status"] == "compile_error" and auto["served_by"] is None
    assert all(f"{name} failed" in auto["error"] for name in ("xgrammar", "outlines", "guidance"))
    assert not auto_times

    assert auto_rows([_row("xgrammar", "ok", 1.0)], times) == ([], {})


# ---------------------------------------------------------------------------- worker processes


@pytest.mark.slow
def test_cli_on_shared_data_with_every_backend(shared_data: Path, tmp_path: Path) -> None:
    suite = sorted((shared_data / "json-schema-test-suite").glob("*.json"))[:4]
    store = sorted((shared_data / "schemastore").glob("*.json"), key=lambda p: p.stat().st_size)
    # The smallest, any.json, costs outlines a 3 s index of any JSON value; the next two compile
    # in milliseconds on every backend.
    files = suite + store[1:3]
    assert len(files) == 6
    out = tmp_path / "res" / "grammar.json"
    argv = ["--data", *map(str, files), "--backends", "xgrammar,outlines,guidance", "--jobs", "2"]
    assert main([*argv, "--no-progress", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    with out.with_suffix(".csv").open() as fh:
        csv_rows = list(csv.DictReader(fh))
    assert len(result["rows"]) == 4 * len(files)
    lenient_rows = result["lenient"]["rows"]
    assert len(csv_rows) == len(result["rows"]) + len(lenient_rows)
    assert {r["backend"] for r in csv_rows} == {"xgrammar", "outlines", "guidance", "auto"}
    assert [r["mode"] for r in csv_rows] == ["strict"] * len(result["rows"]) + ["lenient"] * len(
        lenient_rows
    )

    summary = result["summary"]
    assert list(summary) == ["xgrammar", "outlines", "guidance", "auto"]
    for name, s in summary.items():
        _check_summary(s)
        assert s["schemas"] == len(files), name
        assert s["timeouts_crashes"] == 0, name
        assert s["mask_mismatches"] == 0, name
    assert summary["xgrammar"]["passing"] >= 1
    assert summary["xgrammar"]["tokens"] > 0
    assert summary["auto"]["compiled"] >= max(
        summary[name]["compiled"] for name in ("xgrammar", "outlines", "guidance")
    )
    tests = sum(len(json.loads(f.read_text())["tests"]) for f in files)
    assert result["config"]["tests"] == tests
    # Every test of a compiled schema was walked.
    for row in result["rows"]:
        assert row["tests_run"] == (row["tests"] if row["compiled"] else 0)
    cdf = result["mask_us_cdf"]["xgrammar"]
    assert cdf["us"] == sorted(cdf["us"]) and cdf["p"][0] == 0.0 and cdf["p"][-1] == 100.0


@pytest.mark.slow
def test_bare_schema_directory_and_exact_verdicts(tmp_path: Path, tokenizer: VocabSource) -> None:
    data = tmp_path / "data"
    _write(data / "bare" / "string.json", {"type": "string", "maxLength": 5})
    _write(data / "bare" / "closed.json", OBJECT_SCHEMA)
    _write(
        data / "known.json", {"description": "d", "schema": OBJECT_SCHEMA, "tests": OBJECT_TESTS}
    )
    # "12" is a prefix of valid integers >= 100: only the EOS check can reject it.
    min_tests = [
        {"description": "big", "valid": True, "data": 150},
        {"description": "small", "valid": False, "data": 12},
    ]
    _write(data / "min.json", {"schema": {"type": "integer", "minimum": 100}, "tests": min_tests})
    config = GrammarBenchConfig(data=(data,), backends=("xgrammar",), progress=False)
    result = run_benchmark(config, tokenizer=tokenizer, vocab_size=VOCAB_SIZE)
    rows = _rows(result)
    for name in ("bare/string.json", "bare/closed.json"):
        row = rows[(name, "xgrammar")]
        assert (row["status"], row["tests"], row["tokens"], row["passing"]) == ("ok", 0, 0, True)
    known = rows[("known.json", "xgrammar")]
    assert known["status"] == "ok" and known["tests_run"] == 4
    assert (known["valid_rejected"], known["invalid_accepted"]) == (1, 0)
    assert known["passing"] is False
    assert known["failures"] == ["valid rejected: mislabelled"]
    # {"a":12} is walked to the end: its tokens plus EOS, one mask fill each.
    full = len(tokenizer.encode('{"a":12}', add_special_tokens=False)) + 1  # type: ignore[attr-defined]
    assert known["tokens"] > full
    minimum = rows[("min.json", "xgrammar")]
    assert (minimum["invalid_accepted"], minimum["passing"]) == (0, True)
    summary = result["summary"]
    assert list(summary) == ["xgrammar"]  # no auto without outlines
    _check_summary(summary["xgrammar"])
    assert (summary["xgrammar"]["passing"], summary["xgrammar"]["schemas"]) == (3, 4)


# A schema whose objects are open under JSON Schema and closed under baton's policy.
POLICY_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.slow
def test_policy_rejections_and_lenient_mode_are_counted_apart(
    tmp_path: Path, tokenizer: VocabSource
) -> None:
    data = tmp_path / "data"
    tests = [
        {"description": "declared only", "valid": True, "data": {"a": 1}},
        {"description": "another name", "valid": True, "data": {"a": 1, "b": 2}},
        {"description": "mislabelled", "valid": True, "data": {"a": [1]}},
        {"description": "a string", "valid": False, "data": {"a": "x"}},
    ]
    _write(data / "mixed.json", {"schema": POLICY_SCHEMA, "tests": tests})
    only_policy = [
        tests[0],
        {"description": "more names", "valid": True, "data": {"a": 2, "z": None}},
    ]
    _write(data / "policy.json", {"schema": POLICY_SCHEMA, "tests": only_policy})
    # xgrammar does not enforce uniqueItems: refused strictly, accepted (and a duplicate with
    # it) leniently.
    unique = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    unique_tests = [
        {"description": "distinct", "valid": True, "data": [1, 2]},
        {"description": "duplicate", "valid": False, "data": [1, 1]},
    ]
    _write(data / "unique.json", {"schema": unique, "tests": unique_tests})
    for test in tests + only_policy + unique_tests:
        schema = unique if test in unique_tests else POLICY_SCHEMA
        assert jsonschema.Draft202012Validator(schema).is_valid(test["data"]) == (
            test["valid"] and test["description"] != "mislabelled"
        )
    config = GrammarBenchConfig(data=(data,), backends=("xgrammar",), progress=False)
    result = run_benchmark(config, tokenizer=tokenizer, vocab_size=VOCAB_SIZE)
    rows = _rows(result)
    mixed, policy = rows[("mixed.json", "xgrammar")], rows[("policy.json", "xgrammar")]
    assert (mixed["valid_rejected"], mixed["policy_rejected"], mixed["passing"]) == (1, 1, False)
    assert mixed["failures"] == [
        "valid rejected: mislabelled",
        "valid rejected (closed-object policy): another name",
    ]
    assert (policy["valid_rejected"], policy["policy_rejected"], policy["passing"]) == (0, 1, True)
    strict = result["summary"]["xgrammar"]
    _check_summary(strict)
    assert (strict["valid_rejected"], strict["policy_rejected"], strict["unsupported"]) == (1, 2, 1)
    assert strict["invalid_accepted"] == 0
    # Lenient mode: only the refused schema, compiled again; its duplicate counted there.
    (lenient_row,) = result["lenient"]["rows"]
    assert (lenient_row["schema"], lenient_row["mode"], lenient_row["compiled"]) == (
        "unique.json",
        "lenient",
        True,
    )
    lenient = result["lenient"]["summary"]["xgrammar"]
    _check_summary(lenient)
    assert (lenient["schemas"], lenient["compiled"], lenient["unsupported"]) == (1, 1, 0)
    assert (lenient["invalid_accepted"], lenient["invalid_tests"]) == (1, 1)
    assert lenient["valid_rejected"] == 0
    report = format_report(result)
    assert "closed-object policy" in report and "schemas refused" in report
    table = grammar_table(result)
    assert "| valid rejected by policy | 2 |" in table
    assert "| compiled with strict: false | 1 |" in table
    assert "| invalid accepted | 1 of 1 |" in table


@pytest.mark.slow
def test_crashing_and_hanging_backends_are_recorded_and_the_run_goes_on(
    tmp_path: Path, tokenizer: VocabSource
) -> None:
    data = tmp_path / "data"
    _write(data / "1.json", {"description": "d", "schema": OBJECT_SCHEMA, "tests": OBJECT_TESTS})
    _write(data / "2.json", {"type": "integer"})
    factories = {
        "segv": SegfaultBackend,
        "hang": HangBackend,
        "exit": ExitInWalkBackend,
        "xgrammar": BACKENDS["xgrammar"],
    }
    config = GrammarBenchConfig(
        data=(data,), backends=tuple(factories), timeout_s=1.5, jobs=2, progress=False
    )
    t0 = time.monotonic()
    result = run_benchmark(config, tokenizer=tokenizer, vocab_size=VOCAB_SIZE, factories=factories)
    # Bounded, not fast: each crash or hang costs a fresh worker (forked from the fork server in
    # under a second; where workers are spawned, torch and the backends load again, 5-20 s each
    # on a loaded 2-core machine); a hang that blocked the run would not end.
    assert time.monotonic() - t0 < 180
    rows = _rows(result)
    for schema in ("1.json", "2.json"):
        segv = rows[(schema, "segv")]
        assert segv["status"] == "crash" and "SIGSEGV" in segv["error"], segv
        assert "during compile" in segv["error"]
        hang = rows[(schema, "hang")]
        assert hang["status"] == "timeout" and "compile took longer" in hang["error"], hang
        assert rows[(schema, "xgrammar")]["status"] == "ok"
    # The exiting matcher dies at its first fill, in the first test; a bare schema has no walk.
    exited = rows[("1.json", "exit")]
    assert exited["status"] == "crash" and "exited with code 3" in exited["error"], exited
    assert "test 0" in exited["error"] and exited["compiled"] is True
    assert rows[("2.json", "exit")]["status"] == "ok"
    assert rows[("1.json", "xgrammar")]["valid_rejected"] == 1
    summary = result["summary"]
    for s in summary.values():
        _check_summary(s)
    assert (summary["segv"]["crashes"], summary["hang"]["timeouts"]) == (2, 2)
    assert summary["exit"]["timeouts_crashes"] == 1


@pytest.mark.slow
def test_a_backend_that_cannot_be_built_stops_the_run(
    tmp_path: Path, tokenizer: VocabSource
) -> None:
    _write(tmp_path / "s.json", {"type": "integer"})
    config = GrammarBenchConfig(data=(tmp_path,), backends=("broken",), progress=False)
    with pytest.raises(RuntimeError, match="this backend cannot be built"):
        run_benchmark(
            config, tokenizer=tokenizer, vocab_size=VOCAB_SIZE, factories={"broken": BrokenBackend}
        )
