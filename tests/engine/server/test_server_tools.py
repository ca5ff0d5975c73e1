"""Tool calling and structured output as real clients use them (the official ``openai``
client, ``instructor``, ``langchain-openai``) against ``baton serve`` on the default model at
temperature 0. Every call's arguments and every structured answer is validated with
``jsonschema``; a tool call is forced by the grammar, so even this small model makes valid
ones. The other models' tool-call syntaxes (``--tool-call-parser``) are served by one app
each on the same engine."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from serving import DEFAULT_SERVED_MODEL as MODEL

from baton.engine.server.protocol import ChatCompletionRequest
from baton.engine.server.tools import prepare_messages, tool_plan
from baton.grammar.tool_formats import TOOL_CALL_FORMATS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MAX_TOKENS = 64  # a get_weather call takes ~40 tokens


class Weather(BaseModel):
    """The weather to look up."""

    city: str = Field(max_length=12)
    unit: Literal["celsius", "fahrenheit"]


class Clock(BaseModel):
    """The time to look up."""

    timezone: Literal["UTC", "CET", "PST"]


WEATHER_TOOL = openai.pydantic_function_tool(Weather, name="get_weather")  # strict
CLOCK_TOOL = openai.pydantic_function_tool(Clock, name="get_time")
SCHEMAS = {
    "get_weather": WEATHER_TOOL["function"]["parameters"],
    "get_time": CLOCK_TOOL["function"]["parameters"],
}
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]


@pytest.fixture(scope="module")
def client(default_model_server: str) -> openai.OpenAI:
    return openai.OpenAI(api_key="none", base_url=f"{default_model_server}/v1", max_retries=0)


def check_calls(message: Any) -> list[tuple[str, dict[str, Any]]]:
    """The (name, arguments) of a message's tool calls, each validated against its tool."""
    calls = []
    for call in message.tool_calls or []:
        assert call.type == "function" and call.id.startswith("call_")
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        calls.append((call.function.name, args))
    return calls


# --------------------------------------------------------------------- openai: tools


def test_named_tool_choice(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER_TOOL, CLOCK_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = check_calls(choice.message)
    assert [name for name, _ in calls] == ["get_weather"]


def test_required_tool_choice_one_call(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER_TOOL, CLOCK_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert r.choices[0].finish_reason == "tool_calls"
    assert len(check_calls(r.choices[0].message)) == 1


def test_auto_answers_text_or_calls(client: openai.OpenAI) -> None:
    """This model answers in text when free to; what comes back is either text (no call
    syntax left in it) or valid calls."""
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER_TOOL],
        tool_choice="auto",
        max_tokens=12,
        temperature=0,
    )
    choice = r.choices[0]
    if choice.message.tool_calls:
        check_calls(choice.message)
    else:
        assert choice.message.content and "<tool_call>" not in choice.message.content
        assert choice.finish_reason in ("stop", "length")


def test_auto_with_a_response_format(client: openai.OpenAI) -> None:
    """With tools and a response format, the answer is calls or JSON in that format."""
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[CLOCK_TOOL],
        tool_choice="auto",
        parallel_tool_calls=False,  # this model would call again and again until max_tokens
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "weather", "schema": SCHEMAS["get_weather"]},
        },
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    message = r.choices[0].message
    if message.tool_calls:
        assert r.choices[0].finish_reason == "tool_calls"
        check_calls(message)
    else:
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(message.content), SCHEMAS["get_weather"])


def test_none_tool_choice_answers_text(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER_TOOL], tool_choice="none", max_tokens=4
    )
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


def test_streamed_tool_call_deltas(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
    )
    calls: dict[int, dict[str, str]] = {}
    finish, argument_deltas = None, 0
    for chunk in stream:
        for choice in chunk.choices:
            for d in choice.delta.tool_calls or []:
                if d.id is not None:  # a call's first delta names it
                    assert d.index not in calls and d.function.name
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                calls[d.index]["arguments"] += d.function.arguments or ""
                argument_deltas += 1
            assert not choice.delta.content
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert argument_deltas > 2, "the arguments should arrive in several deltas"
    assert list(calls) == [0] and calls[0]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS["get_weather"])


def test_stream_helper_parses_strict_tool_arguments(client: openai.OpenAI) -> None:
    """The client's own stream accumulator rebuilds the call and parses it into the model."""
    with client.chat.completions.stream(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=MAX_TOKENS,
        temperature=0,
    ) as stream:
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, Weather)


def test_tool_results_go_back_through_the_template(client: openai.OpenAI) -> None:
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city":"Paris","unit":"celsius"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    r = client.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER_TOOL], max_tokens=4, temperature=0
    )
    assert r.choices[0].message.content or r.choices[0].message.tool_calls


def test_prompt_rendering_of_tools_calls_and_results(tokenizer: Any) -> None:
    body = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                *ASK,
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "a", "function": {"name": "get_weather", "arguments": '{"x":1}'}},
                        {"id": "b", "function": {"name": "get_time", "arguments": {"y": 2}}},
                    ],
                },
                {"role": "tool", "tool_call_id": "a", "content": "21C"},
                {"role": "tool", "tool_call_id": "b", "content": "noon"},
            ],
            "tools": [WEATHER_TOOL, CLOCK_TOOL],
        }
    )
    plan = tool_plan(body)
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    prepared, variables = prepare_messages(messages, plan, tokenizer.chat_template)
    assert variables == {}  # the default model's template knows no tools: baton writes them
    text = tokenizer.apply_chat_template(prepared, add_generation_prompt=True, tokenize=False)
    assert text.count("<|im_start|>system") == 1 and "Be brief.\n\n# Tools" in text
    assert '"name": "get_weather"' in text and '"name": "get_time"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"x":1}}\n</tool_call>' in text
    assert '{"name": "get_time", "arguments": {"y": 2}}' in text
    # Both results in one user turn, in order.
    assert "<|im_start|>user\n<tool_response>\n21C\n</tool_response>\n<tool_response>\nnoon" in text
    assert "<|im_start|>tool" not in text


# --------------------------------------------------------------- openai: response_format


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    r = client.chat.completions.parse(
        model=MODEL, messages=ASK, response_format=Weather, max_tokens=MAX_TOKENS, temperature=0
    )
    assert isinstance(r.choices[0].message.parsed, Weather)


# ------------------------------------------------------------------------- instructor


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_enforced_modes(client: openai.OpenAI, mode: str) -> None:
    instructor = pytest.importorskip("instructor")
    patched = instructor.from_openai(client, mode=getattr(instructor.Mode, mode))
    weather = patched.chat.completions.create(
        model=MODEL,
        response_model=Weather,
        messages=ASK,
        max_tokens=MAX_TOKENS,
        temperature=0,
        max_retries=0,
    )
    assert isinstance(weather, Weather)
    jsonschema.validate(weather.model_dump(), Weather.model_json_schema())


def test_instructor_parallel_tools(client: openai.OpenAI) -> None:
    """PARALLEL_TOOLS sends tool_choice "auto", and this model then answers in text (at
    temperature 0 it never starts a call by itself); a client that needs the calls asks for
    them ("required"), here through the body, and gets each one parsed into its model."""
    instructor = pytest.importorskip("instructor")
    patched = instructor.from_openai(client, mode=instructor.Mode.PARALLEL_TOOLS)
    results = patched.chat.completions.create(
        model=MODEL,
        response_model=Iterable[Weather | Clock],
        messages=ASK,
        max_tokens=MAX_TOKENS,
        temperature=0,
        max_retries=0,
        parallel_tool_calls=False,
        extra_body={"tool_choice": "required"},
    )
    objects = list(results)
    assert len(objects) == 1 and isinstance(objects[0], (Weather, Clock))


@pytest.mark.parametrize(("mode", "max_tokens"), [("JSON", MAX_TOKENS), ("MD_JSON", 128)])
def test_instructor_prompted_modes(client: openai.OpenAI, mode: str, max_tokens: int) -> None:
    """JSON (json_object: any object, enforced) and MD_JSON (a prompt only, nothing
    enforced): the answer must parse as JSON (in MD_JSON, its first ```json block). Whether
    it also fills the fields right is up to the model; this small one tends to echo the schema,
    which instructor then reports as a validation error."""
    instructor = pytest.importorskip("instructor")
    from instructor.core import IncompleteOutputException, InstructorRetryException

    patched = instructor.from_openai(client, mode=getattr(instructor.Mode, mode))
    try:
        weather = patched.chat.completions.create(
            model=MODEL,
            response_model=Weather,
            messages=ASK,
            max_tokens=max_tokens,
            temperature=0,
            max_retries=0,
        )
    except (InstructorRetryException, IncompleteOutputException) as exc:
        text = exc.last_completion.choices[0].message.content
        if mode == "MD_JSON":
            block = re.search(r"```json\s*(.*?)```", text, re.DOTALL)
            assert block is not None, text
            text = block.group(1)
        assert isinstance(json.loads(text), dict), text
        return
    jsonschema.validate(weather.model_dump(), Weather.model_json_schema())


# --------------------------------------------------------------------------- langchain


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_with_structured_output(default_model_server: str, method: str) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(
        model=MODEL,
        base_url=f"{default_model_server}/v1",
        api_key="none",
        temperature=0,
        max_tokens=MAX_TOKENS,
        max_retries=0,
    )
    weather = llm.with_structured_output(Weather, method=method).invoke(ASK[0]["content"])
    assert isinstance(weather, Weather)
    jsonschema.validate(weather.model_dump(), Weather.model_json_schema())


# ------------------------------------------------ other models' syntax: --tool-call-parser

PARSERS = list(TOOL_CALL_FORMATS)
FORMAT_MAX_TOKENS = 96  # a get_weather call in Qwen's XML takes ~50 tokens


def parser_client(servers: dict[str, str], parser: str) -> openai.OpenAI:
    return openai.OpenAI(api_key="none", base_url=f"{servers[parser]}/v1", max_retries=0)


def _named_call(servers: dict[str, str], parser: str) -> Any:
    return parser_client(servers, parser).chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER_TOOL, CLOCK_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=FORMAT_MAX_TOKENS,
        temperature=0,
        logprobs=True,  # the tokens show the text the model wrote
    )


def _required_stream(servers: dict[str, str], parser: str) -> list[Any]:
    stream = parser_client(servers, parser).chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER_TOOL, CLOCK_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=FORMAT_MAX_TOKENS,
        temperature=0,
        stream=True,
    )
    return list(stream)


def _outcome(send: Any, servers: dict[str, str], parser: str) -> Any:
    """What ``send`` returned, or the exception it raised (re-raised by the test that reads
    it, so that one request's failure fails its own test only)."""
    try:
        return send(servers, parser)
    except Exception as exc:
        return exc


@pytest.fixture(scope="module")
def format_answers(parser_servers: dict[str, str]) -> dict[tuple[str, str], Any]:
    """The named and the streamed required call of every format, sent at once so that the
    engine batches them (one after another, each ran ~60 decode steps alone): the response
    and the list of stream chunks, by (kind, parser)."""
    cases = [(kind, parser) for kind in ("named", "streamed") for parser in PARSERS]
    sends = {"named": _named_call, "streamed": _required_stream}
    with ThreadPoolExecutor(len(cases)) as pool:
        futures = [pool.submit(_outcome, sends[k], parser_servers, p) for k, p in cases]
        return dict(zip(cases, (f.result() for f in futures), strict=True))


def _answer(answers: dict[tuple[str, str], Any], kind: str, parser: str) -> Any:
    answer = answers[kind, parser]
    if isinstance(answer, Exception):
        raise answer
    return answer


@pytest.mark.parametrize("parser", PARSERS)
def test_named_tool_choice_in_each_format(
    format_answers: dict[tuple[str, str], Any], parser: str
) -> None:
    r = _answer(format_answers, "named", parser)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    assert [name for name, _ in check_calls(choice.message)] == ["get_weather"]
    fmt = TOOL_CALL_FORMATS[parser]
    written = "".join(t.token for t in choice.logprobs.content).removesuffix("<|im_end|>")
    assert written.startswith(fmt.block_begin + fmt.begin("get_weather")), written
    assert written.endswith(fmt.end + fmt.block_end), written


@pytest.mark.parametrize("parser", PARSERS)
def test_required_streamed_in_each_format(
    format_answers: dict[tuple[str, str], Any], parser: str
) -> None:
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in _answer(format_answers, "streamed", parser):
        for choice in chunk.choices:
            for d in choice.delta.tool_calls or []:
                if d.id is not None:  # a call's first delta names it
                    assert d.index not in calls and d.function.name
                    calls[d.index] = {"name": d.function.name, "arguments": ""}
                else:
                    assert d.function.name is None
                calls[d.index]["arguments"] += d.function.arguments or ""
            assert not choice.delta.content
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert list(calls) == [0]
    jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS[calls[0]["name"]])


@pytest.mark.parametrize("parser", PARSERS)
def test_auto_in_each_format(parser_servers: dict[str, str], parser: str) -> None:
    """Text (no call syntax left in it) or valid calls."""
    r = parser_client(parser_servers, parser).chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER_TOOL, CLOCK_TOOL],
        tool_choice="auto",
        max_tokens=12,
        temperature=0,
    )
    message = r.choices[0].message
    if message.tool_calls:
        check_calls(message)
    else:
        assert message.content and TOOL_CALL_FORMATS[parser].trigger not in message.content


@pytest.mark.parametrize("parser", PARSERS)
def test_a_tool_schema_that_cannot_compile_is_a_400(
    parser_servers: dict[str, str], parser: str
) -> None:
    """A property that must be absent where other names are allowed: xgrammar cannot build
    it in any format; the 400 names the field and the tool, streamed or not."""
    impossible = {
        "type": "object",
        "properties": {"foo": {"type": "integer"}, "bar": False},
        "required": ["foo"],
        "additionalProperties": {"type": "integer"},
    }
    body = {
        "model": MODEL,
        "messages": ASK,
        "tools": [
            CLOCK_TOOL,
            {"type": "function", "function": {"name": "f", "parameters": impossible}},
        ],
        "tool_choice": "required",
        "max_tokens": 4,
    }
    for stream in (False, True):
        url = f"{parser_servers[parser]}/v1/chat/completions"
        r = httpx.post(url, json=body | {"stream": stream}, timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "tools" and "tools[1] (function 'f')" in error["message"], error
