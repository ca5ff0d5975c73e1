"""Tool calls in chat completion responses: the assistant message of a finished choice, and
the deltas that stream it.

The generated text is read with ``baton.grammar.tool_calls.parse_tool_calls``: calls become
``message.tool_calls`` (ids ``call_...``, arguments as the JSON text the model wrote), the
text around them ``message.content`` (null when blank), and a choice that stopped after
calling gets ``finish_reason="tool_calls"``. A choice cut by ``max_tokens`` keeps
``"length"`` and its unfinished call's arguments so far, in both shapes alike.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from baton.grammar.tool_calls import FunctionTool, ToolCallFormat, parse_tool_calls


def new_call_id() -> str:
    """A fresh tool-call id in OpenAI's shape."""
    return f"call_{uuid.uuid4().hex[:24]}"


def finish_reason(reason: str | None, has_calls: bool) -> str | None:
    """OpenAI's finish reason: "tool_calls" for a choice that stopped after calling."""
    return "tool_calls" if has_calls and reason == "stop" else reason


def tool_message(
    text: str, reason: str | None, fmt: ToolCallFormat, tools: Sequence[FunctionTool] = ()
) -> tuple[dict[str, Any], str | None]:
    """The assistant message of a finished choice and its finish reason (``tools``: the
    request's functions, whose schemas type the values of XML-style arguments)."""
    parsed = parse_tool_calls(text, fmt, final=True, tools=tools)
    if not parsed.tool_calls:
        return {"role": "assistant", "content": text}, reason
    calls = [
        {
            "id": new_call_id(),
            "type": "function",
            "function": {"name": c.name, "arguments": c.arguments},
        }
        for c in parsed.tool_calls
    ]
    message = {"role": "assistant", "content": parsed.content or None, "tool_calls": calls}
    return message, finish_reason(reason, True)


class ToolCallDeltas:
    """Turns one choice's growing text into stream deltas: new content, a call's first delta
    (index, id, type, name and its arguments so far), then its arguments as they grow."""

    def __init__(self, fmt: ToolCallFormat, tools: Sequence[FunctionTool] = ()) -> None:
        self.fmt = fmt
        self.tools = tuple(tools)
        self.content_sent = ""
        self.calls: list[tuple[str, int]] = []  # (id, arguments characters sent) per call

    @property
    def has_calls(self) -> bool:
        return bool(self.calls)

    def delta(self, text: str, finished: bool) -> dict[str, Any]:
        """The delta fields (``content``, ``tool_calls``) that ``text`` adds to what was sent;
        empty when it adds nothing yet."""
        parsed = parse_tool_calls(text, self.fmt, final=finished, tools=self.tools)
        out: dict[str, Any] = {}
        # Earlier parses are prefixes of later ones (parse_tool_calls holds back what may
        # change), so the difference is what is new.
        if len(parsed.content) > len(self.content_sent) and parsed.content.startswith(
            self.content_sent
        ):
            out["content"] = parsed.content[len(self.content_sent) :]
            self.content_sent = parsed.content
        deltas = []
        for index, call in enumerate(parsed.tool_calls):
            if index == len(self.calls):
                call_id = new_call_id()
                self.calls.append((call_id, len(call.arguments)))
                deltas.append(
                    {
                        "index": index,
                        "id": call_id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                )
                continue
            call_id, sent = self.calls[index]
            if len(call.arguments) > sent:
                deltas.append({"index": index, "function": {"arguments": call.arguments[sent:]}})
                self.calls[index] = (call_id, len(call.arguments))
        if deltas:
            out["tool_calls"] = deltas
        return out
