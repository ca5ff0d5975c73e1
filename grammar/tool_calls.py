"""Tool calls as a constraint and back: the structural tag that forces a model's tool-call
syntax, and the parser that reads the calls out of the generated text.

A model writes a tool call in a syntax of its own; ``ToolCallFormat`` describes one (the
Hermes syntax, ``HERMES``, is what models without their own use):

    <tool_call>
    {"name": "get_weather", "arguments": {"city":"Paris"}}
    </tool_call>

``tool_call_tag`` builds the structural tag that admits exactly the calls the request allows,
each call's arguments constrained to its function's parameters schema:

- ``auto``: free text in which a call may start at the trigger (``<tool_call>``); with an
  ``answer`` format, either calls only or an answer in that format;
- ``required``: calls only, at least one;
- a named function: ``required`` with that one function.

Without ``parallel`` at most one call is made. ``parse_tool_calls`` reads calls back from
(possibly unfinished) text, so a stream can send each call's arguments as they grow.
Nothing here depends on a backend or on the engine.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

ToolChoiceMode = Literal["auto", "required"]

FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""The names OpenAI's API accepts for a function (so a name never needs escaping)."""


@dataclass(frozen=True)
class FunctionTool:
    """One function the model may call.

    Attributes:
        name: the function's name (``FUNCTION_NAME``).
        parameters: the JSON schema of its arguments (an object schema).

    Raises:
        ValueError: a name outside ``FUNCTION_NAME``.
    """

    name: str
    parameters: dict[str, Any] | bool = field(
        default_factory=lambda: {"type": "object", "properties": {}}
    )

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not FUNCTION_NAME.fullmatch(self.name):
            raise ValueError(
                f"function name {self.name!r} must be 1-64 letters, digits, '_' or '-'"
            )


@dataclass(frozen=True)
class ToolCallFormat:
    """How a model writes one tool call: ``call_prefix + name + name_suffix + arguments +
    end``, calls separated by ``separator``; ``trigger`` (a prefix of ``call_prefix``) starts
    a call inside free text.

    Raises:
        ValueError: ``trigger`` is not a non-empty prefix of ``call_prefix``.
    """

    name: str
    trigger: str
    call_prefix: str
    name_suffix: str
    end: str
    separator: str

    def __post_init__(self) -> None:
        if not self.trigger or not self.call_prefix.startswith(self.trigger):
            raise ValueError("trigger must be a non-empty prefix of call_prefix")

    def begin(self, function: str) -> str:
        """The text before a call's arguments."""
        return f"{self.call_prefix}{function}{self.name_suffix}"

    def render(self, function: str, arguments: str) -> str:
        """One call as the model writes it (``arguments``: JSON text)."""
        return f"{self.begin(function)}{arguments}{self.end}"


HERMES = ToolCallFormat(
    name="hermes",
    trigger="<tool_call>",
    call_prefix='<tool_call>\n{"name": "',
    name_suffix='", "arguments": ',
    end="}\n</tool_call>",
    separator="\n",
)


def _call_tags(tools: Sequence[FunctionTool], fmt: ToolCallFormat) -> list[dict[str, Any]]:
    return [
        {
            "type": "tag",
            "begin": fmt.begin(t.name),
            "content": {"type": "json_schema", "json_schema": t.parameters},
            "end": fmt.end,
        }
        for t in tools
    ]


def tool_call_tag(
    tools: Sequence[FunctionTool],
    mode: ToolChoiceMode,
    *,
    parallel: bool = True,
    fmt: ToolCallFormat = HERMES,
    answer: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The structural tag (xgrammar's form) admitting the tool calls a request allows.

    Args:
        tools: the functions that may be called (one, for a named tool choice).
        mode: "auto" (text or calls) or "required" (calls only, at least one).
        parallel: several calls allowed; else at most one.
        fmt: the model's tool-call syntax.
        answer: with "auto", a structural-tag format the answer must follow when no tool is
            called (e.g. ``{"type": "json_schema", ...}`` for a response format); the output
            is then either calls only or such an answer.

    Raises:
        ValueError: no tools, duplicate names, or ``answer`` with mode "required".
    """
    if not tools:
        raise ValueError("tool_call_tag needs at least one tool")
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate function names in {names}")
    tags = _call_tags(tools, fmt)
    calls_only = {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": fmt.separator,
        "at_least_one": True,
        "stop_after_first": not parallel,
    }
    if mode == "required":
        if answer is not None:
            raise ValueError("an answer format needs mode 'auto'")
        return {"type": "structural_tag", "format": calls_only}
    if answer is not None:
        either = {"type": "or", "elements": [calls_only, answer]}
        return {"type": "structural_tag", "format": either}
    return {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": [fmt.trigger],
            "tags": tags,
            "at_least_one": False,
            "stop_after_first": not parallel,
        },
    }


@dataclass(frozen=True)
class ParsedToolCall:
    """One call read from the text: its arguments as written (JSON text), and whether its end
    was seen (an unfinished call holds what has arrived so far)."""

    name: str
    arguments: str
    complete: bool


@dataclass(frozen=True)
class ParsedOutput:
    """Text outside the calls, and the calls, in order."""

    content: str
    tool_calls: tuple[ParsedToolCall, ...]


def _held_back(text: str, marker: str) -> int:
    """Length of the longest proper suffix of ``text`` that begins ``marker``: text that may
    yet turn out to be the marker."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _without_cut_end(arguments: str, end: str) -> str:
    """An unfinished call's ``arguments`` less a start of ``end`` cut off after them, when
    what comes before it is a whole JSON value (the call was cut inside its end marker);
    otherwise all of ``arguments`` (it was cut inside them)."""
    for n in range(min(len(arguments), len(end) - 1), 0, -1):
        if end.startswith(arguments[-n:]):
            try:
                json.loads(arguments[:-n])
            except ValueError:
                continue
            return arguments[:-n]
    return arguments


def parse_tool_calls(text: str, fmt: ToolCallFormat = HERMES, *, final: bool) -> ParsedOutput:
    """The calls in ``text`` and the text around them.

    Calls are found at ``fmt.trigger``; the grammar that produced ``text`` makes every trigger
    the start of a call. Text around calls becomes ``content``: with no call, the text itself;
    with calls, the text before the first (trailing whitespace dropped) and each non-blank
    stretch after one, stripped, on its own line.

    Unless ``final``, what may still change is held back: trailing whitespace, a partial
    trigger, a call whose name has not ended, and the end of each unfinished call's arguments
    that may be the start of ``fmt.end``. So the content and the arguments of an earlier
    parse are always prefixes of a later one's, and a stream can send the difference. With
    ``final``, an unfinished call keeps all its arguments (less the start of ``fmt.end`` when
    the text was cut inside it after whole arguments), and a call header cut before its name
    ends stays in the content.
    """
    stretches = [""]  # text between calls: before the first, between, after the last
    calls: list[ParsedToolCall] = []
    pos = 0
    while True:
        start = text.find(fmt.trigger, pos)
        if start < 0:
            rest = text[pos:]
            if not final:
                rest = rest[: len(rest) - _held_back(rest, fmt.trigger)]
            stretches[-1] += rest
            break
        stretches[-1] += text[pos:start]
        header = text[start : start + len(fmt.call_prefix)]
        if not fmt.call_prefix.startswith(header):
            # Not a call after all (only unconstrained text can do this): keep it as text.
            stretches[-1] += fmt.trigger
            pos = start + len(fmt.trigger)
            continue
        name_start = start + len(fmt.call_prefix)
        name_end = text.find(fmt.name_suffix, name_start) if header == fmt.call_prefix else -1
        if name_end < 0:
            # A header still arriving (or, final, cut short): not a call yet.
            if final:
                stretches[-1] += text[start:]
            break
        args_start = name_end + len(fmt.name_suffix)
        end = text.find(fmt.end, args_start)
        if end < 0:
            arguments = text[args_start:]
            if not final:
                arguments = arguments[: len(arguments) - _held_back(arguments, fmt.end)]
            else:
                arguments = _without_cut_end(arguments, fmt.end)
            calls.append(ParsedToolCall(text[name_start:name_end], arguments, False))
            break
        calls.append(ParsedToolCall(text[name_start:name_end], text[args_start:end], True))
        stretches.append("")
        pos = end + len(fmt.end)
    if not calls:
        return ParsedOutput(stretches[0] if final else stretches[0].rstrip(), ())
    parts = [stretches[0].rstrip()] + [s.strip() for s in stretches[1:]]
    return ParsedOutput("\n".join(p for p in parts if p), tuple(calls))
