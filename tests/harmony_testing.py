"""Helpers of the harmony format's tests (tests/engine/server/test_harmony*.py): token ids of a
text, the weather tool's schema."""

from __future__ import annotations

from typing import Any


def _ids(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
