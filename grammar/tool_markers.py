"""A structural tag's marker strings as the single tokens a model was trained on.

A model's tool-call markers (``<tool_call>`` in Qwen's vocabulary, ``[TOOL_CALLS]`` in
Mistral's, harmony's ``<|channel|>`` ...) are added tokens, often control tokens. Written as
text, a grammar lets the model spell them in pieces it never wrote in training, and cannot
produce a control token at all (its text is no UTF-8 string a grammar matches).
``bind_markers`` rewrites the literal text of a structural tag so that each marker with a
token id becomes xgrammar's token format (``{"type": "token", "token": ID}``): that one id
and nothing else is allowed there.

Nothing here depends on a backend or on the engine; the ids come from the caller's tokenizer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

Markers = Mapping[str, int]
"""Marker text -> its token id (only markers that are one token of the vocabulary)."""


def token_format(token_id: int) -> dict[str, Any]:
    """xgrammar's format of exactly one token."""
    return {"type": "token", "token": token_id}


def literal_parts(text: str, markers: Markers) -> list[dict[str, Any]]:
    """``text`` as formats in order: constant strings between the markers, a token format for
    each marker (the longest marker wins where two start at the same place)."""
    ordered = sorted(markers, key=len, reverse=True)
    parts: list[dict[str, Any]] = []
    start = i = 0
    while i < len(text):
        marker = next((m for m in ordered if m and text.startswith(m, i)), None)
        if marker is None:
            i += 1
            continue
        if start < i:
            parts.append({"type": "const_string", "value": text[start:i]})
        parts.append(token_format(markers[marker]))
        i = start = i + len(marker)
    if start < len(text):
        parts.append({"type": "const_string", "value": text[start:]})
    return parts


def _sequence(parts: list[dict[str, Any]]) -> dict[str, Any]:
    if len(parts) == 1:
        return parts[0]
    if not parts:
        return {"type": "const_string", "value": ""}
    return {"type": "sequence", "elements": parts}


def _bind_tag(tag: dict[str, Any], markers: Markers) -> dict[str, Any]:
    """A tag whose begin or end holds markers: a leading marker becomes its begin token, a
    trailing one its end token, the rest of begin and end moves into its content."""
    begin, end = tag["begin"], tag["end"]
    content = bind_markers(tag["content"], markers)
    if not isinstance(begin, str) or not isinstance(end, str):
        return {**tag, "content": content}
    head, tail = literal_parts(begin, markers), literal_parts(end, markers)
    if all(p["type"] == "const_string" for p in head + tail):
        return {**tag, "content": content}
    # A begin or end without markers stays as it is (an unbounded content needs its end).
    new_begin: Any = begin
    if any(p["type"] == "token" for p in head):
        new_begin = head.pop(0) if head[0]["type"] == "token" else ""
    else:
        head = []
    new_end: Any = end
    if any(p["type"] == "token" for p in tail):
        new_end = tail.pop() if tail[-1]["type"] == "token" else ""
    else:
        tail = []
    return {
        "type": "tag",
        "begin": new_begin,
        "content": _sequence([*head, content, *tail]),
        "end": new_end,
    }


def bind_markers(fmt: dict[str, Any], markers: Markers) -> dict[str, Any]:
    """A copy of the structural-tag format ``fmt`` with every marker in its literal text
    (constant strings, tags' begin and end) written as its token. Triggered tags (free text
    until a trigger) are kept as they are: a token trigger would leave the marker's spelling
    in pieces to the free text, where a parser reading text would take it for a call.
    Separators stay text. Schema, regex and grammar contents are never touched."""
    if not markers:
        return fmt
    kind = fmt.get("type")
    if kind == "const_string":
        return _sequence(literal_parts(fmt["value"], markers))
    if kind == "tag":
        return _bind_tag(fmt, markers)
    if kind == "tags_with_separator":
        return {**fmt, "tags": [_bind_tag(t, markers) for t in fmt["tags"]]}
    if kind in ("sequence", "or"):
        return {**fmt, "elements": [bind_markers(e, markers) for e in fmt["elements"]]}
    if kind in ("optional", "plus", "star"):
        return {**fmt, "content": bind_markers(fmt["content"], markers)}
    return fmt
