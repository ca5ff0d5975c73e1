"""The tool-call syntaxes of models (vLLM's ``--tool-call-parser`` names), and how the one a
model uses is found from its chat template.

A format is described as data (``ToolCallFormat``): the text around each call's function name
and arguments, the separator between calls, and for formats that write all calls of an answer
in one block (Mistral's ``[TOOL_CALLS][...]``) the text around that block. The constraint
(``baton.grammar.tool_calls.tool_call_tag``) and the parser
(``baton.grammar.tool_calls.parse_tool_calls``) both read it. The formats:

- ``hermes``: ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, one block per
  call, separated by a newline (Qwen2.5, Hermes, and baton's choice for templates without tools);
- ``llama3_json``: ``{"name": "f", "parameters": {...}}``, calls separated by ``; ``, optionally
  after ``<|python_tag|>`` (Llama 3.1-3.3);
- ``mistral``: ``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]``;
- ``qwen3_coder``: ``<tool_call>\\n<function=f>\\n<parameter=p>\\nvalue\\n</parameter>\\n
  </function>\\n</tool_call>`` (Qwen3-Coder's XML; values are text, read by the schema's types);
- ``openai``: gpt-oss's harmony, ``<|start|>assistant<|channel|>commentary to=functions.f
  <|constrain|>json<|message|>{...}<|call|>``. Its markers are special tokens the detokenised
  text leaves out, so the server reads them from the token ids (its ``openai_gptoss`` reasoning
  parser) and writes each call in this text for the parser (``TOOL_CALL_PARSERS``, not
  ``TOOL_CALL_FORMATS``: its constraint is ``baton.grammar.tool_calls.harmony_call_tag``, the
  markers as their tokens).

Nothing here depends on a backend or on the engine.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

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


ArgumentStyle = Literal["json", "qwen_xml"]


@dataclass(frozen=True)
class ToolCallFormat:
    """How a model writes tool calls: ``block_begin``, then calls separated by ``separator``,
    then ``block_end``; each call ``call_prefix + name + name_suffix + arguments + end``, the
    arguments a JSON object (style "json") or Qwen's XML parameters (style "qwen_xml").
    ``trigger`` (a prefix of ``block_begin + call_prefix``) starts the calls inside free text;
    ``drop`` is marker text the model may write just before the trigger, left out of the
    content. ``markers`` are the texts in the syntax that a model's vocabulary may hold as one
    token each (added or control tokens): a constraint writes them as that token
    (``baton.grammar.tool_markers``).

    Raises:
        ValueError: ``trigger`` is not a non-empty prefix of ``block_begin + call_prefix``.
    """

    name: str
    trigger: str
    call_prefix: str
    name_suffix: str
    end: str
    separator: str
    block_begin: str = ""
    block_end: str = ""
    arguments: ArgumentStyle = "json"
    drop: str = ""
    markers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.trigger or not (self.block_begin + self.call_prefix).startswith(self.trigger):
            raise ValueError("trigger must be a non-empty prefix of block_begin + call_prefix")

    def begin(self, function: str) -> str:
        """The text before a call's arguments."""
        return f"{self.call_prefix}{function}{self.name_suffix}"

    def render(self, function: str, arguments: str) -> str:
        """One call alone as the model writes it (``arguments``: JSON text)."""
        return self.render_calls([(function, arguments)])

    def render_calls(self, calls: Sequence[tuple[str, str]]) -> str:
        """The calls of one answer as the model writes them (``(name, arguments JSON text)``
        each; arguments that are not a JSON object are written as they are)."""
        written = [f"{self.begin(n)}{self._arguments(a)}{self.end}" for n, a in calls]
        return f"{self.block_begin}{self.separator.join(written)}{self.block_end}"

    def _arguments(self, arguments: str) -> str:
        if self.arguments == "json":
            return arguments
        try:
            values = json.loads(arguments)
        except ValueError:
            return arguments
        if not isinstance(values, dict):
            return arguments
        return "\n".join(
            f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>"
            for k, v in values.items()
        )


HERMES = ToolCallFormat(
    name="hermes",
    trigger="<tool_call>",
    call_prefix='<tool_call>\n{"name": "',
    name_suffix='", "arguments": ',
    end="}\n</tool_call>",
    separator="\n",
    markers=("<tool_call>", "</tool_call>"),
)

LLAMA3_JSON = ToolCallFormat(
    name="llama3_json",
    trigger='{"name": "',
    call_prefix='{"name": "',
    name_suffix='", "parameters": ',
    end="}",
    separator="; ",
    drop="<|python_tag|>",
)

MISTRAL = ToolCallFormat(
    name="mistral",
    trigger="[TOOL_CALLS]",
    call_prefix='{"name": "',
    name_suffix='", "arguments": ',
    end="}",
    separator=", ",
    block_begin="[TOOL_CALLS][",
    block_end="]",
    markers=("[TOOL_CALLS]",),
)

QWEN3_CODER = ToolCallFormat(
    name="qwen3_coder",
    trigger="<tool_call>",
    call_prefix="<tool_call>\n<function=",
    name_suffix=">\n",
    end="\n</function>\n</tool_call>",
    separator="\n",
    arguments="qwen_xml",
    markers=("<tool_call>", "</tool_call>"),
)

TOOL_CALL_FORMATS: dict[str, ToolCallFormat] = {
    f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL, QWEN3_CODER)
}
"""The formats by their ``--tool-call-parser`` name (vLLM's) that a grammar can write."""

OPENAI = ToolCallFormat(
    name="openai",
    trigger="<|start|>assistant<|channel|>commentary to=functions.",
    call_prefix="<|start|>assistant<|channel|>commentary to=functions.",
    name_suffix=" <|constrain|>json<|message|>",
    end="<|call|>",
    separator="",
    markers=(
        "<|start|>",
        "<|channel|>",
        "<|constrain|>",
        "<|message|>",
        "<|end|>",
        "<|call|>",
        "<|return|>",
    ),
)

TOOL_CALL_PARSERS: dict[str, ToolCallFormat] = {**TOOL_CALL_FORMATS, OPENAI.name: OPENAI}
"""Every ``--tool-call-parser`` name: ``TOOL_CALL_FORMATS`` and ``openai`` (harmony, read from
the token ids: it needs the ``openai_gptoss`` reasoning parser, and forces no calls)."""

# What in a chat template shows the format it writes, checked in this order (Qwen3-Coder's
# template also writes <tool_call>; Llama 3's names the ipython role for tool results).
_TEMPLATE_MARKERS: tuple[tuple[str, ToolCallFormat], ...] = (
    ("[TOOL_CALLS]", MISTRAL),
    ("<function=", QWEN3_CODER),
    ("<tool_call>", HERMES),
    ("<|python_tag|>", LLAMA3_JSON),
    ("ipython", LLAMA3_JSON),
)


def tool_call_format(name: str) -> ToolCallFormat:
    """The format of a ``--tool-call-parser`` name.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    try:
        return TOOL_CALL_PARSERS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"tool call parser {name!r} is not supported; expected one of "
            f"{', '.join(TOOL_CALL_PARSERS)}"
        ) from None


def detect_tool_call_format(chat_template: str | None) -> ToolCallFormat | None:
    """The format a chat template writes tool calls in; None when it shows none."""
    if not chat_template:
        return None
    for marker, fmt in _TEMPLATE_MARKERS:
        if marker in chat_template:
            return fmt
    return None


def choose_tool_call_format(parser: str | None, chat_template: str | None) -> ToolCallFormat:
    """The format named by ``parser`` (``--tool-call-parser``); without one, the chat
    template's, else Hermes'.

    Raises:
        ValueError: an unknown parser name.
    """
    if parser is not None:
        return tool_call_format(parser)
    return detect_tool_call_format(chat_template) or HERMES
