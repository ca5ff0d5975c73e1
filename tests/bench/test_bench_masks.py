"""``baton bench masks``: the feature families of each state, the batched walk, and a small run
end to end (JSON, CSV, PNG, the per-family figures and the worst schemas)."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest

from baton.bench.grammars.grammar_worker import walk_tokens
from baton.bench.grammars.mask_families import (
    FAMILIES,
    PLAIN,
    byte_families,
    in_schema_order,
    state_families,
)
from baton.bench.grammars.masks import ALL, main
from baton.grammar.backend import allocate_bitmask
from baton.grammar.spec import StructuredOutputsParams
from baton.grammar.vocab import VocabSource
from baton.grammar.xgrammar.backend import XGrammarBackend

VOCAB_SIZE = 49152

SCHEMA: dict[str, Any] = {
    "$defs": {
        "tag": {"$ref": "#/$defs/word"},
        "word": {"type": "string", "maxLength": 8},
    },
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 20},
        "code": {"type": "string", "pattern": "^[A-Z]+$"},
        "day": {"type": "string", "format": "date"},
        "kind": {"enum": ["a", "b"]},
        "inner": {"type": "object", "properties": {"n": {"type": "integer"}}},
        "items": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
        "either": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
        "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}},
        "free": {"type": "boolean"},
    },
}
INSTANCE = {
    "name": "Ada",
    "code": "XY",
    "day": "2024-01-02",
    "kind": "b",
    "inner": {"n": 5},
    "items": [1, 2],
    "either": "s",
    "tags": ["t"],
    "free": True,
}


def _families_of(text: bytes, families: list[frozenset[str]], needle: str) -> frozenset[str]:
    """The families of the first byte of ``needle`` in ``text``."""
    return families[text.index(needle.encode())]


def test_each_value_carries_its_features_and_its_ancestors() -> None:
    text, families = byte_families(SCHEMA, INSTANCE, "compact")
    assert text == json.dumps(INSTANCE, separators=(",", ":")).encode()
    assert len(families) == len(text)
    assert _families_of(text, families, '"Ada"') == {"bounded strings"}
    assert _families_of(text, families, '"XY"') == {"patterns"}
    assert _families_of(text, families, '"2024') == {"formats"}
    assert _families_of(text, families, '"b"') == {"enums and consts"}
    # The nested object's braces, key and value are all inside it.
    assert _families_of(text, families, '{"n"') == {"nested objects"}
    assert _families_of(text, families, "5}") == {"nested objects"}
    assert _families_of(text, families, "[1,") == {"array bounds"}
    assert _families_of(text, families, '"s"') == {"anyOf/oneOf"}
    # tags -> tag -> word: two $ref hops, and the word's own bound.
    assert _families_of(text, families, '"t"') == {"bounded strings", "deep $ref"}
    assert _families_of(text, families, "true") == frozenset()
    assert _families_of(text, families, '"name"') == frozenset()  # the root object's key
    assert {f for fs in families for f in fs} == set(FAMILIES)


def test_states_take_the_families_of_their_next_byte() -> None:
    data = {"name": "Ada", "free": False}
    text = json.dumps(data, separators=(",", ":")).encode()
    # Cut the text into 1- and 2-byte "tokens".
    lengths = [2, 1] * (len(text) // 3) + [1] * (len(text) % 3)
    states = state_families(SCHEMA, data, "compact", lengths)
    assert len(states) == len(lengths) + 1
    offset = 0
    _, families = byte_families(SCHEMA, data, "compact")
    for i, length in enumerate(lengths):
        assert states[i] == families[offset]
        offset += length
    assert states[-1] == families[-1]
    with pytest.raises(ValueError, match="cover"):
        state_families(SCHEMA, data, "compact", lengths[:-1])


def test_any_whitespace_and_schema_order() -> None:
    text, families = byte_families(SCHEMA, {"kind": "a", "name": "é"}, "any")
    assert text == '{"kind": "a", "name": "é"}'.encode()
    assert len(families) == len(text)  # é is two bytes, both labelled
    assert families[text.index("é".encode())] == {"bounded strings"}
    assert families[text.index("é".encode()) + 1] == {"bounded strings"}
    ordered = in_schema_order(SCHEMA, {"free": True, "zzz": 1, "inner": {"n": 1}, "name": "x"})
    assert list(ordered) == ["name", "inner", "free", "zzz"]


def test_a_walk_with_several_rows_fills_them_all_and_agrees_with_one_row(
    tokenizer: VocabSource,
) -> None:
    backend = XGrammarBackend(tokenizer, VOCAB_SIZE)
    compiled = backend.compile(StructuredOutputsParams(json=SCHEMA))
    tokens = tokenizer.encode(  # type: ignore[attr-defined]
        json.dumps(INSTANCE, separators=(",", ":")), add_special_tokens=False
    )
    eos = tokenizer.eos_token_ids[0]
    one = walk_tokens(compiled, tokens, eos, allocate_bitmask(1, VOCAB_SIZE))
    bitmask = allocate_bitmask(4, VOCAB_SIZE)
    bitmask.zero_()
    four = walk_tokens(compiled, tokens, eos, bitmask, backend, rows=4)
    assert one[0] is four[0] is True
    assert len(one[1]) == len(four[1]) == len(tokens) + 1
    assert one[2] == four[2] == 0  # the masks agree with accept_tokens
    # The last fill (before EOS) wrote every row: all four hold the same mask.
    assert all(bool((bitmask[r] == bitmask[0]).all()) for r in range(4))
    with pytest.raises(ValueError, match="backend"):
        walk_tokens(compiled, tokens, eos, bitmask, None, rows=2)
    with pytest.raises(ValueError, match="rows"):
        walk_tokens(compiled, tokens, eos, bitmask, backend, rows=5)


@pytest.mark.slow
def test_cli_small_run_writes_families_and_worst_schemas(
    tmp_path: Path, tokenizer: VocabSource
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    tests = [
        {"description": "ok", "valid": True, "data": INSTANCE},
        {"description": "reordered", "valid": True, "data": dict(reversed(INSTANCE.items()))},
        {"description": "too long", "valid": False, "data": {"name": "x" * 30}},
    ]
    (data / "features.json").write_text(json.dumps({"schema": SCHEMA, "tests": tests}))
    simple = {"type": "object", "properties": {"a": {"type": "integer"}}}
    (data / "simple.json").write_text(
        json.dumps({"schema": simple, "tests": [{"description": "a", "valid": True, "data": {}}]})
    )
    out = tmp_path / "res" / "masks.json"
    argv = ["--data", str(data), "--backends", "xgrammar,outlines", "--rows", "4"]
    assert main([*argv, "--no-progress", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    with out.with_suffix(".csv").open() as fh:
        assert len(list(csv.DictReader(fh))) == 4  # 2 schemas x 2 backends
    assert result["config"]["rows"] == 4 and result["run"]["commit"] != "unknown"
    xgr = result["families"]["xgrammar"]
    assert set(xgr) == {*FAMILIES, PLAIN, ALL}
    for family in FAMILIES:
        stats = xgr[family]
        assert stats["states"] > 0, family
        assert 0 < stats["p50"] <= stats["p99"] <= stats["max"], family
        assert stats["worst_schema"] == "features.json"
    # The reordered instance is walked in schema order: both valid instances pass in full.
    walk = len(tokenizer.encode(json.dumps(INSTANCE, separators=(",", ":")))) + 1  # type: ignore[attr-defined]
    assert xgr[ALL]["states"] >= 2 * walk
    assert result["compiled"]["xgrammar"] == {
        "schemas": 2,
        "compiled": 2,
        "timeouts": 0,
        "crashes": 0,
        "states": xgr[ALL]["states"],
    }
    worst = result["worst"]["xgrammar"]
    assert {w["schema"] for w in worst} == {"features.json", "simple.json"}
    assert worst[0]["max_us"] == xgr[ALL]["max"] >= worst[1]["max_us"]
    assert all(w["max_us"] > 0 and w["families"] for w in worst)
    (goal,) = result["goals"]
    assert goal["value"] == max(xgr[f]["p99"] for f in FAMILIES)
    assert goal["worst_schema"] == worst[0]["schema"]
