"""grammar/schema: the one $ref resolver (JSON pointers percent-decoded, then ~1 and ~0
unescaped) that validation and every backend's schema walk use."""

from __future__ import annotations

import pytest

from baton.grammar.schema.outlines_prepare import prepare_schema
from baton.grammar.schema.refs import (
    PointerNotFound,
    is_local_ref,
    pointer_tokens,
    resolve_pointer,
    resolves,
)
from baton.grammar.schema.xgrammar_keywords import xgrammar_unenforced_keywords
from baton.grammar.spec import StructuredOutputsParams
from baton.grammar.validation import validate_spec

# A definition named "a/b~c%d e": '/' is ~1, '~' is ~0, then the fragment percent-encodes '%'
# as %25 and the space as %20.
NAME = "a/b~c%d e"
REF = "#/$defs/a~1b~0c%25d%20e"
SCHEMA = {"$defs": {NAME: {"type": "integer", "minimum": 3}}, "$ref": REF}


def test_pointer_tokens_decode_percent_then_tilde() -> None:
    assert pointer_tokens(REF[1:]) == ["$defs", NAME]
    assert pointer_tokens("") == []
    assert pointer_tokens("/") == [""]
    # ~01 is "~1" (not "/"): ~1 is unescaped before ~0.
    assert pointer_tokens("/~01") == ["~1"]
    assert pointer_tokens("/items/0") == ["items", "0"]


def test_resolve_pointer() -> None:
    assert resolve_pointer(SCHEMA, REF[1:]) == {"type": "integer", "minimum": 3}
    assert resolve_pointer(SCHEMA, "") is SCHEMA
    assert resolve_pointer({"anyOf": [True, {"type": "null"}]}, "/anyOf/1") == {"type": "null"}
    assert pointer_tokens("/x%2525y") == ["x%25y"]  # decoded once only
    assert not resolves(SCHEMA, "/$defs/a/b~c%25d%20e")  # unescaped '/' splits the token
    with pytest.raises(PointerNotFound):
        resolve_pointer({"anyOf": [True]}, "/anyOf/1")
    assert is_local_ref("#") and is_local_ref("#/a")
    assert not is_local_ref("other.json#/a") and not is_local_ref("#anchor")


def test_every_walk_follows_an_escaped_pointer() -> None:
    validate_spec(StructuredOutputsParams(json=SCHEMA))  # the reference resolves
    with pytest.raises(ValueError, match="resolves to nothing"):
        validate_spec(StructuredOutputsParams(json={**SCHEMA, "$ref": "#/$defs/a~1b"}))
    # Both walks reach the target: xgrammar sees its keywords, outlines inlines it.
    assert xgrammar_unenforced_keywords(SCHEMA) == set()
    assert xgrammar_unenforced_keywords({**SCHEMA, "$defs": {NAME: {"not": {}}}}) == {"not"}
    prepared = prepare_schema(SCHEMA)
    assert prepared.error is None
    assert prepared.unenforced == ("minimum",)
    assert prepared.schema == {"type": "integer"}
