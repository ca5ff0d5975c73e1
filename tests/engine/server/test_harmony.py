"""gpt-oss's harmony format (``--reasoning-parser openai_gptoss``) served: the server reads
analysis as ``reasoning_content`` and final as ``content`` from the token ids, the Responses API
carries the analysis as a reasoning item, and tool choice forces harmony calls that stream as
deltas and validate (the matcher, splitter and parsing without a server:
test_harmony_parsing.py). gpt-oss served with no parser named gets harmony's all the same,
and a parser named that cannot read harmony is refused at start-up (``model_parsers.py``)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from harmony_testing import WEATHER, _ids
from test_gpt_oss import folder, harmony_folder  # noqa: F401 - the tiny gpt-oss fixtures
from test_reasoning import SCHEMA, _responses_events

from baton.engine.loader import load_tokenizer
from baton.grammar.tool_formats import OPENAI


@pytest.fixture(scope="module")
def harmony_tokenizer(harmony_folder):  # noqa: F811
    return load_tokenizer(harmony_folder)


TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
    "<|start|>assistant"
)


@pytest.fixture(scope="module")
def harmony_server(harmony_folder):  # noqa: F811
    """``baton serve --reasoning-parser openai_gptoss --tool-call-parser openai`` on the tiny
    gpt-oss, with a harmony chat template."""
    from serving import serve_in_thread

    from baton.engine.entrypoints.async_llm import AsyncLLM
    from baton.engine.server.app import build_app
    from baton.engine.server.config import ServerConfig

    engine = AsyncLLM.from_engine_args(
        str(harmony_folder),
        dtype="float32",
        max_num_seqs=4,
        max_model_len=768,  # the tools' system message takes ~250 tokens
        reasoning_parser="openai_gptoss",
    )
    config = ServerConfig(
        served_model_name="oss",
        reasoning_parser="openai_gptoss",
        tool_call_parser="openai",
        chat_template=TEMPLATE,
    )
    try:
        with serve_in_thread(build_app(engine, config)) as base:
            yield base
    finally:
        engine.shutdown()


def _structured_chat(seed: int) -> dict[str, Any]:
    """A chat request for SCHEMA at temperature 1 with 6 reasoning tokens at most."""
    return {
        "model": "oss",
        "messages": [{"role": "user", "content": "A name and a flag, as JSON."}],
        "max_tokens": 80,
        "temperature": 1.0,
        "seed": seed,
        "max_reasoning_tokens": 6,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": SCHEMA},
        },
    }


def test_the_server_returns_analysis_as_reasoning_and_final_as_content(
    harmony_server, harmony_tokenizer
):
    """A JSON-schema chat request with 6 reasoning tokens at most: content is the validated
    object of the final channel, reasoning_content the analysis; streamed, the deltas add up
    to the same message."""
    import httpx

    url = f"{harmony_server}/v1/chat/completions"
    # The thoughts, then at most the forced markers and the final channel's header.
    most = 6 + len(_ids(harmony_tokenizer, "<|end|><|start|>assistant<|channel|>final<|message|>"))
    for seed in range(3):
        body = _structured_chat(seed)
        reply = httpx.post(url, json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        message = reply.json()["choices"][0]["message"]
        assert isinstance(message["reasoning_content"], str)
        jsonschema.validate(json.loads(message["content"]), SCHEMA)
        spent = reply.json()["usage"]["completion_tokens_details"]["reasoning_tokens"]
        assert 4 <= spent <= most
        parts = {"reasoning_content": "", "content": ""}
        with httpx.stream("POST", url, json=body | {"stream": True}, timeout=120) as stream:
            for line in stream.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[len("data: ") :])["choices"]:
                    for key in parts:
                        parts[key] += choice["delta"].get(key) or ""
        assert parts == {
            "reasoning_content": message["reasoning_content"],
            "content": message["content"],
        }


def test_responses_carry_the_analysis_as_a_reasoning_item(harmony_server):
    """/v1/responses reads harmony through the same parser: a reasoning item, then the
    message with the validated object; streamed, the text deltas add up to it."""
    import httpx

    url = f"{harmony_server}/v1/responses"
    body = {
        "model": "oss",
        "input": "A name and a flag, as JSON.",
        "max_output_tokens": 80,
        "temperature": 1.0,
        "seed": 1,
        "max_reasoning_tokens": 6,
        "text": {"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA}},
    }
    reply = httpx.post(url, json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    thought, message = reply.json()["output"]
    assert thought["type"] == "reasoning" and message["type"] == "message"
    text = message["content"][0]["text"]
    jsonschema.validate(json.loads(text), SCHEMA)
    events = _responses_events(url, body)
    streamed = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert streamed == text


def _forced(harmony_server: str, choice: Any, seed: int, **extra: Any) -> Any:
    import httpx

    tools = [
        {"type": "function", "function": {"name": "get_weather", "parameters": FORECAST}},
        {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
    ]
    body = {
        "model": "oss",
        "messages": [{"role": "user", "content": "Weather?"}],
        "tools": tools,
        "tool_choice": choice,
        "max_tokens": 120,
        "temperature": 1.0,
        "seed": seed,
        "max_reasoning_tokens": 6,
        "logprobs": True,
        **extra,
    }
    return httpx.post(f"{harmony_server}/v1/chat/completions", json=body, timeout=120)


# Bounded: a random-weight model writes strings until max_tokens where it may.
FORECAST = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
_SCHEMAS = {"get_weather": FORECAST, "get_time": TIME}
NAMED = {"type": "function", "function": {"name": "get_time"}}


@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_required_and_named_tool_choice_force_harmony_calls(harmony_server, choice):
    """Random weights at temperature 1, 3 seeds: every answer is a call of an allowed
    function whose arguments validate, written with harmony's marker tokens (one token
    each, as the logprobs' tokens show), after at most 6 free analysis tokens."""
    for seed in range(3):
        reply = _forced(harmony_server, choice, seed)
        assert reply.status_code == 200, reply.text
        choice_out = reply.json()["choices"][0]
        message = choice_out["message"]
        assert message["tool_calls"], message
        for call in message["tool_calls"]:
            name = call["function"]["name"]
            assert name == "get_time" if choice == NAMED else name in _SCHEMAS
            jsonschema.validate(json.loads(call["function"]["arguments"]), _SCHEMAS[name])
        assert choice_out["finish_reason"] == "tool_calls"
        tokens = [t["token"] for t in choice_out["logprobs"]["content"]]
        calls = len(message["tool_calls"])
        assert tokens.count("<|constrain|>") == tokens.count("<|call|>") == calls, tokens
        if tokens[-1] == "<|im_end|>":  # the tiny model's end of sequence
            tokens.pop()
        assert tokens[0] == "<|channel|>" and "<|" not in "".join(
            t for t in tokens if t not in OPENAI.markers
        )
        if "<|end|>" in tokens:  # an analysis message: at most 6 tokens in it
            assert tokens.index("<|end|>") - tokens.index("<|message|>") - 1 <= 6, tokens
        if choice == NAMED:
            assert calls == 1
        spent = reply.json()["usage"]["completion_tokens_details"]["reasoning_tokens"]
        headers = [i for i, t in enumerate(tokens) if t == "<|channel|>"]
        assert spent == (headers[1] if "<|end|>" in tokens else 0), tokens  # the analysis


def test_forced_harmony_calls_stream_as_deltas(harmony_server):
    """Streamed, the deltas add up to the call of the same request unstreamed."""
    import httpx

    whole = _forced(harmony_server, NAMED, 5).json()["choices"][0]["message"]
    body = {
        "model": "oss",
        "messages": [{"role": "user", "content": "Weather?"}],
        "tools": [{"type": "function", "function": {"name": "get_time", "parameters": TIME}}],
        "tool_choice": NAMED,
        "max_tokens": 120,
        "temperature": 1.0,
        "seed": 5,
        "max_reasoning_tokens": 6,
        "stream": True,
    }
    name, arguments, reasons = "", "", []
    url = f"{harmony_server}/v1/chat/completions"
    with httpx.stream("POST", url, json=body, timeout=120) as stream:
        for line in stream.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[len("data: ") :])["choices"]:
                reasons.append(c.get("finish_reason"))
                for call in c["delta"].get("tool_calls") or []:
                    name += call["function"].get("name") or ""
                    arguments += call["function"].get("arguments") or ""
    (call,) = whole["tool_calls"]
    assert name == "get_time" and json.loads(arguments) == json.loads(call["function"]["arguments"])
    jsonschema.validate(json.loads(arguments), TIME)
    assert "tool_calls" in reasons


def test_a_harmony_tool_schema_that_cannot_compile_is_a_400_naming_it(harmony_server):
    import httpx

    from baton.engine.server.config import ServerConfig

    bad = {"type": "object", "properties": {"x": {"type": "string", "pattern": "(?<=a)b"}}}
    tools = [
        {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
        {"type": "function", "function": {"name": "broken", "parameters": bad}},
    ]
    for choice in ("required", {"type": "function", "function": {"name": "broken"}}):
        body = {
            "model": "oss",
            "messages": [{"role": "user", "content": "Weather?"}],
            "tools": tools,
            "tool_choice": choice,
            "max_tokens": 4,
        }
        reply = httpx.post(f"{harmony_server}/v1/chat/completions", json=body, timeout=120)
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == "tools"
        assert "broken" in reply.json()["error"]["message"], reply.text
    body |= {"tool_choice": "auto", "tools": tools[:1]}
    assert httpx.post(f"{harmony_server}/v1/chat/completions", json=body, timeout=120).is_success
    with pytest.raises(ValueError, match="needs reasoning_parser 'openai_gptoss'"):
        ServerConfig(served_model_name="m", tool_call_parser="openai").resolved("llama", None)
    with pytest.raises(ValueError, match="qwen3_coder, openai"):
        ServerConfig(served_model_name="m", tool_call_parser="harmony")


def test_auto_tool_choice_gives_valid_calls_or_the_answer(harmony_server):
    """tool_choice auto, 3 seeds, with and without a response format: each answer is
    either calls whose arguments validate or the final channel's content (the response
    format's object where one is given), never a call with invalid arguments."""

    schema = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    called = 0
    for extra in ({}, {"response_format": schema}):
        for seed in range(3):
            reply = _forced(harmony_server, "auto", seed, **extra)
            assert reply.status_code == 200, reply.text
            out = reply.json()["choices"][0]
            calls = out["message"].get("tool_calls") or []
            called += bool(calls)
            for call in calls:
                name = call["function"]["name"]
                jsonschema.validate(json.loads(call["function"]["arguments"]), _SCHEMAS[name])
            if calls:
                assert out["finish_reason"] == "tool_calls"
            elif extra:
                jsonschema.validate(json.loads(out["message"]["content"]), SCHEMA)
            tokens = [t["token"] for t in out["logprobs"]["content"]]
            assert ("<|call|>" in tokens) is bool(calls), tokens
            if out["finish_reason"] == "stop" and not calls:  # the final message ended
                assert "<|return|>" in tokens, tokens
            if extra:  # a final answer is the object and ends: free text only runs on
                assert out["finish_reason"] != "length", out
    assert called  # random weights write a valid harmony call only where a grammar leads


def test_responses_force_harmony_calls(harmony_server):
    """/v1/responses with tool_choice required: function_call items whose arguments
    validate, the analysis a reasoning item before them."""
    import httpx

    body = {
        "model": "oss",
        "input": "Weather?",
        "tools": [{"type": "function", "name": "get_time", "parameters": TIME}],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_output_tokens": 120,
        "temperature": 1.0,
        "max_reasoning_tokens": 6,
    }
    for seed in range(2):
        reply = httpx.post(
            f"{harmony_server}/v1/responses", json=body | {"seed": seed}, timeout=120
        )
        assert reply.status_code == 200, reply.text
        items = reply.json()["output"]
        calls = [i for i in items if i["type"] == "function_call"]
        assert [c["name"] for c in calls] == ["get_time"], items
        jsonschema.validate(json.loads(calls[0]["arguments"]), TIME)
        assert {i["type"] for i in items} <= {"reasoning", "function_call"}, items


# --- gpt-oss without parser flags (model_parsers.resolve_parsers) ----------------------------


@pytest.fixture(scope="module")
def flagless_server(harmony_folder):  # noqa: F811
    """``baton serve`` on the tiny gpt-oss with no parser named, to the engine or the server;
    yields the base URL and the engine."""
    from serving import serve_in_thread

    from baton.engine.entrypoints.async_llm import AsyncLLM
    from baton.engine.server.app import build_app
    from baton.engine.server.config import ServerConfig

    engine = AsyncLLM.from_engine_args(
        str(harmony_folder), dtype="float32", max_num_seqs=4, max_model_len=768
    )
    config = ServerConfig(served_model_name="oss", chat_template=TEMPLATE)
    try:
        with serve_in_thread(build_app(engine, config)) as base:
            yield base, engine
    finally:
        engine.shutdown()


def test_gpt_oss_without_parser_flags_speaks_harmony(flagless_server):
    """No --reasoning-parser, no --tool-call-parser: the engine and the server report
    harmony's parsers; a structured answer's grammar holds after the analysis (content the
    validated object, reasoning_content the analysis, the budget of 6 kept) and a forced
    tool call comes back as tool_calls written with harmony's tokens."""
    import httpx

    base, engine = flagless_server
    for seed in range(2):
        body = _structured_chat(seed)
        reply = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        message = reply.json()["choices"][0]["message"]
        assert isinstance(message["reasoning_content"], str)
        jsonschema.validate(json.loads(message["content"]), SCHEMA)
        assert reply.json()["usage"]["completion_tokens_details"]["reasoning_tokens"] >= 4
        out = _forced(base, NAMED, seed).json()["choices"][0]
        (call,) = out["message"]["tool_calls"]
        assert call["function"]["name"] == "get_time" and out["finish_reason"] == "tool_calls"
        jsonschema.validate(json.loads(call["function"]["arguments"]), TIME)
        tokens = [t["token"] for t in out["logprobs"]["content"]]
        assert tokens.count("<|constrain|>") == tokens.count("<|call|>") == 1, tokens
    (card,) = httpx.get(f"{base}/v1/models", timeout=30).json()["data"]
    assert (card["reasoning_parser"], card["tool_call_parser"]) == ("openai_gptoss", "openai")
    assert engine.stats()["reasoning_parser"] == "openai_gptoss"


def test_a_parser_that_cannot_read_harmony_is_refused_at_startup(harmony_folder):  # noqa: F811
    """For gpt-oss, a reasoning or tool-call parser other than harmony's is one ValueError
    naming the model type and the parser that fits: from ``LLM`` (before the executor
    starts) and from ``baton serve`` (before the model is loaded)."""
    from baton.engine import LLM
    from baton.engine.cli.main import build_parser
    from baton.engine.server.serve import run_serve

    with pytest.raises(ValueError, match=r"model type gpt_oss.*'qwen3'.*'openai_gptoss'"):
        LLM(str(harmony_folder), dtype="float32", max_model_len=64, reasoning_parser="qwen3")
    for flags, named, fits in (
        (["--tool-call-parser", "hermes"], "hermes", "openai"),
        (["--reasoning-parser", "deepseek_r1"], "deepseek_r1", "openai_gptoss"),
        (
            ["--reasoning-parser", "openai_gptoss", "--tool-call-parser", "mistral"],
            "mistral",
            "openai",
        ),
    ):
        args = build_parser().parse_args(["serve", "--model", str(harmony_folder), *flags])
        with pytest.raises(ValueError, match=rf"model type gpt_oss.*'{named}'.*'{fits}'"):
            run_serve(args)


def test_other_models_get_no_parser_unless_named(folder):  # noqa: F811
    """Any other model gets what was named, nothing when nothing was; so does a gpt-oss-shaped
    model whose vocabulary lacks harmony's tokens (it cannot write harmony)."""
    from baton.engine.model_parsers import ModelParsers, resolve_parsers
    from baton.engine.server.config import ServerConfig

    assert resolve_parsers("llama", None) == ModelParsers(None, None)
    assert resolve_parsers("qwen3", None, "qwen3", "hermes") == ModelParsers("qwen3", "hermes")
    assert resolve_parsers("gpt_oss", load_tokenizer(folder)) == ModelParsers(None, None)
    plain = ServerConfig(served_model_name="m").resolved("llama", None)
    assert (plain.reasoning_parser, plain.tool_call_parser) == (None, None)
    with pytest.raises(ValueError, match="needs reasoning_parser"):
        ServerConfig(served_model_name="m", max_reasoning_tokens=4).resolved("llama", None)
    # gpt-oss takes the budget without naming its parser.
    oss = ServerConfig(served_model_name="m", max_reasoning_tokens=4).resolved("gpt_oss", None)
    assert (oss.reasoning_parser, oss.tool_call_parser) == ("openai_gptoss", "openai")
