"""Helpers of the xgrammar backend's tests (tests/grammar/test_grammar_xgrammar*.py): compile a
spec, walk a text through a matcher, the JSON-Schema validators by draft."""

from __future__ import annotations

from typing import Any

import jsonschema
from grammar_testing import EOS, compact, ids

from baton.engine.tokenizer import Tokenizer
from baton.grammar.spec import StructuredOutputsParams
from baton.grammar.xgrammar.backend import XGrammarBackend, XGrammarCompiledGrammar


def compile_spec(backend: XGrammarBackend, **kwargs: Any) -> XGrammarCompiledGrammar:
    return backend.compile(StructuredOutputsParams(**kwargs))


def walk(tokenizer: Tokenizer, grammar: XGrammarCompiledGrammar, text: str) -> bool:
    """Whether the matcher takes ``text`` token by token and then EOS (which terminates it)."""
    matcher = grammar.new_matcher()
    for token in ids(tokenizer, text):
        if not matcher.accept_tokens([token]):
            return False
    return matcher.accept_tokens([EOS]) and matcher.is_terminated()


VALIDATORS = {
    "7": jsonschema.Draft7Validator,
    "2019-09": jsonschema.Draft201909Validator,
    "2020-12": jsonschema.Draft202012Validator,
}


def accepts(
    backend: XGrammarBackend,
    tokenizer: Tokenizer,
    schema: Any,
    value: Any,
    open_objects: bool = False,
) -> bool:
    spec = compile_spec(backend, json=schema, open_objects=open_objects)
    return walk(tokenizer, spec, compact(value))
