"""gpt-oss's harmony output read from its token ids: the messages a completion holds.

A completion written after the prompt's ``<|start|>assistant`` is a sequence of messages, each
``<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>TYPE]<|message|>BODY`` closed by ``<|end|>``
(more follow, each after ``<|start|>ROLE``), ``<|call|>`` (a tool call) or ``<|return|>`` (the
answer is done). The recipient may also follow the role (``<|start|>assistant to=functions.f``).
The special tokens are read as ids because the detokenised text leaves them out. Tokens before
the first marker are the body of a message the prompt opened (e.g. one ending
``<|channel|>analysis<|message|>``), or text a model wrote without a header: both are read as
the analysis channel's.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

_MARKERS = ("<|start|>", "<|channel|>", "<|constrain|>", "<|message|>")
_ENDS = ("<|end|>", "<|call|>", "<|return|>")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


@dataclass(frozen=True)
class HarmonyMessage:
    """One message of a completion: its channel ("analysis", "commentary", "final"; "" when
    its header names none), recipient ("functions.NAME" for a tool call; "" for none), the
    ``<|constrain|>`` type ("json"; "" for none), body text, and whether it was closed."""

    channel: str
    recipient: str
    constrain: str
    body: str
    closed: bool


@dataclass(frozen=True)
class HarmonyTokens:
    """The ids of harmony's special tokens in one tokenizer (``of``).

    Raises:
        ValueError: a marker that is not a single token of the tokenizer.
    """

    ids: dict[str, int]

    @classmethod
    def of(cls, tokenizer: Any) -> HarmonyTokens:
        ids = {}
        for text in (*_MARKERS, *_ENDS):
            encoded = tokenizer.encode(text, add_special_tokens=False)
            if len(encoded) != 1:
                raise ValueError(
                    f"harmony needs {text!r} as one token of the model's vocabulary; this "
                    f"tokenizer encodes it as {len(encoded)} tokens"
                )
            ids[text] = encoded[0]
        return cls(ids)


def _header(text: str) -> tuple[str, str, str]:
    """(channel, recipient, constrain type) of a header's text (special tokens kept)."""
    recipient = _RECIPIENT.search(text)
    after_channel = text.partition("<|channel|>")[2].partition("<|constrain|>")[0].split()
    constrain = text.partition("<|constrain|>")[2].split()
    return (
        after_channel[0] if after_channel else "",
        recipient.group(1) if recipient else "",
        constrain[0] if constrain else "",
    )


def harmony_messages(
    token_ids: Sequence[int], special: HarmonyTokens, decode: Any
) -> list[HarmonyMessage]:
    """The messages of a completion's ``token_ids`` (the last one possibly open: header or
    body still being written; one whose header is not done is left out; an open body's
    trailing U+FFFD, a character still arriving, is left out too, as the engine's
    detokeniser holds it back). ``decode(ids, skip_special_tokens)`` is the tokenizer's."""
    by_id = {i: text for text, i in special.ids.items()}
    messages: list[HarmonyMessage] = []
    header: list[int] = []
    body: list[int] = []
    in_body = True  # tokens before any marker: a body the prompt opened
    header_text = "<|channel|>analysis"

    def close(closed: bool) -> None:
        if in_body:
            text = decode(body, skip_special_tokens=True)
            if not closed:  # a character whose bytes are not all written yet: held back
                text = text.rstrip("\ufffd")
            messages.append(HarmonyMessage(*_header(header_text), text, closed))

    for token in token_ids:
        marker = by_id.get(token)
        if marker in _ENDS:
            close(True)
            in_body, header, body = False, [], []
        elif marker == "<|message|>" and not in_body:
            header_text = decode(header, skip_special_tokens=False)
            in_body, body = True, []
        elif marker == "<|start|>" or (marker == "<|channel|>" and in_body):  # a new header
            if in_body and body:
                close(False)
            in_body, header, body = False, [token] if marker == "<|channel|>" else [], []
        elif in_body:
            body.append(token)
        else:
            header.append(token)
    if in_body:
        close(False)
    return messages
