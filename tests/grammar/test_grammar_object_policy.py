"""Closed objects by default in every backend, open ones per request (docs/design.md, "Objects
are closed by default"): each backend's mask and matcher close an undeclared property unless
the request sets ``open_objects``; a backend that cannot write open objects exactly refuses
them, and ``auto`` then takes one that can; the HTTP field, and the 400 when a request asks
for open and closed objects at once."""

from __future__ import annotations

import json
import time
from typing import Any

import jsonschema
import pytest
from grammar_testing import EOS, allowed, every_backend, ids

from baton.engine.server.constraints import request_constraint
from baton.engine.server.errors import APIError
from baton.engine.server.protocol import CompletionRequest
from baton.engine.tokenizer import Tokenizer
from baton.grammar.backend import BackendRecipe, CompiledGrammar, GrammarBackend, GrammarError
from baton.grammar.compile.service import CompileService
from baton.grammar.schema.normalise import close_object_schemas
from baton.grammar.spec import StructuredOutputsParams as Spec

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
DECLARED = {"a": 1}
EXTRA = {"a": 1, "b": 2}  # valid JSON Schema, outside the closed reading
# Backends that write open objects exactly; outlines-core writes only declared properties.
HONOURS_OPEN = ("xgrammar", "guidance")


@pytest.fixture(scope="module")
def backends(tokenizer: Tokenizer) -> dict[str, GrammarBackend]:
    return every_backend(tokenizer)


def text(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def walk(tokenizer: Tokenizer, grammar: CompiledGrammar, value: Any) -> bool:
    """Whether the matcher takes ``value`` (compact JSON) token by token, then EOS; checks at
    each step that the mask allows the token the matcher takes."""
    matcher = grammar.new_matcher()
    for token in [*ids(tokenizer, text(value)), EOS]:
        in_mask = token in allowed(matcher)
        taken = matcher.accept_tokens([token])
        assert in_mask == taken, (value, token)
        if not taken:
            return False
    return matcher.is_terminated()


@pytest.mark.parametrize("name", ["xgrammar", "outlines", "guidance"])
def test_every_backend_closes_an_undeclared_property_by_default(
    backends: dict[str, GrammarBackend], tokenizer: Tokenizer, name: str
) -> None:
    jsonschema.validate(DECLARED, close_object_schemas(SCHEMA))
    jsonschema.validate(EXTRA, SCHEMA)
    assert not jsonschema.Draft202012Validator(close_object_schemas(SCHEMA)).is_valid(EXTRA)
    backend = backends[name]
    for spec in (Spec(json=SCHEMA), Spec(json=SCHEMA, disable_additional_properties=True)):
        assert backend.unsupported_reason(spec) is None
        grammar = backend.compile(spec)
        assert walk(tokenizer, grammar, DECLARED)
        assert not walk(tokenizer, grammar, EXTRA)
        # After the declared member, the mask holds only the object's end (or more digits).
        matcher = grammar.new_matcher()
        assert matcher.accept_tokens(ids(tokenizer, '{"a":1'))
        assert ids(tokenizer, ",")[0] not in allowed(matcher)
    # An object that declares no names is any object, closed policy or not.
    free = backend.compile(Spec(json={"type": "object"}))
    assert walk(tokenizer, free, {}) and walk(tokenizer, free, {"k": [1, "x"]})
    nested = {"type": "object", "properties": {"meta": {"type": "object"}}, "required": ["meta"]}
    grammar = backend.compile(Spec(json=nested))
    assert walk(tokenizer, grammar, {"meta": {"k": 1}})
    assert not walk(tokenizer, grammar, {"meta": {}, "b": 2})
    # vLLM's disable_additional_properties closes it too.
    closed = backend.compile(Spec(json={"type": "object"}, disable_additional_properties=True))
    assert walk(tokenizer, closed, {}) and not walk(tokenizer, closed, {"k": 1})
    # A tool without parameters declares none by name: {} only.
    no_args = backend.compile(Spec(json={"type": "object", "properties": {}}))
    assert walk(tokenizer, no_args, {}) and not walk(tokenizer, no_args, {"k": 1})


@pytest.mark.parametrize("name", ["xgrammar", "outlines", "guidance"])
def test_open_objects_are_honoured_or_refused(
    backends: dict[str, GrammarBackend], tokenizer: Tokenizer, name: str
) -> None:
    backend = backends[name]
    spec = Spec(json=SCHEMA, open_objects=True)
    if name not in HONOURS_OPEN:
        # Refused, lenient or not: never narrowed to the declared names silently.
        for refused in (spec, Spec(json=SCHEMA, open_objects=True, allow_unenforced=True)):
            reason = backend.unsupported_reason(refused)
            assert reason is not None and "open_objects" in reason, reason
            with pytest.raises(GrammarError, match="open_objects"):
                backend.compile(refused)
        return
    assert backend.unsupported_reason(spec) is None
    grammar = backend.compile(spec)
    for value in (DECLARED, EXTRA, {"a": 1, "b": {"c": [None]}}):
        jsonschema.validate(value, SCHEMA)
        assert walk(tokenizer, grammar, value), value
    for value in ({"a": "x"}, {"b": 2}):
        assert not jsonschema.Draft202012Validator(SCHEMA).is_valid(value)
        assert not walk(tokenizer, grammar, value), value
    free = backend.compile(Spec(json={"type": "object"}, open_objects=True))
    assert walk(tokenizer, free, {"k": [1, "x"]})


# Schemas whose open objects xgrammar cannot write exactly (llguidance takes the second, and
# implements no unevaluatedProperties at all).
XGRAMMAR_REFUSES_OPEN = {
    "unevaluatedProperties": (
        {
            "type": "object",
            "allOf": [{"properties": {"a": {"type": "integer"}}}],
            "unevaluatedProperties": {"type": "string"},
        },
        {"a": 1, "z": "s"},
        {"a": 1, "z": 2},
    ),
    "escaped name": (
        {"type": "object", "properties": {"a\nb": {"type": "integer"}}},
        {"a\nb": 1, "c": "x"},
        {"a\nb": "x"},
    ),
}


@pytest.mark.parametrize("case", sorted(XGRAMMAR_REFUSES_OPEN))
def test_xgrammar_refuses_open_objects_it_would_widen(
    backends: dict[str, GrammarBackend], tokenizer: Tokenizer, case: str
) -> None:
    schema, valid, invalid = XGRAMMAR_REFUSES_OPEN[case]
    spec = Spec(json=schema, open_objects=True)
    reason = backends["xgrammar"].unsupported_reason(spec)
    assert reason is not None and "open_objects" in reason, reason
    with pytest.raises(GrammarError, match="open_objects"):
        backends["xgrammar"].compile(spec)
    assert backends["xgrammar"].unsupported_reason(Spec(json=schema)) is None  # closed: taken
    validator = jsonschema.Draft202012Validator(schema)
    assert validator.is_valid(valid) and not validator.is_valid(invalid)
    if case == "escaped name":
        grammar = backends["guidance"].compile(spec)
        assert walk(tokenizer, grammar, valid) and not walk(tokenizer, grammar, invalid)


def test_open_and_closed_at_once_is_a_value_error_naming_both() -> None:
    with pytest.raises(ValueError, match="open_objects and disable_additional_properties"):
        Spec(json=SCHEMA, open_objects=True, disable_additional_properties=True)
    with pytest.raises(ValueError, match="open_objects must be a bool"):
        Spec(json=SCHEMA, open_objects="yes")  # type: ignore[arg-type]
    # The option is part of the compiled grammar's key; vLLM's closing option is not.
    assert Spec(json=SCHEMA).options_key != Spec(json=SCHEMA, open_objects=True).options_key
    plain, closed = Spec(json=SCHEMA), Spec(json=SCHEMA, disable_additional_properties=True)
    assert plain.options_key == closed.options_key


def test_auto_picks_per_schema_a_backend_that_takes_the_policy(tokenizer: Tokenizer) -> None:
    recipes = {
        name: BackendRecipe(name, target)
        for name, target in (
            ("xgrammar", "baton.grammar.xgrammar.backend:XGrammarBackend"),
            ("outlines", "baton.grammar.outlines.backend:OutlinesBackend"),
            ("guidance", "baton.grammar.guidance.backend:GuidanceBackend"),
        )
    }
    service = CompileService(recipes, tokenizer, tokenizer.vocab_size)
    try:
        names, _ = service.candidates(Spec(json=SCHEMA))
        assert names == ["xgrammar", "outlines", "guidance"]
        names, reasons = service.candidates(Spec(json=SCHEMA, open_objects=True))
        assert names == ["xgrammar", "guidance"] and "open_objects" in reasons["outlines"]
        escaped = XGRAMMAR_REFUSES_OPEN["escaped name"][0]
        assert service.candidates(Spec(json=escaped))[0][0] == "xgrammar"
        names, reasons = service.candidates(Spec(json=escaped, open_objects=True))
        assert names == ["guidance"], reasons
        # No backend writes these open objects exactly: refused, never closed instead.
        unevaluated = XGRAMMAR_REFUSES_OPEN["unevaluatedProperties"][0]
        assert service.candidates(Spec(json=unevaluated))[0][0] == "xgrammar"
        assert service.candidates(Spec(json=unevaluated, open_objects=True))[0] == []
        # A free-form object: outlines writes any object, so all three take it open.
        free = Spec(json={"type": "object"}, open_objects=True)
        assert service.candidates(free)[0] == ["xgrammar", "outlines", "guidance"]
        # Compiled in the workers: each policy its own grammar, served by the chosen backend.
        results = {}
        for name, spec in {
            "closed": Spec(json=escaped),
            "open": Spec(json=escaped, open_objects=True),
            "unevaluated": Spec(json=unevaluated, open_objects=True),
        }.items():
            handle = service.submit(spec)
            deadline = time.monotonic() + 120
            while (result := handle.result()) is None:
                assert time.monotonic() < deadline, "the compile never ended"
                time.sleep(0.01)
            results[name] = result
        assert results["closed"].backend == "xgrammar" and results["open"].backend == "guidance"
        assert results["unevaluated"].grammar is None
        assert "open_objects" in (results["unevaluated"].error or "")
        valid = XGRAMMAR_REFUSES_OPEN["escaped name"][1]
        for name, accepts in (("closed", False), ("open", True)):
            grammar = results[name].grammar
            assert grammar is not None and walk(tokenizer, grammar, valid) == accepts
    finally:
        service.shutdown()


def constraint(field: dict[str, Any], backend: str | None = None) -> Spec:
    body: dict[str, Any] = {"prompt": "x", "structured_outputs": field}
    if backend is not None:
        body["guided_decoding_backend"] = backend
    found = request_constraint(CompletionRequest.model_validate(body), "auto")
    assert found is not None
    return found.spec


def test_the_http_field_and_the_400_on_a_contradiction() -> None:
    assert constraint({"json": SCHEMA}).open_objects is False
    assert constraint({"json": SCHEMA, "open_objects": True}).open_objects is True
    assert constraint({"json": SCHEMA}, "xgrammar:open-objects").open_objects is True
    spec = constraint({"json": SCHEMA, "disable_additional_properties": True})
    assert spec.disable_additional_properties and not spec.open_objects
    contradictions = [
        ({"json": SCHEMA, "open_objects": True, "disable_additional_properties": True}, None),
        ({"json": SCHEMA, "open_objects": True}, "guidance:disable-additional-properties"),
    ]
    for field, backend in contradictions:
        with pytest.raises(APIError) as info:
            constraint(field, backend)
        assert info.value.status == 400 and info.value.param == "structured_outputs"
        assert "open_objects" in str(info.value) and "disable_additional_properties" in str(
            info.value
        )


def test_structural_tag_schemas_follow_the_policy(
    backends: dict[str, GrammarBackend], tokenizer: Tokenizer
) -> None:
    def tag(**options: Any) -> dict[str, Any]:
        content = {"type": "json_schema", "json_schema": SCHEMA, **options}
        return {
            "type": "structural_tag",
            "format": {"type": "tag", "begin": "<a>", "content": content, "end": "</a>"},
        }

    xgrammar = backends["xgrammar"]
    closed = xgrammar.compile(Spec(structural_tag=tag()))
    opened = xgrammar.compile(Spec(structural_tag=tag(), open_objects=True))
    for grammar, extra_ok in ((closed, False), (opened, True)):
        matcher = grammar.new_matcher()
        assert matcher.accept_tokens(ids(tokenizer, f"<a>{text(DECLARED)}</a>"))
        matcher = grammar.new_matcher()
        taken = all(matcher.accept_tokens([t]) for t in ids(tokenizer, f"<a>{text(EXTRA)}</a>"))
        assert taken == extra_ok
    # A format xgrammar compiles itself (its own options) would be closed: refused open.
    own = Spec(structural_tag=tag(any_order=True), open_objects=True)
    reason = xgrammar.unsupported_reason(own)
    assert reason is not None and "open_objects" in reason, reason
    with pytest.raises(GrammarError, match="open_objects"):
        xgrammar.compile(own)
    assert xgrammar.unsupported_reason(Spec(structural_tag=tag(any_order=True))) is None
