"""Masks and accepts agree, for every grammar backend (issue 56 item 9): at each step of a walk
through an instance, a token is in the matcher's bitmask exactly when ``accept_tokens`` takes it.

Checked at each step: the instance's next token, the EOS, and seeded samples of the vocabulary
and of the mask's allowed tokens (a trial accept each, ``validate_tokens``). The cases are the
states that disagreed before the fixes (xgrammar: a root rule the grammar refers to;
llguidance: forced text, whose mask allowed only its canonical tokens), the shared schemas
where they showed, and a deterministic fuzz sweep (``schema_fuzz.py``).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import schema_fuzz
from grammar_testing import EOS, VOCAB, compact, every_backend, ids

from baton.engine.tokenizer import Tokenizer
from baton.grammar.backend import CompiledGrammar, GrammarBackend, allocate_bitmask
from baton.grammar.spec import StructuredOutputsParams

BACKENDS = ("xgrammar", "outlines", "guidance")

Disagreement = tuple[str, int, str, bool, bool]
"""(text walked, step, token text, mask bit, accepted)."""


@pytest.fixture(scope="module")
def backends(tokenizer: Tokenizer) -> dict[str, GrammarBackend]:
    return every_backend(tokenizer)


def disagreements(
    compiled: CompiledGrammar, tokenizer: Tokenizer, text: str, sample: int, seed: str
) -> list[Disagreement]:
    """Walks ``text``'s tokens and then EOS through a fresh matcher (until one is refused),
    comparing the mask with a trial accept for the next token, EOS and ``sample`` random and
    ``sample`` allowed tokens at each step."""
    rng = random.Random(seed)
    bitmask = allocate_bitmask(1, VOCAB)
    bits = bitmask[0].numpy().view(np.uint8)
    matcher = compiled.new_matcher()
    found: list[Disagreement] = []
    for step, token in enumerate([*ids(tokenizer, text), EOS]):
        matcher.fill_bitmask(bitmask, 0)
        mask = np.unpackbits(bits, bitorder="little")[:VOCAB]
        allowed = np.flatnonzero(mask)
        probes = {token, EOS, *(rng.randrange(VOCAB) for _ in range(sample))}
        probes.update(int(t) for t in rng.sample(list(allowed), min(sample, len(allowed))))
        for probe in sorted(probes):
            accepted = matcher.validate_tokens([probe]) == 1
            if bool(mask[probe]) != accepted:
                piece = tokenizer.convert_ids_to_tokens([probe])[0]
                found.append((text, step, piece, bool(mask[probe]), accepted))
        if not matcher.accept_tokens([token]):
            break
    return found


def taken(backend: GrammarBackend, spec: StructuredOutputsParams) -> CompiledGrammar | None:
    """``spec`` compiled by ``backend``, None where the backend does not take it."""
    if backend.unsupported_reason(spec) is not None:
        return None
    return backend.compile(spec)


# Each disagreed before the fix on the backend named: (backend, spec, texts walked).
REGRESSIONS: list[tuple[str, dict[str, Any], tuple[str, ...]]] = [
    # xgrammar masks a root rule as if nothing could follow it, also where it nests in itself.
    ("xgrammar", {"json": {"type": "object", "additionalProperties": {"$ref": "#"}}},
     ('{"a":{"b":{}}}', '{"a":{"b":{}},"c":{}}')),
    ("xgrammar", {"grammar": 'root ::= "(" root ")" | "x"'}, ("((x))", "(((x)))")),
    ("xgrammar", {"grammar": 'root ::= "[" root "]" | "{" root "}" | "x"'}, ("[{[x]}]",)),
    # llguidance's mask allowed only the canonical tokens of forced text.
    ("guidance", {"json": {"const": "hello\u0000there"}}, ('"hello\\u0000there"', '"hellothere"')),
    ("guidance", {"json": {"type": "object", "properties": {
        "v": {"type": "string", "pattern": "^[A-Z][a-z]+$"}}, "required": ["v"]}},
     ('{"v":"Aq"}', '{"v":5}')),
    ("guidance", {"json": {"type": "object", "properties": {
        "foo": {"enum": ["foo"]}, "bar": {"enum": ["bar"]}}, "required": ["foo", "bar"]}},
     ('{"foo":"foo","bar":"bar"}', '{"foo":"foo","bar":"bart"}')),
    ("guidance", {"grammar": 'root ::= "(" root ")" | "x"'}, ("((x))", "(((x)))")),
]  # fmt: skip


@pytest.mark.parametrize(("failed_on", "kwargs", "texts"), REGRESSIONS, ids=lambda c: str(c)[:40])
def test_states_that_disagreed(
    backends: dict[str, GrammarBackend],
    tokenizer: Tokenizer,
    failed_on: str,
    kwargs: dict[str, Any],
    texts: tuple[str, ...],
) -> None:
    """Each backend that takes the spec, the one that disagreed included; xgrammar's grammar
    also after the compile worker's export and import."""
    spec = StructuredOutputsParams(**kwargs)
    assert backends[failed_on].unsupported_reason(spec) is None
    for name in BACKENDS:
        compiled = taken(backends[name], spec)
        if compiled is None:
            continue
        copies = [compiled]
        if name == "xgrammar":
            backend = backends[name]
            copies.append(backend.import_compiled(spec, backend.export_compiled(compiled)))
        for grammar in copies:
            for text in texts:
                assert disagreements(grammar, tokenizer, text, 16, text) == [], name


# The shared schemas where the grammar bench counted disagreements before the fixes.
SHARED = [
    "schemastore/jdt.json",
    "schemastore/jsone.json",
    "schemastore/unist.json",
    "schemastore/abc-supply-plan-1.0.0.json",
    "schemastore/djlint.json",
    "schemastore/mail-servers-config.json",
    "json-schema-test-suite/const--14-nul-characters-in-strings.json",
    "json-schema-test-suite/enum--03-enums-in-properties.json",
]


@pytest.mark.parametrize("name", SHARED)
def test_shared_schemas_that_disagreed(
    backends: dict[str, GrammarBackend], tokenizer: Tokenizer, shared_data: Path, name: str
) -> None:
    """Every test instance of the file (as the bench feeds it: properties in schema order,
    integral numbers without a fraction), on every backend that takes the schema."""
    from baton.bench.grammars.grammar_worker import fed_as_written

    case = json.loads((shared_data / name).read_text(encoding="utf-8"))
    spec = StructuredOutputsParams(json=case["schema"])
    walked = 0
    for backend_name in BACKENDS:
        compiled = taken(backends[backend_name], spec)
        if compiled is None:
            continue
        for test in case["tests"]:
            text = compact(fed_as_written(case["schema"], test["data"]))
            found = disagreements(compiled, tokenizer, text, 8, f"{name}:{text}")
            assert found == [], (backend_name, found[:3])
            walked += 1
    assert walked


def fuzz_texts(seed: int, count: int) -> Iterator[tuple[dict[str, Any], str, bool]]:
    for schema, instances in schema_fuzz.cases(seed, count):
        for instance, valid in instances:
            yield schema, compact(instance), valid


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_fuzzed_schemas(
    backends: dict[str, GrammarBackend], tokenizer: Tokenizer, backend_name: str
) -> None:
    """A deterministic sweep of fuzzed schemas (valid instances and mutants, walked until
    refused): no disagreement; the backend takes some of them and accepts valid instances."""
    backend = backends[backend_name]
    compiled_by_schema: dict[str, CompiledGrammar | None] = {}
    found: list[Disagreement] = []
    walked = accepted_valid = 0
    for schema, text, valid in fuzz_texts(seed=0, count=40):
        key = json.dumps(schema)
        if key not in compiled_by_schema:
            compiled_by_schema[key] = taken(backend, StructuredOutputsParams(json=schema))
        compiled = compiled_by_schema[key]
        if compiled is None:
            continue
        walked += 1
        found += disagreements(compiled, tokenizer, text, 4, f"{key}:{text}")
        if valid:
            matcher = compiled.new_matcher()
            accepted_valid += matcher.accept_tokens([*ids(tokenizer, text), EOS])
    assert found == [], found[:5]
    assert walked >= 40 and accepted_valid >= 10, (walked, accepted_valid)


def test_unshare_root_renames_the_rule_only() -> None:
    """The root rule is renamed where the grammar refers to it, never inside literals, classes
    or longer names; a grammar that does not refer to it is left as it is."""
    from baton.grammar.xgrammar.rewrites import unshare_root

    text = "\n".join(
        [
            'root ::= (("{" root_1 "}") | ("root" [root] root.x root))',
            "root_1 ::= ((root) | (xroot))",
            "root_self ::= ((root_1))",
        ]
    )
    assert unshare_root(text).split("\n") == [
        'root_self_ ::= (("{" root_1 "}") | ("root" [root] root.x root_self_))',
        "root_1 ::= ((root_self_) | (xroot))",
        "root_self ::= ((root_1))",
        "root ::= ((root_self_))",
    ]
    plain = 'root ::= (("{" root_1 "}"))\nroot_1 ::= (("root"))'
    assert unshare_root(plain) == plain
