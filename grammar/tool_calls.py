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

Without ``parallel`` at most one call is made. ``parse_tool_calls``
(``baton.grammar.tool_parse``) reads calls back from (possibly unfinished) text, so a stream
can send each call's arguments as they grow. Nothing here depends on a backend or on the
engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from baton.grammar.tool_formats import (
    FUNCTION_NAME,
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    QWEN3_CODER,
    TOOL_CALL_FORMATS,
    FunctionTool,
    ToolCallFormat,
    choose_tool_call_format,
    detect_tool_call_format,
    tool_call_format,
)
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
    "detect_tool_call_format",
    "parse_tool_calls",
    "tool_call_format",
    "tool_call_tag",
]

ToolChoiceMode = Literal["auto", "required"]


def _call_tags(tools: Sequence[FunctionTool], fmt: ToolCallFormat) -> list[dict[str, Any]]:
    tags = []
    for t in tools:
        content: dict[str, Any] = {"type": "json_schema", "json_schema": t.parameters}
        if fmt.arguments != "json":
            content["style"] = fmt.arguments
        tags.append({"type": "tag", "begin": fmt.begin(t.name), "content": content, "end": fmt.end})
    return tags


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
        return {"type": "structural_tag", "format": calls_only}
    if answer is not None:
        either = {"type": "or", "elements": [calls_only, answer]}
        return {"type": "structural_tag", "format": either}
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
