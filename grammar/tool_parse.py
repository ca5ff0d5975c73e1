"""Tool calls read back out of generated text, in any ``ToolCallFormat``.

``parse_tool_calls`` works on whole answers and on the text a stream has so far: what may
still change is held back, so each parse's content and arguments are prefixes of the next
one's and a stream can send the difference. A call's arguments come back as JSON text: as the
model wrote them (JSON formats), or built from Qwen's XML parameters, each value read as its
schema's type says (a parameter joins the arguments once its ``</parameter>`` arrives).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from baton.grammar.tool_formats import FUNCTION_NAME, HERMES, FunctionTool, ToolCallFormat

_DECODER = json.JSONDecoder()
_NAME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
_PARAM_OPEN = "<parameter="
_PARAM_CLOSE = "</parameter>"
_FUNCTION_CLOSE = "</function>"
# String keywords whose check needs the value without the whitespace the grammar lets the
# model write around it.
_EXACT_STRING_KEYS = frozenset({"enum", "const", "maxLength", "minLength", "pattern", "format"})

# How far a piece of text got: not a call after all (it stays content); may still become one
# or continue one (held back); a call whose end has not arrived; a finished call or block.
_State = Literal["not", "wait", "open", "done"]


@dataclass(frozen=True)
class ParsedToolCall:
    """One call read from the text: its arguments as JSON text, and whether its end was seen
    (an unfinished call holds what has arrived so far)."""

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


def _match(text: str, pos: int, expected: str) -> Literal["full", "part", "no"]:
    """Whether ``text`` at ``pos`` holds ``expected``, ends inside it, or differs."""
    if text.startswith(expected, pos):
        return "full"
    return "part" if expected.startswith(text[pos:]) else "no"


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _schema_types(schema: dict[str, Any]) -> set[str] | None:
    """The JSON types a property schema names (enum and const of strings: "string"); None
    when it names none."""
    t = schema.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list) and all(isinstance(x, str) for x in t):
        return set(t)
    values = schema["enum"] if "enum" in schema else [schema["const"]] if "const" in schema else []
    if isinstance(values, list) and values and all(isinstance(v, str) for v in values):
        return {"string"}
    return None


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}.get(type(value), "null")


def xml_value(raw: str, schema: Any) -> Any:
    """A Qwen XML parameter's value (the text between ``<parameter=p>`` and
    ``</parameter>``) read as its property ``schema`` says, as vLLM's ``qwen3_coder`` parser
    does: a string loses the one newline the model writes on each side (all surrounding
    whitespace where the schema checks the string's exact text: enum, length, pattern),
    other types are JSON (a value that is not stays a string); an undeclared parameter is a
    string, and one of no named type JSON where it parses."""
    text = raw[1:] if raw.startswith("\n") else raw
    text = text[:-1] if text.endswith("\n") else text
    if schema is None:
        return text
    types = _schema_types(schema) if isinstance(schema, dict) else None
    if types is not None and types <= {"string", "null"} and "string" in types:
        return raw.strip() if _EXACT_STRING_KEYS & schema.keys() else text
    try:
        value = json.loads(raw.strip())
    except ValueError:
        return raw.strip() if types is None else text
    kind = _json_type(value)
    if types is None or kind in types or (kind == "integer" and "number" in types):
        return value
    return text if "string" in types else value


def _properties(tools: Sequence[FunctionTool], name: str) -> dict[str, Any]:
    for t in tools:
        if t.name == name and isinstance(t.parameters, dict):
            props = t.parameters.get("properties")
            return props if isinstance(props, dict) else {}
    return {}


def _json_arguments(
    text: str, name: str, start: int, fmt: ToolCallFormat
) -> tuple[_State, ParsedToolCall, int]:
    """A call's JSON arguments from ``start``: the whole value once it closes (no end marker
    is looked for inside it), else all the text so far."""
    try:
        _, stop = _DECODER.raw_decode(text, start)
    except ValueError:  # still arriving (or not JSON: then the rest is the arguments)
        return "open", ParsedToolCall(name, text[start:], False), len(text)
    arguments = text[start:stop]
    seen = _match(text, stop, fmt.end)
    if seen == "full":
        return "done", ParsedToolCall(name, arguments, True), stop + len(fmt.end)
    if seen == "part":
        return "open", ParsedToolCall(name, arguments, False), len(text)
    return "done", ParsedToolCall(name, arguments, True), stop  # unconstrained text


def _xml_arguments(
    text: str, name: str, start: int, fmt: ToolCallFormat, tools: Sequence[FunctionTool]
) -> tuple[_State, ParsedToolCall, int]:
    """A call's Qwen XML parameters from ``start`` as JSON text: ``{`` at once, each member
    when its parameter closes, ``}`` when the function does."""
    props = _properties(tools, name)
    members: list[str] = []
    closing = fmt.end.lstrip()  # the grammar allows any whitespace before the end
    pos = start
    while True:
        q = _skip_space(text, pos)
        if text.startswith(_PARAM_OPEN, q):
            gt = text.find(">", q + len(_PARAM_OPEN))
            close = text.find(_PARAM_CLOSE, gt + 1) if gt >= 0 else -1
            if close < 0:
                break
            key = text[q + len(_PARAM_OPEN) : gt]
            value = xml_value(text[gt + 1 : close], props.get(key))
            members.append(f"{json.dumps(key)}: {json.dumps(value, ensure_ascii=False)}")
            pos = close + len(_PARAM_CLOSE)
            continue
        seen = _match(text, q, closing)
        so_far = "{" + ", ".join(members)
        if seen == "full":
            return "done", ParsedToolCall(name, so_far + "}", True), q + len(closing)
        if seen == "part" or _PARAM_OPEN.startswith(text[q:]):
            break
        return "done", ParsedToolCall(name, so_far + "}", True), q  # unconstrained text
    function_closed = text.startswith(_FUNCTION_CLOSE, _skip_space(text, pos))
    arguments = "{" + ", ".join(members) + ("}" if function_closed else "")
    return "open", ParsedToolCall(name, arguments, False), len(text)


def _read_call(
    text: str, pos: int, fmt: ToolCallFormat, tools: Sequence[FunctionTool]
) -> tuple[_State, ParsedToolCall | None, int]:
    """The call at ``pos``: its state, the call (for "open" and "done") and where it ends."""
    seen = _match(text, pos, fmt.call_prefix)
    if seen != "full":
        return ("wait" if seen == "part" else "not"), None, pos
    name_start = pos + len(fmt.call_prefix)
    name_end = text.find(fmt.name_suffix, name_start)
    if name_end < 0:  # the name still arriving, unless it cannot be one
        partial = text[name_start:]
        partial = partial[: len(partial) - _held_back(partial, fmt.name_suffix)]
        return ("wait" if set(partial) <= _NAME_CHARS else "not"), None, pos
    name = text[name_start:name_end]
    if not FUNCTION_NAME.fullmatch(name):
        return "not", None, pos
    args_start = name_end + len(fmt.name_suffix)
    if fmt.arguments == "json":
        return _json_arguments(text, name, args_start, fmt)
    return _xml_arguments(text, name, args_start, fmt, tools)


def _read_block(
    text: str, start: int, fmt: ToolCallFormat, tools: Sequence[FunctionTool]
) -> tuple[_State, list[ParsedToolCall], int]:
    """The calls from the trigger at ``start``: the block's state, its calls, and where it
    ends ("done"), or where the text that is not certain yet starts ("wait")."""
    pos = start
    if fmt.block_begin:
        seen = _match(text, pos, fmt.block_begin)
        if seen != "full":
            return ("wait" if seen == "part" else "not"), [], start
        pos += len(fmt.block_begin)
    calls: list[ParsedToolCall] = []
    resume = start  # where the text after the last whole call begins
    while True:
        state, call, end = _read_call(text, pos, fmt, tools)
        if state in ("not", "wait"):
            if not calls:
                return state, [], start
            return ("done" if state == "not" else "wait"), calls, resume
        assert call is not None
        calls.append(call)
        if state == "open":
            return "open", calls, len(text)
        pos = resume = end
        more = _match(text, pos, fmt.separator + fmt.call_prefix)
        if more == "full":
            pos += len(fmt.separator)
            continue
        if fmt.block_end and text.startswith(fmt.block_end, pos):
            return "done", calls, pos + len(fmt.block_end)
        if more == "part" or (fmt.block_end and fmt.block_end.startswith(text[pos:])):
            return "wait", calls, pos
        return "done", calls, pos


def parse_tool_calls(
    text: str,
    fmt: ToolCallFormat = HERMES,
    *,
    final: bool,
    tools: Sequence[FunctionTool] = (),
) -> ParsedOutput:
    """The calls in ``text`` and the text around them.

    Calls are found at ``fmt.trigger``; the grammar that produced ``text`` makes every trigger
    the start of calls (text that turns out not to be one stays content). Text around calls
    becomes ``content``: with no call, the text itself; with calls, the text before the first
    (trailing whitespace and ``fmt.drop`` left out) and each non-blank stretch after one,
    stripped, on its own line. ``tools`` gives the parameter schemas Qwen XML values are read
    by (``xml_value``).

    Unless ``final``, what may still change is held back: trailing whitespace, a partial
    trigger, a call whose name has not ended, a separator that may start another call, and
    the unfinished part of the last call's arguments (a JSON value still open is sent as it
    grows; an XML parameter once whole). So the content and the arguments of an earlier parse
    are always prefixes of a later one's, and a stream can send the difference. With
    ``final``, an unfinished call keeps its arguments so far, and a call header cut before
    its name ends stays in the content.
    """
    stretches = [""]  # text between calls: before the first, between, after the last
    calls: list[ParsedToolCall] = []
    pos = 0
    while True:
        start = text.find(fmt.trigger, pos)
        if start < 0:
            rest = text[pos:]
            if not final:
                held = _held_back(rest, fmt.trigger)
                if fmt.drop:
                    held = max(held, _held_back(rest, fmt.drop + fmt.trigger))
                rest = rest[: len(rest) - held]
            stretches[-1] += rest
            break
        stretches[-1] += text[pos:start]
        state, found, end = _read_block(text, start, fmt, tools)
        if state == "not":
            # Not a call after all (only unconstrained text can do this): keep it as text.
            stretches[-1] += fmt.trigger
            pos = start + len(fmt.trigger)
            continue
        if state == "wait" and final and not found:  # a call header cut short: it is text
            stretches[-1] += text[start:]
            break
        if fmt.drop and stretches[-1].rstrip().endswith(fmt.drop):
            stretches[-1] = stretches[-1].rstrip()[: -len(fmt.drop)]
        calls.extend(found)
        if state == "done":
            stretches.append("")
            pos = end
            continue
        if state == "wait" and final:  # what follows the last call is text
            stretches.append(text[end:])
        break
    if not calls:
        return ParsedOutput(stretches[0] if final else stretches[0].rstrip(), ())
    parts = [stretches[0].rstrip()] + [s.strip() for s in stretches[1:]]
    return ParsedOutput("\n".join(p for p in parts if p), tuple(calls))
