"""The response object of ``/v1/responses`` in OpenAI's shape: the output items (a
``reasoning`` item for the model's thoughts, a ``message`` item with one ``output_text``
part, ``function_call`` items), the usage, and the echo of the request's settings."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from baton.engine.outputs import CompletionOutput, RequestOutput
from baton.engine.server.chat_plan import ChatPlan, assistant_reply
from baton.engine.server.logprobs import chat_logprobs
from baton.engine.server.protocol import ResponsesRequest


def json_text(data: Any) -> str:
    """``data`` as compact JSON that encodes to UTF-8: non-ASCII text as it is, unless the
    request echoed in it carried lone surrogates (valid as JSON escapes, not in UTF-8), which
    are then sent back as the escapes they came as."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(data, ensure_ascii=True, separators=(",", ":"))
    return text


def new_id(prefix: str) -> str:
    """A fresh id in OpenAI's shape (``resp_...``, ``msg_...``, ``fc_...``, ``rs_...``)."""
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass(frozen=True)
class ResponseContext:
    """What every response object of one request carries besides its output.

    Attributes:
        response_id: the response's id (``resp_...``).
        created_at: when the request came (Unix seconds).
        model: the model name answered.
        body: the request.
        plan: the chat plan that runs it (its effective sampling settings are echoed).
    """

    response_id: str
    created_at: int
    model: str
    body: ResponsesRequest
    plan: ChatPlan


def message_item(
    text: str,
    status: str,
    item_id: str | None = None,
    logprobs: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """An assistant ``message`` item with one ``output_text`` part."""
    return {
        "type": "message",
        "id": item_id or new_id("msg"),
        "status": status,
        "role": "assistant",
        "content": [output_text(text, logprobs)],
    }


def output_text(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """An ``output_text`` content part (``logprobs``: its tokens', when asked for)."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def text_logprobs(
    c: CompletionOutput, plan: ChatPlan, thinks: bool, text_length: int
) -> list[dict[str, Any]]:
    """The logprobs of the tokens that write an answer's first ``text_length`` characters of
    text: the answer's tokens after its thoughts, up to the tool calls or the end-of-turn
    token that follow the text. Empty unless the request asked for them (``include``)."""
    top_n = plan.params.logprobs
    if top_n is None or c.logprobs is None:
        return []
    skip = plan.splitter.reasoning_tokens(c.token_ids, thinks) if plan.splitter else 0
    entries = chat_logprobs(c.token_ids[skip:], c.logprobs[skip:], top_n)
    kept, written = [], 0
    for entry in entries:
        if written >= text_length:
            break
        kept.append(entry)
        written += len(entry["token"])
    return kept


def function_call_item(
    call_id: str, name: str, arguments: str, status: str, item_id: str | None = None
) -> dict[str, Any]:
    """A ``function_call`` item."""
    return {
        "type": "function_call",
        "id": item_id or new_id("fc"),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def reasoning_item(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    """A ``reasoning`` item carrying the thoughts as one ``reasoning_text`` part."""
    return {
        "type": "reasoning",
        "id": item_id or new_id("rs"),
        "status": status,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def item_status(finish_reason: str | None) -> str:
    """An item's (and the response's) status: "incomplete" when the output was cut by
    ``max_output_tokens``."""
    return "incomplete" if finish_reason == "length" else "completed"


def output_items(out: RequestOutput, plan: ChatPlan) -> tuple[list[dict[str, Any]], str]:
    """The output items of a finished request and its status: thoughts, then the text (left
    out when the answer is only calls), then the calls."""
    (c,) = out.outputs
    splitter = plan.splitter
    thinks = splitter is not None and splitter.thinks_first(out.prompt_token_ids)
    reasoning, message, reason = assistant_reply(c, plan, thinks)
    status = item_status(reason)
    items: list[dict[str, Any]] = []
    if reasoning:
        items.append(reasoning_item(reasoning, status))
    calls = message.get("tool_calls") or []
    content = message.get("content")
    if content or not calls:
        logprobs = text_logprobs(c, plan, thinks, len(content or ""))
        items.append(message_item(content or "", status, logprobs=logprobs))
    for call in calls:
        fn = call["function"]
        items.append(function_call_item(call["id"], fn["name"], fn["arguments"], status))
    return items, status


def response_usage(out: RequestOutput | None, plan: ChatPlan) -> dict[str, Any] | None:
    """OpenAI's Responses usage object of a request's last output (None without one)."""
    if out is None:
        return None
    (c,) = out.outputs
    splitter = plan.splitter
    reasoning = 0
    if splitter is not None:
        reasoning = splitter.reasoning_tokens(
            c.token_ids, splitter.thinks_first(out.prompt_token_ids)
        )
    prompt, completion = len(out.prompt_token_ids), len(c.token_ids)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": prompt + completion,
    }


def response_object(
    ctx: ResponseContext,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
) -> dict[str, Any]:
    """The response object: ``status`` "in_progress", "completed" or "incomplete" (then
    ``incomplete_details.reason`` is "max_output_tokens"), the output items, usage, and the
    request's settings echoed (the effective temperature and top_p)."""
    body, params = ctx.body, ctx.plan.params
    text = body.text if body.text and body.text.get("format") else {"format": {"type": "text"}}
    return {
        "id": ctx.response_id,
        "object": "response",
        "created_at": ctx.created_at,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete" else None),
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {},
        "model": ctx.model,
        "output": output,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": (body.reasoning or {}).get("effort"), "summary": None},
        "store": body.store,
        "temperature": params.temperature,
        "text": text,
        "tool_choice": body.tool_choice or "auto",
        "tools": body.tools or [],
        "top_p": params.top_p,
        "truncation": "disabled",
        "usage": usage,
        "user": body.user,
    }
