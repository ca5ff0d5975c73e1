"""Helpers of the outlines-core backend's tests (tests/grammar/test_grammar_outlines*.py): a
compile cache, token ids, whether a text is accepted, compact JSON."""

from __future__ import annotations

import json
from typing import Any

from baton.engine.tokenizer import Tokenizer
from baton.grammar.outlines.backend import OutlinesBackend, OutlinesCompiledGrammar
from baton.grammar.spec import StructuredOutputsParams

_COMPILED: dict[tuple[Any, ...], OutlinesCompiledGrammar] = {}


def _compile(backend: OutlinesBackend, spec: StructuredOutputsParams) -> OutlinesCompiledGrammar:
    key = (
        id(backend),
        spec.kind,
        json.dumps(spec.schema) if spec.kind == "json" else spec.spec_text,
    )
    key += (spec.options_key, spec.allow_unenforced)
    if key not in _COMPILED:
        _COMPILED[key] = backend.compile(spec)
    return _COMPILED[key]


def _ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _accepts(
    backend: OutlinesBackend, tokenizer: Tokenizer, spec: StructuredOutputsParams, text: str
) -> bool:
    """Whether the whole text followed by EOS is accepted (and terminates the matcher)."""
    matcher = _compile(backend, spec).new_matcher()
    ok = matcher.accept_tokens([*_ids(tokenizer, text), tokenizer.eos_token_ids[0]])
    return ok and matcher.is_terminated()


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
