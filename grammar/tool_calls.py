"""Tool calls as a constraint and back: the structural tag that forces a model's tool-call
syntax, and the parser that reads the calls out of the generated text.

A model writes a tool call in a syntax of its own; ``baton.grammar.tool_formats`` describes
the ones baton knows (``HERMES`` is what models without their own use):

    <tool_call>
    {"name": "get_weather", "arguments": {"city":"Paris"}}
    </tool_call>

``tool_call_tag`` builds the structural tag that admits exactly the calls the request allows,
each call's arguments constrained to its function's parameters schema:

- ``auto``: free text in which calls may start at the format's trigger (``<tool_call>``);
  with an ``answer`` format, either calls only or an answer in that format;
- ``required``: calls only, at least one;
- a named function: ``required`` with that one function.

Without ``parallel`` at most one call is made. Given the tokenizer's ids of the format's
markers, the calls write each marker as its one token (``baton.grammar.tool_markers``); in
``auto`` a trigger that is one token opens each call as that token, and its text never appears
in the free text around the calls (a trigger of several tokens is matched as text). gpt-oss's
harmony (``harmony_call_tag``) is all markers: its free analysis channel, then the calls, as
tokens. ``parse_tool_calls`` (``baton.grammar.tool_parse``) reads calls back from (possibly
unfinished) text, so a stream can send each call's arguments as they grow. Nothing here
depends on a backend or on the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from baton.grammar.tool_formats import (
    FUNCTION_NAME,
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    OPENAI,
    QWEN3_CODER,
    TOOL_CALL_FORMATS,
    FunctionTool,
    ToolCallFormat,
    choose_tool_call_format,
    detect_tool_call_format,
    tool_call_format,
)
from baton.grammar.tool_markers import Markers, bind_markers, literal_parts, token_format
from baton.grammar.tool_parse import ParsedOutput, ParsedToolCall, parse_tool_calls

__all__ = [
    "FUNCTION_NAME",
    "HERMES",
    "LLAMA3_JSON",
    "MISTRAL",
    "QWEN3_CODER",
    "TOOL_CALL_FORMATS",
    "FunctionTool",
    "ParsedOutput",
    "ParsedToolCall",
    "ToolCallFormat",
    "ToolChoiceMode",
    "choose_tool_call_format",
    "harmony_call_tag",
    "detect_tool_call_format",
    "parse_tool_calls",
    "tool_call_format",
    "tool_call_tag",
]

ToolChoiceMode = Literal["auto", "required"]


# Whitespace in a row inside XML-style arguments (xgrammar's own reading, which baton's JSON
# grammar does not replace): unbounded, a small model wrote newlines until max_tokens.
XML_MAX_WHITESPACE = 4


def _call_tags(tools: Sequence[FunctionTool], fmt: ToolCallFormat) -> list[dict[str, Any]]:
    tags = []
    for t in tools:
        content: dict[str, Any] = {"type": "json_schema", "json_schema": t.parameters}
        if fmt.arguments != "json":
            content["style"] = fmt.arguments
            content["max_whitespace_cnt"] = XML_MAX_WHITESPACE
        tags.append({"type": "tag", "begin": fmt.begin(t.name), "content": content, "end": fmt.end})
    return tags


def tool_call_tag(
    tools: Sequence[FunctionTool],
    mode: ToolChoiceMode,
    *,
    parallel: bool = True,
    fmt: ToolCallFormat = HERMES,
    answer: dict[str, Any] | None = None,
    markers: Markers | None = None,
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
        markers: the token ids of ``fmt.markers`` that are one token of the model's
            vocabulary; the calls write them as those tokens. In "auto" without an answer
            the calls start inside free text: at ``fmt.trigger``'s token where it is one
            (the free text then never holds its text), else at its text (the markers then
            stay text).

    Raises:
        ValueError: no tools, duplicate names, or ``answer`` with mode "required".
    """
    if not tools:
        raise ValueError("tool_call_tag needs at least one tool")
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate function names in {names}")
    tags = _call_tags(tools, fmt)
    calls_only: dict[str, Any] = {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": fmt.separator,
        "at_least_one": True,
        "stop_after_first": not parallel,
    }
    block = bool(fmt.block_begin or fmt.block_end)
    if block:  # all calls in one block: [TOOL_CALLS][call, call]
        calls_only = {
            "type": "tag",
            "begin": fmt.block_begin,
            "content": calls_only,
            "end": fmt.block_end,
        }
    if mode == "required":
        if answer is not None:
            raise ValueError("an answer format needs mode 'auto'")
        return {"type": "structural_tag", "format": bind_markers(calls_only, markers or {})}
    if answer is not None:
        either = {"type": "or", "elements": [bind_markers(calls_only, markers or {}), answer]}
        return {"type": "structural_tag", "format": either}
    if fmt.trigger in (markers or {}) and (fmt.block_begin or fmt.call_prefix).startswith(
        fmt.trigger
    ):
        return {
            "type": "structural_tag",
            "format": _auto_at_marker(calls_only, tags, fmt, markers or {}, parallel),
        }
    return {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": [fmt.trigger],
            "tags": [calls_only] if block else tags,
            "at_least_one": False,
            "stop_after_first": block or not parallel,
        },
    }


def _auto_at_marker(
    calls_only: dict[str, Any],
    tags: list[dict[str, Any]],
    fmt: ToolCallFormat,
    markers: Markers,
    parallel: bool,
) -> dict[str, Any]:
    """tool_choice "auto" where ``fmt.trigger`` is one token of the vocabulary: free text in
    which the trigger's text never appears (neither spelled in pieces, which the model never
    wrote in training, nor inside another token), each call opened by the trigger's token
    and constrained to the end of the call (or of the block: Mistral's list), its markers as
    their tokens, free text again after it. Calls follow one
    another (``parallel``) or at most one call (or one block) is made. ``calls_only``,
    ``tags``: ``tool_call_tag``'s calls without free text, and each call's tag."""
    free: dict[str, Any] = {"type": "any_text", "excludes": [fmt.trigger]}
    opened = {
        "type": "tag",
        "begin": "",
        "content": free,
        "end": token_format(markers[fmt.trigger]),
    }
    cut = len(fmt.trigger)
    block = bool(fmt.block_begin or fmt.block_end)
    if block:  # one block: [TOOL_CALLS] then [call, call]
        rest: dict[str, Any] = {**calls_only, "begin": calls_only["begin"][cut:]}
    else:  # each call opens with the trigger
        rest = {"type": "or", "elements": [{**t, "begin": t["begin"][cut:]} for t in tags]}
    call = {"type": "sequence", "elements": [opened, bind_markers(rest, markers)]}
    repeat = "star" if parallel and not block else "optional"
    return {"type": "sequence", "elements": [{"type": repeat, "content": call}, free]}


# Harmony (gpt-oss): the prompt opened the assistant's message (``<|start|>assistant``); a
# message is ``<|channel|>...<|message|>BODY`` closed by <|end|> (the next one then opens
# with <|start|>assistant), <|call|> (a call) or <|return|> (the final answer).
HARMONY_NEXT = "<|start|>assistant"


def _harmony_message(
    channel: str, body: dict[str, Any], end: str, markers: Markers
) -> dict[str, Any]:
    """``<|channel|>CHANNEL<|message|>BODY`` then ``end``, the markers as their tokens."""
    return {
        "type": "sequence",
        "elements": [
            *literal_parts(f"<|channel|>{channel}<|message|>", markers),
            body,
            *literal_parts(end, markers),
        ],
    }


def harmony_call_tag(
    tools: Sequence[FunctionTool],
    markers: Markers,
    *,
    mode: ToolChoiceMode = "required",
    parallel: bool = True,
    reasoning: bool = True,
    max_reasoning_tokens: int | None = None,
    answer: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The structural tag of a harmony answer with tools. With ``reasoning`` it may open
    with an analysis message (free tokens but harmony's markers, at most
    ``max_reasoning_tokens``, then ``<|end|><|start|>assistant``). Then, "required": a call
    ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS<|call|>`` of
    one of ``tools`` (ARGS its parameters schema), with ``parallel`` more calls each after
    ``<|start|>assistant``; "auto": optionally a preamble (a commentary message without a
    recipient, free; not with ``answer``), then either such calls or the final message
    ``<|channel|>final<|message|>ANSWER<|return|>`` (ANSWER in the ``answer`` format, else
    free but harmony's markers). Every marker is its token (``markers``: harmony's texts to
    ids). The tag writes the thoughts itself: the engine must not hold it back until they end.

    Raises:
        ValueError: no tools, duplicate names, a marker missing from ``markers``, a negative
            budget, or ``answer`` with mode "required".
    """
    missing = [m for m in OPENAI.markers if m not in markers]
    if missing:
        raise ValueError(f"harmony needs its markers as tokens; missing {', '.join(missing)}")
    if max_reasoning_tokens is not None and max_reasoning_tokens < 0:
        raise ValueError(f"max_reasoning_tokens must be >= 0, got {max_reasoning_tokens}")
    if answer is not None and mode != "auto":
        raise ValueError("an answer format needs mode 'auto'")
    if not tools:
        raise ValueError("harmony_call_tag needs at least one tool")
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate function names in {names}")

    def call(tool: FunctionTool) -> dict[str, Any]:
        begin = OPENAI.begin(tool.name).removeprefix(HARMONY_NEXT)
        arguments = {"type": "json_schema", "json_schema": tool.parameters}
        return {
            "type": "sequence",
            "elements": [
                *literal_parts(begin, markers),
                arguments,
                *literal_parts(OPENAI.end, markers),
            ],
        }

    def free(budget: int | None = None) -> dict[str, Any]:
        text: dict[str, Any] = {"type": "any_tokens", "exclude_tokens": sorted(markers.values())}
        if budget is not None:
            text["max_tokens"] = budget
        return text

    calls: dict[str, Any] = {"type": "or", "elements": [call(t) for t in tools]}
    if parallel:
        more = {"type": "sequence", "elements": [*literal_parts(HARMONY_NEXT, markers), calls]}
        calls = {"type": "sequence", "elements": [calls, {"type": "star", "content": more}]}
    elements: list[dict[str, Any]] = []
    between = "<|end|>" + HARMONY_NEXT
    if reasoning:
        analysis = _harmony_message("analysis", free(max_reasoning_tokens), between, markers)
        elements.append({"type": "optional", "content": analysis})
    if mode == "auto":
        if answer is None:  # a preamble is content: with an answer format, only the answer
            preamble = _harmony_message("commentary", free(), between, markers)
            elements.append({"type": "optional", "content": preamble})
        final = _harmony_message("final", answer or free(), "<|return|>", markers)
        elements.append({"type": "or", "elements": [calls, final]})
    else:
        elements.append(calls)
    body = elements[0] if len(elements) == 1 else {"type": "sequence", "elements": elements}
    return {"type": "structural_tag", "format": body}
