"""``POST /v1/responses``'s pieces without a server: the response store evicts the least recently
used, input items become chat messages, the events close the text before a call begins and
text logprobs stop there, and a failure inside the engine ends the stream with an error
event."""

from __future__ import annotations

import json

import pytest
from responses_testing import ASK, LOGPROBS, TOOL
from serving import DEFAULT_SERVED_MODEL as MODEL

from baton.engine.server.responses_input import chat_messages
from baton.engine.server.responses_store import ResponseStore, StoredResponse

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


# ------------------------------------------------------------ units (no server)


def test_store_evicts_the_least_recently_used() -> None:
    store = ResponseStore(2)

    def put(rid: str) -> None:
        store.put(StoredResponse({"id": rid, "output": []}, ()))

    put("a")
    put("b")
    assert store.get("a") is not None  # now b is the least recently used
    put("c")
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2
    with pytest.raises(ValueError, match="capacity"):
        ResponseStore(0)


def test_items_become_chat_messages() -> None:
    items = [
        {"type": "message", "role": "developer", "content": "be brief"},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "ok"}],
        },
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
    ]
    messages = chat_messages(items)
    assert [m["role"] for m in messages] == ["system", "assistant", "tool"]
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["c1", "c2"]
    assert messages[1]["content"] == "ok" and messages[2]["tool_call_id"] == "c1"


def test_events_close_the_text_before_a_call_begins() -> None:
    """Text, then a Hermes call, read from a growing completion (what a model calling under
    tool_choice auto writes): the message item is done before the function_call item is
    added, and the final response holds both, the deltas adding up to each."""
    from baton.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from baton.engine.sampling_params import SamplingParams
    from baton.engine.server.chat_plan import ChatPlan
    from baton.engine.server.protocol import ChatCompletionRequest, ResponsesRequest
    from baton.engine.server.responses_output import ResponseContext
    from baton.engine.server.responses_stream import ResponseEvents
    from baton.engine.server.tools import tool_plan

    chat = ChatCompletionRequest(
        messages=[{"role": "user", "content": ASK}],
        tools=[{"type": "function", "function": {"name": "get_weather"}}],
    )
    plan = ChatPlan([1, 2], SamplingParams(), None, tool_plan(chat), None)
    body = ResponsesRequest(input=ASK, tools=[TOOL])
    events = ResponseEvents(ResponseContext("resp_1", 0, MODEL, body, plan))
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    full = "Let me look." + call
    stream = events.start()
    for end in range(1, len(full) + 1, 7):
        reason = "stop" if end >= len(full) else None
        c = CompletionOutput(0, full[:end], list(range(end)), None, None, finish_reason=reason)
        out = RequestOutput("r", None, [1, 2], [c], reason is not None, RequestMetrics(0.0))
        stream += events.update(out)
    c = CompletionOutput(0, full, list(range(len(full))), None, None, finish_reason="stop")
    stream += events.finish(RequestOutput("r", None, [1, 2], [c], True, RequestMetrics(0.0)))
    data = [json.loads(e.split("data: ", 1)[1]) for e in stream]
    kinds = [d["type"] for d in data]
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    message_done = kinds.index("response.output_item.done")
    assert data[message_done]["item"]["type"] == "message"
    assert message_done < kinds.index("response.function_call_arguments.delta")
    text = "".join(d["delta"] for d in data if d["type"] == "response.output_text.delta")
    arguments = "".join(
        d["delta"] for d in data if d["type"] == "response.function_call_arguments.delta"
    )
    message, function_call = data[-1]["response"]["output"]
    assert text == message["content"][0]["text"] == "Let me look."
    assert arguments == function_call["arguments"] and json.loads(arguments) == {"city": "Paris"}
    assert kinds[-1] == "response.completed" and function_call["status"] == "completed"


def test_text_logprobs_stop_where_a_call_begins() -> None:
    """Text, then a Hermes call, one character a token, logprobs asked for: the message's
    logprobs (streamed per delta, and unary) are those of its text's tokens only, none of the
    call's."""
    from baton.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
    from baton.engine.sampling_params import SamplingParams
    from baton.engine.server.chat_plan import ChatPlan
    from baton.engine.server.protocol import ChatCompletionRequest, ResponsesRequest
    from baton.engine.server.responses_output import ResponseContext, output_items
    from baton.engine.server.responses_stream import ResponseEvents
    from baton.engine.server.tools import tool_plan

    chat = ChatCompletionRequest(
        messages=[{"role": "user", "content": ASK}],
        tools=[{"type": "function", "function": {"name": "get_weather"}}],
    )
    plan = ChatPlan([1, 2], SamplingParams(logprobs=1), None, tool_plan(chat), None)
    body = ResponsesRequest(input=ASK, tools=[TOOL], include=[LOGPROBS], top_logprobs=1)
    events = ResponseEvents(ResponseContext("resp_1", 0, MODEL, body, plan))
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    full = "Let me look." + call

    def output(end: int, reason: str | None) -> RequestOutput:
        entries = [{i: Logprob(-0.5, 1, ch)} for i, ch in enumerate(full[:end])]
        c = CompletionOutput(0, full[:end], list(range(end)), None, entries, finish_reason=reason)
        return RequestOutput("r", None, [1, 2], [c], reason is not None, RequestMetrics(0.0))

    stream = events.start()
    for end in range(1, len(full) + 1, 5):
        stream += events.update(output(end, "stop" if end >= len(full) else None))
    stream += events.finish(output(len(full), "stop"))
    data = [json.loads(e.split("data: ", 1)[1]) for e in stream]
    deltas = [d for d in data if d["type"] == "response.output_text.delta"]
    for d in deltas:
        assert "".join(lp["token"] for lp in d["logprobs"]) == d["delta"]
    message = data[-1]["response"]["output"][0]
    assert [lp["token"] for lp in message["content"][0]["logprobs"]] == list("Let me look.")
    unary, _ = output_items(output(len(full), "stop"), plan)
    assert unary[0]["content"][0]["logprobs"] == message["content"][0]["logprobs"]
    assert unary[1]["type"] == "function_call"


@pytest.mark.parametrize("failure", ["output", "engine"])
def test_a_failure_inside_the_engine_ends_the_stream_with_an_error_event(failure: str) -> None:
    import asyncio
    from collections.abc import AsyncIterator

    from baton.engine.entrypoints.async_llm import EngineDeadError
    from baton.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from baton.engine.sampling_params import SamplingParams
    from baton.engine.server.chat_plan import ChatPlan
    from baton.engine.server.protocol import ResponsesRequest
    from baton.engine.server.responses import stream_events
    from baton.engine.server.responses_output import ResponseContext
    from baton.engine.server.responses_stream import ResponseEvents

    async def outputs() -> AsyncIterator[RequestOutput]:
        c = CompletionOutput(0, "Hel", [1], None, None)
        yield RequestOutput("r", None, [1], [c], False, RequestMetrics(0.0))
        if failure == "engine":
            raise EngineDeadError("the engine has stopped")
        c = CompletionOutput(0, "Hel", [1], None, None, finish_reason="error", error="boom")
        yield RequestOutput("r", None, [1], [c], True, RequestMetrics(0.0))

    async def run() -> list[str]:
        plan = ChatPlan([1], SamplingParams(), None, None, None)
        ctx = ResponseContext("resp_1", 0, MODEL, ResponsesRequest(input="hi"), plan)
        return [e async for e in stream_events(outputs(), ResponseEvents(ctx), store, [])]

    store = ResponseStore()
    data = [json.loads(e.split("data: ", 1)[1]) for e in asyncio.run(run())]
    assert [d["type"] for d in data][:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert data[-1]["type"] == "error"
    assert data[-1]["message"] == ("boom" if failure == "output" else "the engine has stopped")
    assert store.get("resp_1") is None
