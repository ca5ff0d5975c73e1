"""``POST /v1/responses`` (OpenAI's Responses API) as clients use it: the official ``openai``
client (``responses.create``, ``responses.parse``, ``responses.stream``, ``retrieve``),
``instructor``'s RESPONSES_TOOLS mode, and raw bodies for the 400s and 404s, against
``baton serve`` on the default model at temperature 0. Every structured answer and every
call's arguments are validated with ``jsonschema``."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from responses_testing import ASK, FORMAT, LOGPROBS, SCHEMA, TOOL, Weather
from serving import DEFAULT_SERVED_MODEL as MODEL

from baton.grammar.tool_formats import TOOL_CALL_FORMATS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MAX_TOKENS = 64  # a Weather object or a get_weather call takes ~40 tokens


@pytest.fixture(scope="module")
def client(default_model_server: str) -> openai.OpenAI:
    return openai.OpenAI(api_key="none", base_url=f"{default_model_server}/v1", max_retries=0)


# ----------------------------------------------------------------- create and parse


def test_json_schema_format(client: openai.OpenAI) -> None:
    r = client.responses.create(
        model=MODEL,
        instructions="Answer in JSON.",
        input=ASK,
        text={"format": FORMAT},
        max_output_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed"
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    (part,) = item.content
    assert part.type == "output_text" and part.annotations == []
    jsonschema.validate(json.loads(part.text), SCHEMA)
    assert r.instructions == "Answer in JSON." and r.model == MODEL
    assert r.text.format.type == "json_schema" and r.temperature == 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0


def test_parse_into_a_pydantic_model(client: openai.OpenAI) -> None:
    r = client.responses.parse(
        model=MODEL,
        input=[{"role": "user", "content": [{"type": "input_text", "text": ASK}]}],
        text_format=Weather,
        max_output_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert isinstance(r.output_parsed, Weather)
    jsonschema.validate(r.output_parsed.model_dump(), SCHEMA)


def test_max_output_tokens_makes_it_incomplete_and_store_false_is_not_kept(
    client: openai.OpenAI,
) -> None:
    r = client.responses.create(
        model=MODEL, input=ASK, max_output_tokens=3, temperature=0, store=False
    )
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete"
    with pytest.raises(openai.NotFoundError, match=r.id):
        client.responses.retrieve(r.id)


# ---------------------------------------------------------------------- streaming


def test_stream_events_in_order(client: openai.OpenAI) -> None:
    events = list(
        client.responses.create(
            model=MODEL,
            input=ASK,
            text={"format": FORMAT},
            max_output_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 2
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert events[-4].text == text and final.output[0].content[0].text == text
    assert final.status == "completed" and final.id == events[0].response.id
    jsonschema.validate(json.loads(text), SCHEMA)
    # A streamed response is stored too.
    assert client.responses.retrieve(final.id).output[0].content[0].text == text


def test_a_stream_cut_by_max_output_tokens_ends_incomplete(client: openai.OpenAI) -> None:
    events = list(
        client.responses.create(
            model=MODEL, input=ASK, max_output_tokens=3, temperature=0, stream=True
        )
    )
    assert events[-1].type == "response.incomplete"
    final = events[-1].response
    assert final.incomplete_details.reason == "max_output_tokens"
    assert final.output[0].status == "incomplete" and final.usage.output_tokens == 3


def test_stream_helper_parses(client: openai.OpenAI) -> None:
    with client.responses.stream(
        model=MODEL, input=ASK, text_format=Weather, max_output_tokens=MAX_TOKENS, temperature=0
    ) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert isinstance(final.output_parsed, Weather)
    assert final.output[0].content[0].text == text


def test_streamed_function_call(client: openai.OpenAI) -> None:
    events = list(
        client.responses.create(
            model=MODEL,
            input=ASK,
            tools=[TOOL],
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert len(kinds) == 6 + len(deltas)
    done, item = events[-3], events[-1].response.output[0]
    assert done.arguments == "".join(deltas) == item.arguments and done.name == "get_weather"
    assert item.type == "function_call" and item.call_id.startswith("call_")
    jsonschema.validate(json.loads(item.arguments), TOOL["parameters"])


# -------------------------------------------------------------- tools and chaining


def test_required_tool_call_then_its_output_continues_the_conversation(
    client: openai.OpenAI,
) -> None:
    first = client.responses.create(
        model=MODEL,
        input=ASK,
        tools=[TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=MAX_TOKENS,
        temperature=0,
    )
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), TOOL["parameters"])
    assert first.tool_choice == "required" and first.tools[0].name == "get_weather"

    result = {"type": "function_call_output", "call_id": call.call_id, "output": "22 C"}
    second = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[result],
        tools=[TOOL],
        max_output_tokens=8,
        temperature=0,
    )
    assert second.previous_response_id == first.id
    # The second prompt holds the first one, the call and the result.
    before = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens > before
    items = client.responses.input_items.list(second.id, order="asc").data
    assert [i.type for i in items] == ["message", "function_call", "function_call_output"]
    assert items[1].call_id == call.call_id


def test_previous_response_id_chains_and_retrieve(client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL, input="Say hi.", max_output_tokens=5)
    again = client.responses.retrieve(first.id)
    assert again.id == first.id and again.output[0].content[0].text == first.output_text
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, input="Once more.", max_output_tokens=5
    )
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    items = client.responses.input_items.list(second.id, order="asc").data
    assert [(i.type, i.role) for i in items] == [
        ("message", "user"),
        ("message", "assistant"),
        ("message", "user"),
    ]
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError, match=first.id):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError, match="resp_nope"):
        client.responses.create(model=MODEL, previous_response_id="resp_nope", input="x")
    with pytest.raises(openai.NotFoundError, match="resp_gone"):
        client.responses.retrieve("resp_gone")


def test_instructor_responses_tools(client: openai.OpenAI) -> None:
    instructor = pytest.importorskip("instructor")
    if not hasattr(instructor.Mode, "RESPONSES_TOOLS"):
        pytest.skip("this instructor has no RESPONSES_TOOLS mode")
    patched = instructor.from_openai(client, mode=instructor.Mode.RESPONSES_TOOLS)
    weather = patched.create(
        model=MODEL,
        response_model=Weather,
        messages=[{"role": "user", "content": ASK}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        max_retries=0,
    )
    assert isinstance(weather, Weather)
    jsonschema.validate(weather.model_dump(), SCHEMA)


# ---------------------------------------------------------------------------- logprobs


def check_text_logprobs(text: str, logprobs: list[Any], top_n: int) -> None:
    """The logprobs of an output text: their tokens write exactly it (the end-of-turn token
    is not text), each with ``top_n`` alternatives, the sampled one among them at temperature
    0."""
    assert logprobs and "".join(lp.token for lp in logprobs) == text
    for lp in logprobs:
        assert lp.bytes == list(lp.token.encode()) and len(lp.top_logprobs) == top_n
        assert lp.logprob == max(t.logprob for t in lp.top_logprobs)


def test_include_output_text_logprobs(client: openai.OpenAI) -> None:
    """``include: ["message.output_text.logprobs"]`` with ``top_logprobs`` (what the Agents SDK
    and pydantic-ai send for logprobs): the text part carries them, as returned and as
    stored."""
    r = client.responses.create(
        model=MODEL,
        input=ASK,
        text={"format": FORMAT},
        include=[LOGPROBS],
        top_logprobs=2,
        max_output_tokens=MAX_TOKENS,
        temperature=0,
    )
    (part,) = r.output[0].content
    jsonschema.validate(json.loads(part.text), SCHEMA)
    check_text_logprobs(part.text, part.logprobs, top_n=2)
    (stored,) = client.responses.retrieve(r.id).output[0].content
    assert stored.logprobs == part.logprobs


def test_streamed_output_text_logprobs(client: openai.OpenAI) -> None:
    """Streamed, each text delta carries the logprobs of the tokens that wrote it; the done
    event and the final response carry all of them."""
    deltas, done, final = [], None, None
    with client.responses.stream(
        model=MODEL,
        input=ASK,
        text={"format": FORMAT},
        include=[LOGPROBS],
        top_logprobs=1,
        max_output_tokens=MAX_TOKENS,
        temperature=0,
    ) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event)
            elif event.type == "response.output_text.done":
                done = event
        final = stream.get_final_response()
    assert deltas and done is not None
    for event in deltas:
        assert "".join(lp.token for lp in event.logprobs) == event.delta
    (part,) = final.output[0].content
    check_text_logprobs(part.text, part.logprobs, top_n=1)
    assert [lp.token for lp in done.logprobs] == [lp.token for lp in part.logprobs]
    assert sum(len(event.logprobs) for event in deltas) == len(part.logprobs)


def test_no_logprobs_unless_included(client: openai.OpenAI) -> None:
    r = client.responses.create(model=MODEL, input=ASK, max_output_tokens=4, temperature=0)
    assert r.output[0].content[0].logprobs == []


# ---------------------------------------------------------------------- bad input

BAD: list[tuple[dict[str, Any], str, str]] = [
    ({"input": 5}, "input", "input"),
    ({"temperature": "hot"}, "temperature", "temperature"),
    ({"input": [{"type": "web_search_call"}]}, "input[0].type", "not supported"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "input[0].content[0]",
        "input_image",
    ),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role", "robot"),
    (
        {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
        "input[0].call_id",
        "",
    ),
    ({"input": []}, "input", "at least one"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type", "xml"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", "schema"),
    ({"text": {"format": "json"}}, "text.format", "object"),
    (
        {"text": {"format": {"type": "json_schema", "schema": {"type": "nope"}}}},
        "text.format",
        "text.format",
    ),
    ({"tools": [{"type": "function", "parameters": {}}]}, "tools[0].name", "name"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "web_search"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "f"}}, "tool_choice", "f"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort", "high"),
    ({"max_output_tokens": -1}, "max_output_tokens", "max_output_tokens"),
    ({"frobnicate": 1}, "frobnicate", "unknown field"),
    ({"background": True}, "background", "background"),
    ({"include": ["reasoning.encrypted_content"]}, "include", "encrypted_content"),
    ({"include": [LOGPROBS, "file_search_call.results"]}, "include", "include[1]"),
    ({"top_logprobs": 2}, "top_logprobs", LOGPROBS),  # alternatives that would not come back
    ({"include": [LOGPROBS], "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
    # The Responses API has no logit_bias (chat and completions do).
    ({"logit_bias": {"1": 5}}, "logit_bias", "/v1/chat/completions"),
]


@pytest.mark.parametrize(("fields", "param", "word"), BAD, ids=lambda v: str(v)[:40])
def test_bad_input_is_a_400_naming_the_field(
    default_model_server: str, fields: dict[str, Any], param: str, word: str
) -> None:
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 1, **fields}
    r = httpx.post(f"{default_model_server}/v1/responses", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and word in error["message"], error


@pytest.mark.parametrize("stream", [False, True])
def test_a_schema_that_cannot_compile_is_a_400_naming_text_format(
    default_model_server: str, stream: bool
) -> None:
    schema = {"type": "integer", "minimum": 5, "maximum": 2}
    body = {
        "model": MODEL,
        "input": "hi",
        "stream": stream,
        "text": {"format": {"type": "json_schema", "name": "n", "schema": schema}},
    }
    r = httpx.post(f"{default_model_server}/v1/responses", json=body, timeout=120)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "text.format", error
    assert error["message"].startswith("text.format"), error


# ------------------------------------------------- the server's tool-call syntax


def _sse_data(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", url, json=body | {"stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(x[len("data: ") :]) for x in r.iter_lines() if x.startswith("data: ")]


@pytest.mark.parametrize("parser", list(TOOL_CALL_FORMATS))
def test_tools_run_in_the_servers_call_syntax_as_chat(
    parser_servers: dict[str, str], parser: str
) -> None:
    """Under ``--tool-call-parser``, a named call is shown, forced and read back in that
    syntax as chat's is: the chat request writes it in that syntax (its logprobs' tokens), and
    the response has the same prompt (input tokens: the tools shown in that syntax), the same
    generated tokens and arguments; streamed, the argument deltas add up to them."""
    base = parser_servers[parser]
    body = {
        "model": MODEL,
        "input": ASK,
        "tools": [TOOL],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 96,  # a call in Qwen's XML takes ~50 tokens
        "temperature": 0,
    }
    r = httpx.post(f"{base}/v1/responses", json=body, timeout=120)
    assert r.status_code == 200, r.text
    response = r.json()
    (call,) = response["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather", call
    jsonschema.validate(json.loads(call["arguments"]), TOOL["parameters"])
    function = {k: TOOL[k] for k in ("name", "description", "parameters", "strict")}
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": ASK}],
        "tools": [{"type": "function", "function": function}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 96,
        "temperature": 0,
        "logprobs": True,  # the tokens show the text the model wrote
    }
    r = httpx.post(f"{base}/v1/chat/completions", json=chat, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    fmt = TOOL_CALL_FORMATS[parser]
    written = "".join(t["token"] for t in choice["logprobs"]["content"]).removesuffix("<|im_end|>")
    assert written.startswith(fmt.block_begin + fmt.begin("get_weather")), written
    (chat_call,) = choice["message"]["tool_calls"]
    assert call["arguments"] == chat_call["function"]["arguments"]
    usage = r.json()["usage"]
    assert response["usage"]["input_tokens"] == usage["prompt_tokens"]
    assert response["usage"]["output_tokens"] == usage["completion_tokens"]
    events = _sse_data(f"{base}/v1/responses", body)
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert "".join(deltas) == call["arguments"]
    assert events[-1]["type"] == "response.completed"


@pytest.mark.parametrize("parser", list(TOOL_CALL_FORMATS))
def test_a_tool_schema_that_cannot_compile_is_a_400_naming_the_tool(
    parser_servers: dict[str, str], parser: str
) -> None:
    """A property that must be absent where other names are allowed: xgrammar cannot build
    it in any syntax; the 400 names ``tools`` and the tool (``tools[1]``, as the Responses
    body lists it), streamed or not."""
    impossible = {
        "type": "object",
        "properties": {"foo": {"type": "integer"}, "bar": False},
        "required": ["foo"],
        "additionalProperties": {"type": "integer"},
    }
    body = {
        "model": MODEL,
        "input": ASK,
        "tools": [TOOL, {"type": "function", "name": "f", "parameters": impossible}],
        "tool_choice": "required",
        "max_output_tokens": 4,
    }
    for stream in (False, True):
        url = f"{parser_servers[parser]}/v1/responses"
        r = httpx.post(url, json=body | {"stream": stream}, timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "tools", error
        assert error["message"].startswith("tools[1] (function 'f'): "), error


def test_unknown_ids_are_a_404_naming_them(default_model_server: str) -> None:
    for method, path in (("GET", ""), ("GET", "/input_items"), ("DELETE", "")):
        r = httpx.request(method, f"{default_model_server}/v1/responses/resp_x{path}", timeout=30)
        assert r.status_code == 404 and "resp_x" in r.json()["error"]["message"], r.text
