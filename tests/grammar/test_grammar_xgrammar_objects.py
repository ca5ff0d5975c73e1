"""grammar/xgrammar/objects.py: an object's chain of optional properties rebuilt as blocks of
direct alternatives accepts exactly what xgrammar's chain accepts, and fills fast."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from baton.grammar.xgrammar.normal_form import xgrammar_normal_form
from baton.grammar.xgrammar.objects import BLOCK, rewrite_property_chains


def _ebnf(schema: dict[str, Any], any_whitespace: bool = False) -> str:
    options: dict[str, Any] = (
        {"any_whitespace": True, "max_whitespace_cnt": 2}
        if any_whitespace
        else {"any_whitespace": False, "separators": (",", ":")}
    )
    grammar = xgr.Grammar.from_json_schema(
        json.dumps(xgrammar_normal_form(schema)), strict_mode=True, **options
    )
    return str(grammar)


def _object(n: int, required: tuple[int, ...] = (), tail: Any = False) -> dict[str, Any]:
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {f"k{i}": {"type": "integer"} for i in range(n)},
        "additionalProperties": tail,
    }
    if required:
        schema["required"] = [f"k{i}" for i in required]
    return schema


def _candidates(n: int, required: list[int], rng: random.Random, count: int) -> list[str]:
    """Objects with keys drawn from k0..k{n+1} (two undeclared), in declared order or shuffled,
    sometimes repeated, most holding the required keys; each value an integer."""
    out = ["{}"]
    for _ in range(count):
        size = rng.randint(1, min(n + 2, 8))
        keys = rng.sample(range(n + 2), size)
        if rng.random() < 0.6:
            keys = list(set(keys) | set(required))
        if rng.random() < 0.7:
            keys.sort()
        if rng.random() < 0.1:
            keys.append(keys[-1])
        out.append("{" + ",".join(f'"k{k}":{k}' for k in keys) + "}")
    # Runs of consecutive keys, where the order rule and the required keys bite.
    for _ in range(count // 4):
        start = rng.randrange(n)
        keys = sorted(set(range(start, min(n, start + rng.randint(1, BLOCK + 3)))) | set(required))
        out.append("{" + ",".join(f'"k{k}":{k}' for k in keys) + "}")
    return out


CASES = {
    "all optional, one block": (_object(6), False),
    "all optional, several blocks": (_object(3 * BLOCK + 5), False),
    "required first and last": (_object(2 * BLOCK, required=(0, 2 * BLOCK - 1)), False),
    "required across blocks": (_object(3 * BLOCK, required=(BLOCK + 2, 2 * BLOCK + 7)), False),
    "required at a block's start": (_object(3 * BLOCK, required=(BLOCK,)), False),
    "additional properties tail": (_object(2 * BLOCK + 1, tail={"type": "integer"}), False),
    "tail after a required": (
        _object(2 * BLOCK, required=(BLOCK + 3,), tail={"type": "integer"}),
        False,
    ),
    "any whitespace": (_object(BLOCK + 4, required=(3,)), True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_rebuilt_chain_accepts_exactly_what_xgrammar_accepts(case: str) -> None:
    schema, any_ws = CASES[case]
    original = _ebnf(schema, any_ws)
    rebuilt = rewrite_property_chains(original)
    assert rebuilt != original, "the object was not rebuilt"
    before = xgr.Grammar.from_ebnf(original, root_rule_name="root")
    after = xgr.Grammar.from_ebnf(rebuilt, root_rule_name="root")
    n = len(schema["properties"])
    rng = random.Random(n)
    required = [int(k[1:]) for k in schema.get("required", [])]
    texts = _candidates(n, required, rng, 120)
    if any_ws:
        texts += [t.replace(",", " ,  ").replace(":", ": ") for t in texts[:40]]
    accepted = 0
    for text in texts:
        want = _is_grammar_accept_string(before, text)
        assert _is_grammar_accept_string(after, text) == want, text
        accepted += want
    assert 10 <= accepted < len(texts), "the candidates must exercise both answers"


def test_a_nested_object_and_its_parent_are_both_rebuilt() -> None:
    inner = _object(BLOCK + 2, required=(5,))
    schema = {
        "type": "object",
        "properties": {"a": inner, "b": {"type": "string"}, "c": {"type": "integer"}},
    }
    original = _ebnf(schema)
    rebuilt = rewrite_property_chains(original)
    assert rebuilt.count("_part_block_") > 0 and rebuilt.count("root_part_0_next") > 0
    before = xgr.Grammar.from_ebnf(original, root_rule_name="root")
    after = xgr.Grammar.from_ebnf(rebuilt, root_rule_name="root")
    for text in [
        '{"a":{"k5":1},"b":"x","c":2}',
        '{"a":{"k0":1,"k5":1,"k13":3}}',
        '{"a":{"k0":1},"c":2}',
        '{"c":2,"a":{"k5":1}}',
        '{"b":"x"}',
        '{"a":{"k6":1,"k5":2}}',
    ]:
        assert _is_grammar_accept_string(after, text) == _is_grammar_accept_string(before, text), (
            text
        )


def test_shapes_it_does_not_know_are_left_alone() -> None:
    text = (
        'root ::= (("{" root_1 "}"))\n'
        'root_1 ::= (("\\"a\\"" ":" basic_integer root_part_0))\n'
        'root_part_0 ::= ((root_part_1) | ("," "\\"b\\"" ":" basic_integer root_part_1) | "x")\n'
        'root_part_1 ::= ("" | ("," "\\"c\\"" ":" basic_integer))\n'
        'basic_integer ::= (("0") | ([1-9] [0-9]*))'
    )
    assert rewrite_property_chains(text) == text
