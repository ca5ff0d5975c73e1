"""A Responses API request (``POST /v1/responses``) as the chat request that runs it.

``input`` (a string, messages, or the items of earlier turns: messages, ``function_call``
and ``function_call_output``) becomes chat messages after the stored conversation of
``previous_response_id`` and after ``instructions`` (a system message first); ``text.format``
becomes ``response_format``; the flat function tools and ``tool_choice`` become chat's
nested ones. The chat path then renders, constrains and plans tool calls exactly as for
``/v1/chat/completions``. Every part it cannot take is a 400 naming it: an input item or
content part of another kind, a tool that is not a function, a reasoning summary, an
``include`` other than the output text's logprobs (``top_logprobs`` alternatives with them);
``reasoning.effort`` becomes chat's ``reasoning_effort`` (a 400 naming it where the chat
template does not read it).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import pydantic

from baton.engine.server.errors import APIError, bad_request
from baton.engine.server.protocol import (
    REASONING_EFFORTS,
    ChatCompletionRequest,
    ResponseFormat,
    ResponsesRequest,
)

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text")
# A chat-path parameter named in a 400 -> the Responses field that fed it.
_PARAMS = {
    "response_format": "text.format",
    "response_format.type": "text.format.type",
    "response_format.json_schema": "text.format.schema",
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "reasoning_effort": "reasoning.effort",
}


def shown(name: str) -> str:
    """``name`` as an error may quote it: lone surrogates (valid in JSON escapes, not in
    UTF-8) written as backslash escapes."""
    return name.encode("utf-8", "backslashreplace").decode("utf-8")


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text(value: Any, where: str) -> str:
    """The text of a message's content: a string, or text parts joined by newlines."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad_request(f"{where} must be a string or a list of text parts", where)
    texts = []
    for j, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(
                f"{where}[{j}]: only input_text and output_text parts are supported, got {kind!r}",
                f"{where}[{j}]",
            )
        texts.append(part["text"])
    return "\n".join(texts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (key != "arguments" and not value):
        raise bad_request(f"{where}.{key} must be a non-empty string", f"{where}.{key}")
    return value


def _item(raw: Any, where: str) -> dict[str, Any] | None:
    """One input item checked and normalised (None for a reasoning item, which the chat
    template would drop anyway)."""
    if not isinstance(raw, dict):
        raise bad_request(f"{where} must be an object", where)
    kind = raw.get("type", "message" if "role" in raw else None)
    if kind == "message":
        role = raw.get("role")
        if role not in _ROLES:
            raise bad_request(
                f"{where}.role must be one of {', '.join(_ROLES)}, got {role!r}", f"{where}.role"
            )
        _text(raw.get("content"), f"{where}.content")
        return {**raw, "type": "message", "id": raw.get("id") or _item_id("msg")}
    if kind == "function_call":
        for key in ("call_id", "name", "arguments"):
            _string(raw, key, where)
        return {**raw, "id": raw.get("id") or _item_id("fc")}
    if kind == "function_call_output":
        _string(raw, "call_id", where)
        _text(raw.get("output"), f"{where}.output")
        return {**raw, "id": raw.get("id") or _item_id("fco")}
    if kind == "reasoning":
        return None
    raise bad_request(
        f"{where}.type {kind!r} is not supported (use message, function_call, "
        "function_call_output or reasoning)",
        f"{where}.type",
    )


def input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's ``input`` as items (a string is one user message), each checked and
    given an id where it had none; reasoning items are left out.

    Raises:
        APIError: 400 naming the item (``input[i]...``) of an unsupported type or shape.
    """
    if isinstance(body.input, str):
        return [{"id": _item_id("msg"), "type": "message", "role": "user", "content": body.input}]
    items = (_item(raw, f"input[{i}]") for i, raw in enumerate(body.input))
    return [item for item in items if item is not None]


def chat_messages(items: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Items (checked by ``input_items``, or output items) as chat messages: a function call
    joins the assistant turn before it (or starts one), its output is a ``tool`` message."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item["type"]
        if kind == "message":
            content = _text(item["content"], f"input[{i}].content")
            messages.append({"role": _ROLES[item["role"]], "content": content})
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            if not messages or messages[-1]["role"] != "assistant":
                messages.append({"role": "assistant", "content": ""})
            messages[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = _text(item["output"], f"input[{i}].output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
    return messages


def response_format(text: dict[str, Any] | None) -> ResponseFormat | None:
    """``text.format`` as chat's ``response_format`` (None for plain text).

    Raises:
        APIError: 400 naming ``text.format`` (or its key) for an unknown type or a bad schema,
            and ``text.verbosity`` for any verbosity but "medium".
    """
    if text is None:
        return None
    for key, value in text.items():
        if key == "verbosity" and value not in (None, "medium"):
            raise bad_request("text.verbosity is not supported", "text.verbosity")
        if key not in ("format", "verbosity"):
            raise bad_request(f"unknown field text.{shown(key)}", f"text.{shown(key)}")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("text.format must be an object with a type", "text.format")
    kind = fmt.get("type")
    if kind == "text" or kind == "json_object":
        return ResponseFormat(type=kind)
    if kind != "json_schema":
        raise bad_request(
            f"text.format.type {kind!r} is not supported (use text, json_object or json_schema)",
            "text.format.type",
        )
    schema = fmt.get("schema")
    if not isinstance(schema, (dict, bool)):
        raise bad_request("text.format.schema must be a JSON schema", "text.format.schema")
    strict = fmt.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request("text.format.strict must be a boolean", "text.format.strict")
    name = fmt.get("name", "response")
    if not isinstance(name, str) or not name:
        raise bad_request("text.format.name must be a non-empty string", "text.format.name")
    nested = {"name": name, "schema": schema, "strict": strict}
    return ResponseFormat.model_validate({"type": "json_schema", "json_schema": nested})


def chat_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """The flat Responses function tools as chat's ``{"type": "function", "function": ...}``.

    Raises:
        APIError: 400 naming ``tools[i]`` for a tool that is not a function or has no name.
    """
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        if kind != "function":
            raise bad_request(
                f"{where}.type: only function tools are supported, got {kind!r}", f"{where}.type"
            )
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"{where}.name must be a non-empty string", f"{where}.name")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        out.append({"type": "function", "function": fn})
    return out


def _named(choice: dict[str, Any], where: str) -> dict[str, Any]:
    name = choice.get("name")
    if choice.get("type") != "function" or not isinstance(name, str):
        raise bad_request(
            f"{where} must name a function: {{'type': 'function', 'name': ...}}", where
        )
    return {"type": "function", "function": {"name": name}}


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """Responses' ``tool_choice`` in chat's shape (a named function nested, ``allowed_tools``
    with its tools nested).

    Raises:
        APIError: 400 naming ``tool_choice`` for any other choice (hosted tools, custom tools).
    """
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function":
        return _named(choice, "tool_choice")
    if choice.get("type") == "allowed_tools":
        listed = choice.get("tools")
        if not isinstance(listed, list):
            raise bad_request("tool_choice.tools must list functions", "tool_choice.tools")
        named = [_named(t, "tool_choice.tools") if isinstance(t, dict) else t for t in listed]
        return {
            "type": "allowed_tools",
            "allowed_tools": {"mode": choice.get("mode"), "tools": named},
        }
    raise bad_request(
        f"tool_choice {choice!r} is not supported (use none, auto, required, "
        "a named function or allowed_tools)",
        "tool_choice",
    )


def check_reasoning(reasoning: dict[str, Any] | None) -> str | None:
    """The reasoning effort asked for (``reasoning.effort``, None if absent), passed on as the
    chat request's ``reasoning_effort``; summaries are refused, not ignored.

    Raises:
        APIError: 400 naming ``reasoning.effort`` (not an effort), ``reasoning.summary`` or
            the unknown key.
    """
    for key, value in (reasoning or {}).items():
        if key == "effort" and value is not None and value not in REASONING_EFFORTS:
            raise bad_request(
                f"reasoning.effort must be one of {', '.join(REASONING_EFFORTS)}, got "
                f"{shown(repr(value))}",
                "reasoning.effort",
            )
        if key in ("summary", "generate_summary") and value is not None:
            raise bad_request("reasoning summaries are not supported", f"reasoning.{key}")
        if key not in ("effort", "summary", "generate_summary"):
            raise bad_request(f"unknown field reasoning.{shown(key)}", f"reasoning.{shown(key)}")
    return (reasoning or {}).get("effort")


# The one ``include`` value baton answers: the tokens' logprobs in each output_text part.
TEXT_LOGPROBS = "message.output_text.logprobs"


def wants_logprobs(body: ResponsesRequest) -> bool:
    """Whether the output_text parts carry logprobs (``include`` lists ``TEXT_LOGPROBS``).

    Raises:
        APIError: 400 naming ``include`` for any other value (extra output data baton does
            not produce), and ``top_logprobs`` when it asks for alternatives without that
            include (they would not be returned).
    """
    for i, value in enumerate(body.include or []):
        if value != TEXT_LOGPROBS:
            raise bad_request(
                f"include[{i}] {shown(repr(value))} is not supported (only {TEXT_LOGPROBS!r})",
                "include",
            )
    wanted = TEXT_LOGPROBS in (body.include or [])
    if body.top_logprobs and not wanted:
        raise bad_request(f"top_logprobs needs include: [{TEXT_LOGPROBS!r}]", "top_logprobs")
    return wanted


def chat_request(
    body: ResponsesRequest, history: Sequence[dict[str, Any]], items: Sequence[dict[str, Any]]
) -> ChatCompletionRequest:
    """The chat request that runs ``body``: ``instructions`` as a system message, then the
    conversation of ``history`` (the previous response's input and output items) and
    ``items`` (this request's input).

    Raises:
        APIError: 400 naming the Responses field that is wrong.
    """
    effort = check_reasoning(body.reasoning)
    logprobs = wants_logprobs(body)
    messages = chat_messages([*history, *items])
    if body.instructions:
        messages.insert(0, {"role": "system", "content": body.instructions})
    if not messages:
        raise bad_request("input must hold at least one message", "input")
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "seed": body.seed,
        "response_format": response_format(body.text),
        "tools": chat_tools(body.tools),
        "tool_choice": chat_tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls,
        "max_reasoning_tokens": body.max_reasoning_tokens,
        "reasoning_effort": effort,
        "logprobs": logprobs,
        "top_logprobs": body.top_logprobs if logprobs else None,
    }
    try:
        return ChatCompletionRequest.model_validate(fields)
    except pydantic.ValidationError as exc:  # checked above; a last guard against a 500
        raise bad_request(f"input: {exc.errors()[0].get('msg')}", "input") from None


def renamed(error: APIError) -> APIError:
    """A 400 raised by the chat path with the parameter (and the message's leading name)
    as the Responses API spells it; other errors as they are."""
    param = error.param
    if param is None:
        return error
    new = _PARAMS.get(param) or ("input" if param.startswith("messages") else param)
    message = error.message
    if new != param:
        message = new + message[len(param) :] if message.startswith(param) else f"{new}: {message}"
    if param == "tools":  # chat's tools nest their fields under "function"
        message = message.replace(".function.", ".").replace(".function:", ":")
    if new == param and message == error.message:
        return error
    return APIError(error.status, message, param=new, code=error.code)
