"""``ResponseEvents``: one streamed ``/v1/responses`` answer as OpenAI's server-sent events
(``event: <type>`` and ``data: <json>`` carrying ``type`` and ``sequence_number``).

The sequence: ``response.created``, ``response.in_progress``; per output item
``response.output_item.added``, its deltas (``response.reasoning_text.delta``;
``response.content_part.added``, ``response.output_text.delta``...,
``response.output_text.done``, ``response.content_part.done``;
``response.function_call_arguments.delta``..., ``.done``) and ``response.output_item.done``;
then ``response.completed`` (or ``response.incomplete`` when cut by ``max_output_tokens``)
with the whole response. The thoughts, text and calls are read from the growing completion
as the chat stream reads them (``ReasoningSplitter``, ``ToolCallDeltas``); an item is done
when the next one begins or the answer ends.
"""

from __future__ import annotations

from typing import Any

from baton.engine.outputs import CompletionOutput, RequestOutput
from baton.engine.server.responses_output import (
    ResponseContext,
    function_call_item,
    item_status,
    json_text,
    message_item,
    new_id,
    output_text,
    reasoning_item,
    response_object,
    response_usage,
    text_logprobs,
)
from baton.engine.server.tool_output import ToolCallDeltas


class ResponseEvents:
    """Turns a request's outputs into events; ``response`` is the final response object
    once ``finish`` has run."""

    def __init__(self, ctx: ResponseContext) -> None:
        self.ctx = ctx
        self.output: list[dict[str, Any]] = []
        self.response: dict[str, Any] | None = None
        self._seq = 0
        self._open: int | None = None  # the index of the item being streamed
        self._thinks: bool | None = None
        self._sent = ("", "")  # the thoughts and the content read so far
        tools = ctx.plan.tools
        self._calls = (
            ToolCallDeltas(tools.fmt, tools.functions)
            if tools is not None and tools.mode != "none"
            else None
        )
        self._call_items: dict[int, int] = {}  # call index -> output index

    def event(self, kind: str, **fields: Any) -> str:
        """One event, numbered."""
        data = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return f"event: {kind}\ndata: {json_text(data)}\n\n"

    def start(self) -> list[str]:
        """``response.created`` and ``response.in_progress``."""
        snapshot = response_object(self.ctx, "in_progress", [], None)
        return [
            self.event("response.created", response=snapshot),
            self.event("response.in_progress", response=snapshot),
        ]

    def update(self, out: RequestOutput) -> list[str]:
        """The events for what ``out`` (the request's output so far) adds."""
        c = out.outputs[0]
        splitter = self.ctx.plan.splitter
        reasoning, content = None, c.text
        if splitter is not None:
            if self._thinks is None:
                self._thinks = splitter.thinks_first(out.prompt_token_ids)
            reasoning, content = splitter.split(c.text, c.token_ids, self._thinks)
        events: list[str] = []
        thought = _grown(self._sent[0], reasoning or "")
        if thought:
            events += self._reasoning(thought)
        content = content or ""
        if self._calls is None:
            text, calls = _grown(self._sent[1], content), []
        else:
            delta = self._calls.delta(content, c.finished)
            text, calls = delta.get("content", ""), delta.get("tool_calls", [])
        if text:
            events += self._text(text, c)
        for call in calls:
            events += self._call(call)
        self._sent = (reasoning or "", content)
        return events

    def finish(self, out: RequestOutput) -> list[str]:
        """The events that close the last item, and ``response.completed`` (or
        ``response.incomplete``) with the whole response."""
        c: CompletionOutput = out.outputs[0]
        status = item_status(c.finish_reason)
        events = self._close(status)
        if not any(item["type"] in ("message", "function_call") for item in self.output):
            events += self._text("")  # a text answer, even an empty one, is a message
            events += self._close(status)
        for item in self.output:
            item["status"] = status
        self.response = response_object(
            self.ctx, status, self.output, response_usage(out, self.ctx.plan)
        )
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return [*events, self.event(kind, response=self.response)]

    # ------------------------------------------------------------------ items

    def _add(self, item: dict[str, Any]) -> list[str]:
        events = self._close("completed")
        self.output.append(item)
        self._open = len(self.output) - 1
        added = {**item, "status": "in_progress"}
        if item["type"] == "message":
            added["content"] = []
        elif item["type"] == "function_call":
            added["arguments"] = ""
        events.append(self.event("response.output_item.added", output_index=self._open, item=added))
        if item["type"] == "message":
            events.append(self._part("response.content_part.added", self._open, output_text("")))
        return events

    def _part(self, kind: str, index: int, part: dict[str, Any]) -> str:
        item_id = self.output[index]["id"]
        return self.event(kind, item_id=item_id, output_index=index, content_index=0, part=part)

    def _reasoning(self, delta: str) -> list[str]:
        events = []
        if self._open is None or self.output[self._open]["type"] != "reasoning":
            events += self._add(reasoning_item("", "in_progress", new_id("rs")))
        item = self.output[self._open or 0]
        item["content"][0]["text"] += delta
        events.append(
            self.event(
                "response.reasoning_text.delta",
                item_id=item["id"],
                output_index=self._open,
                content_index=0,
                delta=delta,
            )
        )
        return events

    def _text(self, delta: str, c: CompletionOutput | None = None) -> list[str]:
        """Events adding ``delta`` to the message (opened if need be); ``c``: the completion
        so far, whose tokens' logprobs the delta carries when the request asked for them."""
        events = []
        if self._open is None or self.output[self._open]["type"] != "message":
            events += self._add(message_item("", "in_progress"))
        item = self.output[self._open or 0]
        part = item["content"][0]
        part["text"] += delta
        sent = len(part["logprobs"])
        if c is not None:
            part["logprobs"] = text_logprobs(
                c, self.ctx.plan, bool(self._thinks), len(part["text"])
            )
        if delta:
            events.append(
                self.event(
                    "response.output_text.delta",
                    item_id=item["id"],
                    output_index=self._open,
                    content_index=0,
                    delta=delta,
                    logprobs=part["logprobs"][sent:],
                )
            )
        return events

    def _call(self, delta: dict[str, Any]) -> list[str]:
        events = []
        fn = delta["function"]
        if "id" in delta:  # a call's first delta
            events += self._add(function_call_item(delta["id"], fn["name"], "", "in_progress"))
            self._call_items[delta["index"]] = self._open or 0
        index = self._call_items[delta["index"]]
        item = self.output[index]
        if fn.get("arguments"):
            item["arguments"] += fn["arguments"]
            events.append(
                self.event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=index,
                    delta=fn["arguments"],
                )
            )
        return events

    def _close(self, status: str) -> list[str]:
        """The events that end the item being streamed, if any."""
        index, self._open = self._open, None
        if index is None:
            return []
        item = self.output[index]
        item["status"] = status
        events = []
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":
            text = item["content"][0]["text"]
            events.append(
                self.event(
                    "response.output_text.done",
                    **where,
                    content_index=0,
                    text=text,
                    logprobs=item["content"][0]["logprobs"],
                )
            )
            events.append(self._part("response.content_part.done", index, item["content"][0]))
        elif item["type"] == "function_call":
            events.append(
                self.event(
                    "response.function_call_arguments.done",
                    **where,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        else:
            text = item["content"][0]["text"]
            events.append(
                self.event("response.reasoning_text.done", **where, content_index=0, text=text)
            )
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events


def _grown(sent: str, now: str) -> str:
    """What ``now`` adds to ``sent`` (nothing when it does not extend it)."""
    return now[len(sent) :] if len(now) > len(sent) and now.startswith(sent) else ""
