"""The outlines-core backend's enforcement table (each keyword it ignores or enforces shown with
an instance) and a sample of the shared schema data."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from jsonschema.validators import validator_for
from outlines_testing import _accepts, _compact, _ids

from baton.bench.grammars.mask_families import in_schema_order
from baton.engine.tokenizer import Tokenizer
from baton.grammar.outlines.backend import (
    OUTLINES_CONDITIONAL_KEYWORDS,
    OUTLINES_ENFORCED_KEYWORDS,
    OUTLINES_UNENFORCED_KEYWORDS,
    OutlinesBackend,
    estimate_dfa_states,
)
from baton.grammar.outlines.faithful import check_outlines_schema
from baton.grammar.spec import StructuredOutputsParams


@pytest.fixture(scope="module")
def backend(tokenizer: Tokenizer) -> OutlinesBackend:
    return OutlinesBackend(tokenizer, tokenizer.vocab_size)


# -- the enforcement table -----------------------------------------------------------------------

DRAFT7 = "http://json-schema.org/draft-07/schema#"
AB = {"a": {"type": "integer"}, "b": {"type": "integer"}}
INTS = {"type": "array", "items": {"type": "integer"}}

# (keyword, schema, an instance the schema rejects but outlines accepts)
UNENFORCED_CASES: list[Any] = [
    ("minimum", {"type": "integer", "minimum": 3}, 1),
    ("maximum", {"type": "integer", "maximum": 3}, 5),
    ("exclusiveMinimum", {"type": "integer", "exclusiveMinimum": 3}, 3),
    ("exclusiveMaximum", {"type": "integer", "exclusiveMaximum": 3}, 3),
    ("multipleOf", {"type": "integer", "multipleOf": 2}, 3),
    ("not", {"type": "integer", "not": {"enum": [1]}}, 1),
    ("if", {"type": "integer", "if": {"enum": [1]}, "then": {"enum": [2]}}, 1),
    ("then", {"type": "integer", "if": {"enum": [1]}, "then": {"enum": [2]}}, 1),
    ("else", {"type": "integer", "if": {"enum": [1]}, "else": {"enum": [1]}}, 2),
    ("uniqueItems", {**INTS, "uniqueItems": True}, [1, 1]),
    ("contains", {**INTS, "contains": {"enum": [5]}}, [1]),
    ("minContains", {**INTS, "contains": {"enum": [5]}, "minContains": 2}, [5]),
    ("maxContains", {**INTS, "contains": {"enum": [5]}, "maxContains": 1}, [5, 5]),
    (
        "dependentRequired",
        {"type": "object", "properties": AB, "dependentRequired": {"a": ["b"]}},
        {"a": 1},
    ),
    (
        "dependentSchemas",
        {"type": "object", "properties": AB, "dependentSchemas": {"a": {"required": ["b"]}}},
        {"a": 1},
    ),
    (
        "dependencies",
        {"$schema": DRAFT7, "type": "object", "properties": AB, "dependencies": {"a": ["b"]}},
        {"a": 1},
    ),
    (
        "propertyNames",
        {
            "type": "object",
            "properties": {"ab": {"type": "integer"}},
            "propertyNames": {"maxLength": 1},
        },
        {"ab": 1},
    ),
    (
        "patternProperties",
        {
            "type": "object",
            "properties": {"ab": {"type": "integer"}},
            "patternProperties": {"^a": {"minimum": 5}},
        },
        {"ab": 1},
    ),
    ("minProperties", {"type": "object", "properties": AB, "minProperties": 1}, {}),
    ("maxProperties", {"type": "object", "properties": AB, "maxProperties": 1}, {"a": 1, "b": 2}),
    (
        "maxProperties",
        {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 1},
        {"a": 1, "b": 2},
    ),
    (
        "$dynamicRef",
        {
            "$defs": {"s": {"$dynamicAnchor": "s", "type": "string"}},
            "type": "object",
            "properties": {"a": {"type": "integer", "$dynamicRef": "#s"}},
        },
        {"a": 1},
    ),
    (
        "$recursiveRef",
        {
            "$schema": "https://json-schema.org/draft/2019-09/schema",
            "type": "object",
            "properties": {"a": {"type": "integer", "$recursiveRef": "#"}},
        },
        {"a": 1},
    ),
    # conditional keywords, where they are not enforced
    ("pattern", {"type": "string", "pattern": "^a+$", "minLength": 1}, "b"),
    ("pattern", {"type": "string", "pattern": "^\\s$"}, "a"),
    ("format", {"type": "string", "format": "date"}, "x"),
    ("format", {"type": "string", "format": "uuid", "maxLength": 50}, "x"),
    (
        "allOf",
        {"properties": {"a": {"type": "integer"}}, "allOf": [{"required": ["a"]}]},
        {},
    ),
    (
        "required",
        {"type": "object", "required": ["x"], "additionalProperties": {"type": "integer"}},
        {},
    ),
    # outlines writes its any-value for these: an index of seconds
    pytest.param(
        "unevaluatedItems",
        {"type": "array", "unevaluatedItems": {"type": "integer"}},
        ["a"],
        marks=pytest.mark.slow,
    ),
    pytest.param(
        "unevaluatedProperties",
        {"type": "object", "unevaluatedProperties": {"type": "integer"}},
        {"a": "x"},
        marks=pytest.mark.slow,
    ),
    ("oneOf", {"oneOf": [{"type": "integer"}, {"type": "number"}]}, 1),
    ("minItems", {"prefixItems": [{"type": "integer"}], "minItems": 2}, [1]),
    (
        "maxItems",
        {"prefixItems": [{"type": "integer"}, {"type": "integer"}], "maxItems": 1},
        [1, 2],
    ),
]

# (keyword, schema, an instance the schema rejects and outlines rejects too)
ENFORCED_CASES: list[tuple[str, dict[str, Any], Any]] = [
    ("type", {"type": "integer"}, "a"),
    ("enum", {"enum": ["a", "b"]}, "c"),
    ("const", {"const": "a"}, "b"),
    ("properties", {"type": "object", "properties": {"a": {"type": "integer"}}}, {"a": "x"}),
    (
        "required",
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        {},
    ),
    (
        "additionalProperties",
        {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False},
        {"a": 1, "b": 2},
    ),
    (
        "additionalProperties",
        {"type": "object", "additionalProperties": {"type": "integer"}},
        {"a": "x"},
    ),
    (
        "unevaluatedProperties",
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "unevaluatedProperties": False,
        },
        {"a": 1, "b": 2},
    ),
    ("items", INTS, ["a"]),
    (
        "prefixItems",
        {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]},
        ["a", 1],
    ),
    (
        "unevaluatedItems",
        {"prefixItems": [{"type": "integer"}], "unevaluatedItems": False},
        [1, 2],
    ),
    ("minItems", {**INTS, "minItems": 2}, [1]),
    ("maxItems", {**INTS, "maxItems": 1}, [1, 2]),
    ("minLength", {"type": "string", "minLength": 2}, "a"),
    ("maxLength", {"type": "string", "maxLength": 2}, "abc"),
    ("pattern", {"type": "string", "pattern": "^[a-c]+$"}, "abd"),
    ("format", {"type": "string", "format": "uuid"}, "x"),
    ("anyOf", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, None),
    ("oneOf", {"oneOf": [{"type": "integer"}, {"type": "string"}]}, None),
    (
        "oneOf",
        {
            "oneOf": [
                {"type": "object", "properties": {"k": {"const": "a"}}, "required": ["k"]},
                {"type": "object", "properties": {"k": {"const": "b"}}, "required": ["k"]},
            ]
        },
        {"k": "c"},
    ),
    (
        "allOf",
        {
            "allOf": [
                {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
            ]
        },
        {},
    ),
    (
        "$ref",
        {
            "$defs": {"i": {"type": "integer"}},
            "type": "object",
            "properties": {"a": {"$ref": "#/$defs/i"}},
            "required": ["a"],
        },
        {"a": "x"},
    ),
    # conditional keywords, where they are enforced
    (
        "minProperties",
        {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 1},
        {},
    ),
    (
        "maxProperties",
        {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 0},
        {"a": 1},
    ),
    (
        "patternProperties",
        {
            "type": "object",
            "properties": {"b": {"type": "integer"}},
            "patternProperties": {"^a": {"type": "integer"}},
        },
        {"b": 1, "a": "x"},
    ),
]


def _unenforced(schema: Any) -> set[str]:
    """The keywords (without their detail) outlines would not enforce in ``schema``."""
    return {k.split(" (")[0] for k in check_outlines_schema(schema).unenforced}


def _ids_of(cases: list[Any]) -> list[str]:
    keywords = [case.values[0] if hasattr(case, "values") else case[0] for case in cases]
    return [f"{keyword}-{i}" for i, keyword in enumerate(keywords)]


@pytest.mark.parametrize(
    "keyword, schema, instance", UNENFORCED_CASES, ids=_ids_of(UNENFORCED_CASES)
)
def test_unenforced_keyword_evidence(
    backend: OutlinesBackend, tokenizer: Tokenizer, keyword: str, schema: Any, instance: Any
) -> None:
    validator_cls = validator_for(schema)
    validator_cls.check_schema(schema)
    assert not validator_cls(schema, format_checker=validator_cls.FORMAT_CHECKER).is_valid(instance)
    assert keyword in _unenforced(schema)
    reason = backend.unsupported_reason(StructuredOutputsParams(json=schema))
    assert reason is not None and keyword in reason
    spec = StructuredOutputsParams(json=schema, allow_unenforced=True)
    assert backend.unsupported_reason(spec) is None
    assert _accepts(backend, tokenizer, spec, _compact(instance))


@pytest.mark.parametrize("keyword, schema, instance", ENFORCED_CASES, ids=_ids_of(ENFORCED_CASES))
def test_enforced_keyword_evidence(
    backend: OutlinesBackend, tokenizer: Tokenizer, keyword: str, schema: Any, instance: Any
) -> None:
    validator_cls = validator_for(schema)
    validator_cls.check_schema(schema)
    assert not validator_cls(schema, format_checker=validator_cls.FORMAT_CHECKER).is_valid(instance)
    assert _unenforced(schema) == set()
    spec = StructuredOutputsParams(json=schema)
    assert backend.unsupported_reason(spec) is None
    assert not _accepts(backend, tokenizer, spec, _compact(instance))


def test_every_table_entry_has_evidence() -> None:
    unenforced = {_ids_of([case])[0].rsplit("-", 1)[0] for case in UNENFORCED_CASES}
    enforced = {k for k, _, _ in ENFORCED_CASES}
    assert not OUTLINES_ENFORCED_KEYWORDS & OUTLINES_UNENFORCED_KEYWORDS
    assert unenforced >= OUTLINES_UNENFORCED_KEYWORDS
    assert enforced >= OUTLINES_ENFORCED_KEYWORDS
    for keyword in OUTLINES_CONDITIONAL_KEYWORDS:
        assert keyword in unenforced and keyword in enforced, keyword


def test_vacuous_keywords_are_not_reported() -> None:
    assert _unenforced({"type": "string", "minimum": 3}) == set()
    assert _unenforced({"type": "integer", "then": {"minimum": 3}}) == set()
    assert _unenforced({"type": "array", "uniqueItems": False}) == set()
    assert _unenforced({"enum": ["a"], "minimum": 3}) == set()
    nested = {"type": "object", "properties": {"a": {"type": "number", "maximum": 1}}}
    assert _unenforced(nested) == {"maximum"}
    via_ref = {"$defs": {"n": {"type": "integer", "minimum": 0}}, "$ref": "#/$defs/n"}
    assert _unenforced(via_ref) == {"minimum"}
    unused = {"$defs": {"n": {"type": "integer", "minimum": 0}}, "type": "string"}
    assert _unenforced(unused) == set()


# -- shared schema data --------------------------------------------------------------------------

_SAMPLE_PER_FOLDER = {"schemastore": 60, "json-schema-test-suite": 150}
_SAMPLE_MAX_STATES = 1000  # keeps each index build well under a second


@pytest.mark.slow
def test_shared_data_sample(
    backend: OutlinesBackend, tokenizer: Tokenizer, shared_data: Path
) -> None:
    """A fixed sample of the shared schemas that outlines fully enforces: compiled, and every
    test instance tried (counts printed): no invalid instance may be accepted."""
    eos = tokenizer.eos_token_ids[0]
    start = time.perf_counter()
    totals = {"compiled": 0, "valid": 0, "valid_accepted": 0, "invalid": 0, "invalid_accepted": 0}
    for folder, quota in _SAMPLE_PER_FOLDER.items():
        files = sorted((shared_data / folder).glob("*.json"))
        candidates = []
        for path in files:
            case = json.loads(path.read_text())
            spec = StructuredOutputsParams(json=case["schema"])
            if backend.unsupported_reason(spec) is not None:
                continue
            if estimate_dfa_states(backend.regex_for(spec)) > _SAMPLE_MAX_STATES:
                continue
            candidates.append((path.name, case, spec))
        step = max(1, len(candidates) // quota)
        sample = candidates[::step][:quota]
        counts = dict.fromkeys(totals, 0)
        invalid_accepted = []
        for name, case, spec in sample:
            compiled = backend.compile(spec)
            counts["compiled"] += 1
            for test in case["tests"]:
                text = _compact(in_schema_order(case["schema"], test["data"]))
                matcher = compiled.new_matcher()
                accepted = matcher.accept_tokens([*_ids(tokenizer, text), eos])
                accepted = accepted and matcher.is_terminated()
                kind = "valid" if test["valid"] else "invalid"
                counts[kind] += 1
                counts[f"{kind}_accepted"] += int(accepted)
                if accepted and not test["valid"]:
                    invalid_accepted.append(f"{name}: {test['description']}")
        print(
            f"\n{folder}: {len(files)} files, {len(candidates)} fully enforced by outlines "
            f"within {_SAMPLE_MAX_STATES} states, sampled {len(sample)}: {counts}"
        )
        for line in invalid_accepted:
            print(f"  invalid accepted: {line}")
        assert counts["compiled"] == len(sample) > 0
        assert counts["valid_accepted"] > 0
        assert not invalid_accepted
        for key in totals:
            totals[key] += counts[key]
    print(f"total: {totals} in {time.perf_counter() - start:.1f} s")
