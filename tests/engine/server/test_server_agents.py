"""Agent frameworks as users point them at an OpenAI-compatible server (the OpenAI Agents
SDK, ``openai-agents``, and ``pydantic-ai``) against ``baton serve`` on the default model at
temperature 0, over chat completions and the Responses API. This small model's answers are
random-ish, so the tests check structure: every final output and every tool call's arguments
are validated with ``jsonschema`` against the schema the framework sent, and each run ends
within a bounded number of turns."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from serving import DEFAULT_SERVED_MODEL as MODEL

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MAX_TOKENS = 64  # a Weather answer or a get_weather call takes ~40 tokens
ASK = "What is the weather in Paris, in celsius?"
APIS = ("chat", "responses")


class Weather(BaseModel):
    """The weather to look up."""

    city: str = Field(max_length=12)
    unit: Literal["celsius", "fahrenheit"]


def check_weather(output: Any) -> None:
    assert isinstance(output, Weather), output
    jsonschema.validate(output.model_dump(), Weather.model_json_schema())


def check_logprobs(text: str, logprobs: list[Any], top_n: int, end: str = "") -> None:
    """Token logprobs of ``text``: their tokens write it (and then ``end``), each with
    ``top_n`` alternatives."""
    assert logprobs, "no logprobs"
    assert "".join(lp.token for lp in logprobs) == text + end
    for lp in logprobs:
        assert lp.logprob <= 0 and len(lp.top_logprobs) == top_n


# ----------------------------------------------------------------------- openai-agents


@pytest.fixture(scope="module")
def agents_sdk() -> Any:
    sdk = pytest.importorskip("agents")
    sdk.set_tracing_disabled(True)  # no traces sent to OpenAI
    return sdk


def agents_model(sdk: Any, base: str, api: str) -> Any:
    """The SDK's chat-completions or Responses model on the server."""
    client = openai.AsyncOpenAI(api_key="none", base_url=f"{base}/v1", max_retries=0)
    kind = sdk.OpenAIChatCompletionsModel if api == "chat" else sdk.OpenAIResponsesModel
    return kind(model=MODEL, openai_client=client)


async def run_agent(sdk: Any, agent: Any, streamed: bool) -> Any:
    if not streamed:
        return await sdk.Runner.run(agent, ASK, max_turns=2)
    result = sdk.Runner.run_streamed(agent, ASK, max_turns=2)
    async for _ in result.stream_events():
        pass
    return result


@pytest.mark.parametrize("streamed", [False, True], ids=["unary", "streamed"])
@pytest.mark.parametrize("api", APIS)
def test_agents_output_type(
    default_model_server: str, agents_sdk: Any, api: str, streamed: bool
) -> None:
    """``output_type`` sends the model's strict JSON schema (chat's response_format,
    Responses' text.format); the final output parses into the model."""
    agent = agents_sdk.Agent(
        name="weather",
        instructions="Answer in JSON.",
        model=agents_model(agents_sdk, default_model_server, api),
        output_type=Weather,
        model_settings=agents_sdk.ModelSettings(max_tokens=MAX_TOKENS, temperature=0),
    )
    result = asyncio.run(run_agent(agents_sdk, agent, streamed))
    check_weather(result.final_output)


@pytest.mark.parametrize("streamed", [False, True], ids=["unary", "streamed"])
@pytest.mark.parametrize("api", APIS)
def test_agents_function_tool(
    default_model_server: str, agents_sdk: Any, api: str, streamed: bool
) -> None:
    """A forced call (tool_choice "required", one call) of a strict function tool: the tool
    runs once with arguments that fit its schema, and its result ends the run."""
    calls: list[dict[str, Any]] = []

    @agents_sdk.function_tool
    def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
        """Looks up the weather in a city."""
        calls.append({"city": city, "unit": unit})
        return "21 degrees"

    agent = agents_sdk.Agent(
        name="weather",
        instructions="Use the tool.",
        model=agents_model(agents_sdk, default_model_server, api),
        tools=[get_weather],
        tool_use_behavior="stop_on_first_tool",
        model_settings=agents_sdk.ModelSettings(
            tool_choice="required",
            parallel_tool_calls=False,  # this model would call again until max_tokens
            max_tokens=MAX_TOKENS,
            temperature=0,
        ),
    )
    result = asyncio.run(run_agent(agents_sdk, agent, streamed))
    assert result.final_output == "21 degrees"
    assert get_weather.strict_json_schema and len(calls) == 1, calls
    jsonschema.validate(calls[0], get_weather.params_json_schema)


@pytest.mark.parametrize("api", APIS)
def test_agents_top_logprobs(default_model_server: str, agents_sdk: Any, api: str) -> None:
    """``ModelSettings(top_logprobs=...)``: chat's logprobs, and on the Responses API
    ``include: ["message.output_text.logprobs"]`` (refused by baton before issue 55); the
    output text's tokens come back with their alternatives."""
    agent = agents_sdk.Agent(
        name="weather",
        model=agents_model(agents_sdk, default_model_server, api),
        output_type=Weather,
        model_settings=agents_sdk.ModelSettings(
            max_tokens=MAX_TOKENS, temperature=0, top_logprobs=2
        ),
    )
    result = asyncio.run(run_agent(agents_sdk, agent, streamed=False))
    check_weather(result.final_output)
    (raw,) = result.raw_responses
    (message,) = [item for item in raw.output if item.type == "message"]
    (part,) = message.content
    # Chat's logprobs are those of every sampled token, the end of the turn too (as vLLM's);
    # an output_text part's are those of its text.
    end = "<|im_end|>" if api == "chat" else ""
    check_logprobs(part.text, part.logprobs, top_n=2, end=end)


# --------------------------------------------------------------------------- pydantic-ai


@pytest.fixture(scope="module")
def pydantic_ai_model(default_model_server: str) -> Callable[[str], Any]:
    """The pydantic-ai model of an API ("chat" or "responses") on the server."""
    pytest.importorskip("pydantic_ai")
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(base_url=f"{default_model_server}/v1", api_key="none")

    def model(api: str) -> Any:
        kind = OpenAIChatModel if api == "chat" else OpenAIResponsesModel
        return kind(MODEL, provider=provider)

    return model


def output_spec(mode: str) -> Any:
    from pydantic_ai.output import NativeOutput, PromptedOutput, ToolOutput

    return {
        "tool": ToolOutput(Weather),  # the default: a forced call of a final_result tool
        "native": NativeOutput(Weather),  # response_format / text.format json_schema
        "prompted": PromptedOutput(Weather),  # the schema in the prompt, json_object
    }[mode]


# Each API in each mode once, and each API streamed once (to keep the module's time small).
ENFORCED = [
    ("chat", "tool", False),
    ("chat", "native", True),
    ("responses", "tool", True),
    ("responses", "native", False),
]


@pytest.mark.parametrize(("api", "mode", "streamed"), ENFORCED)
def test_pydantic_ai_enforced_output_modes(
    pydantic_ai_model: Callable[[str], Any], api: str, mode: str, streamed: bool
) -> None:
    """The output modes that send the schema to the server (a forced call of pydantic-ai's
    final_result tool; response_format / text.format json_schema): the output validates."""
    from pydantic_ai import Agent

    agent = Agent(
        pydantic_ai_model(api),
        output_type=output_spec(mode),
        model_settings={"max_tokens": MAX_TOKENS, "temperature": 0},
        retries=0,
    )

    async def run() -> Any:
        if not streamed:
            return (await agent.run(ASK)).output
        async with agent.run_stream(ASK) as result:
            return await result.get_output()

    check_weather(asyncio.run(run()))


@pytest.mark.parametrize("api", APIS)
def test_pydantic_ai_prompted_output(pydantic_ai_model: Callable[[str], Any], api: str) -> None:
    """PromptedOutput puts the schema in the prompt and asks for a JSON object (json_object
    on chat, enforced): the answer is one, whether or not this small model fills the fields
    right (it tends to echo the schema, which pydantic-ai reports as a failed output)."""
    from pydantic_ai import Agent, UnexpectedModelBehavior, capture_run_messages
    from pydantic_ai.messages import ModelResponse, TextPart

    agent = Agent(
        pydantic_ai_model(api),
        output_type=output_spec("prompted"),
        model_settings={"max_tokens": MAX_TOKENS, "temperature": 0},
        retries=0,
    )
    with capture_run_messages() as messages:
        try:
            check_weather(agent.run_sync(ASK).output)
            return
        except UnexpectedModelBehavior:
            pass
    (response,) = [m for m in messages if isinstance(m, ModelResponse)]
    (text,) = [p.content for p in response.parts if isinstance(p, TextPart)]
    if api == "chat":  # Responses' prompted mode sends no format: nothing is enforced there
        assert isinstance(json.loads(text), dict), text


def test_pydantic_ai_responses_logprobs(pydantic_ai_model: Callable[[str], Any]) -> None:
    """``openai_logprobs`` on the Responses model sends include
    ["message.output_text.logprobs"] (refused by baton before issue 55): the text part
    carries its tokens' logprobs."""
    from pydantic_ai import Agent
    from pydantic_ai.messages import TextPart

    agent = Agent(
        pydantic_ai_model("responses"),
        output_type=output_spec("native"),
        model_settings={
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "openai_logprobs": True,
            "openai_top_logprobs": 1,
        },
        retries=0,
    )
    result = agent.run_sync(ASK)
    check_weather(result.output)
    (part,) = [p for p in result.all_messages()[-1].parts if isinstance(p, TextPart)]
    logprobs = part.provider_details["logprobs"]
    assert "".join(lp["token"] for lp in logprobs) == part.content
    assert all(len(lp["top_logprobs"]) == 1 for lp in logprobs)
