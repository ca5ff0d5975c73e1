"""What the grammar backend tests share: the default model's vocabulary facts, token ids of a
text, the token ids a matcher's mask allows, compact JSON, the shared schema files, and every
backend over the default vocabulary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from baton.engine.tokenizer import Tokenizer
from baton.grammar.backend import GrammarBackend, GrammarMatcher, allocate_bitmask
from baton.grammar.guidance.backend import GuidanceBackend
from baton.grammar.outlines.backend import OutlinesBackend
from baton.grammar.xgrammar.backend import XGrammarBackend, bitmask_allowed

VOCAB = 49152
EOS = 2  # <|im_end|>
IM_START = 1


def ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def allowed(matcher: GrammarMatcher) -> set[int]:
    """The ids ``matcher``'s mask allows now."""
    bitmask = allocate_bitmask(1, VOCAB)
    matcher.fill_bitmask(bitmask, 0)
    return set(bitmask_allowed(bitmask, 0, VOCAB))


def compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def schema_files(shared_data: Path) -> list[Path]:
    """The SchemaStore and JSON-Schema-Test-Suite files of the shared data."""
    files = sorted((shared_data / "schemastore").glob("*.json"))
    files += sorted((shared_data / "json-schema-test-suite").glob("*.json"))
    return files


def every_backend(tokenizer: Tokenizer) -> dict[str, GrammarBackend]:
    """Each grammar backend by name, over ``tokenizer`` and the default vocabulary size."""
    return {
        "xgrammar": XGrammarBackend(tokenizer, VOCAB),
        "outlines": OutlinesBackend(tokenizer, VOCAB),
        "guidance": GuidanceBackend(tokenizer, VOCAB),
    }
