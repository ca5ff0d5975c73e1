"""The small API gaps of issue 55 against ``baton serve`` on the default model: ``logit_bias``
(greedy follows a +100 bias and leaves a -100 one, the grammar still holds over a bias, a
request's tokens do not depend on its batch, bad maps are 400s naming the field) and the
server-wide reasoning budget (``baton serve --max-reasoning-tokens``; its end-to-end test is in
test_reasoning.py, beside the thinking model); plus the pure parsing and checks behind them."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import pytest
from serving import DEFAULT_SERVED_MODEL as MODEL

from baton.engine.cli.main import build_parser
from baton.engine.sampling_params import SamplingParams
from baton.engine.server.config import ServerConfig
from baton.engine.server.errors import APIError
from baton.engine.server.params import (
    chat_sampling_params,
    completion_sampling_params,
    parse_logit_bias,
)
from baton.engine.server.protocol import ChatCompletionRequest, CompletionRequest
from baton.engine.server.serve import run_serve

PROMPT = "The three primary colours are"
FILM = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 12},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
    },
    "required": ["title", "year"],
    "additionalProperties": False,
}


def _complete(base: str, **body: Any) -> dict[str, Any]:
    reply = httpx.post(
        f"{base}/v1/completions",
        json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0} | body,
        timeout=120,
    )
    assert reply.status_code == 200, reply.text
    return reply.json()


def _ids(base: str, text: str) -> list[int]:
    reply = httpx.post(
        f"{base}/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=60
    )
    assert reply.status_code == 200, reply.text
    return reply.json()["tokens"]


def _text(base: str, ids: list[int]) -> str:
    reply = httpx.post(f"{base}/detokenize", json={"tokens": ids}, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()["prompt"]


# ---------------------------------------------------------------- pure checks


def test_sampling_params_keep_logit_bias_as_sorted_pairs() -> None:
    assert SamplingParams(logit_bias={10: 1, 9: -100.0}).logit_bias == ((9, -100.0), (10, 1))
    assert SamplingParams(logit_bias=None).logit_bias == ()


@pytest.mark.parametrize(
    ("bias", "words"),
    [
        ({"a": 1}, "token ids"),
        ({-1: 1}, "token ids"),
        ({True: 1}, "token ids"),
        ({1: 100.5}, "[-100, 100]"),
        ({1: float("inf")}, "[-100, 100]"),
        ({1: "5"}, "[-100, 100]"),
        ([(1, 2.0), (1, 3.0)], "once"),
        (5, "mapping"),
    ],
)
def test_sampling_params_refuse_a_bad_logit_bias(bias: Any, words: str) -> None:
    with pytest.raises(ValueError, match=r"^logit_bias") as info:
        SamplingParams(logit_bias=bias)
    assert words in str(info.value)


def test_parse_logit_bias_reads_decimal_keys_only() -> None:
    assert parse_logit_bias({"12": 5, "0": -1.5}) == {12: 5, 0: -1.5}
    for key in ("1.0", "-3", " 7", "x", "٣", "1" * 40):
        with pytest.raises(APIError) as info:
            parse_logit_bias({key: 1})
        assert info.value.status == 400 and info.value.param == "logit_bias"


# ------------------------------------------------------------- against the server


def test_a_plus_100_bias_makes_greedy_take_the_token(default_model_server: str) -> None:
    base = default_model_server
    (banana,) = _ids(base, " banana")[-1:]
    text = _complete(base, logit_bias={str(banana): 100})["choices"][0]["text"]
    assert text == _text(base, [banana] * 4)
    # The logprobs are those of the biased logits (as they are of the grammar-masked ones).
    choice = _complete(base, logit_bias={str(banana): 100}, logprobs=1)["choices"][0]
    assert choice["text"] == text
    assert all(lp > -0.01 for lp in choice["logprobs"]["token_logprobs"]), choice["logprobs"]
    chat = httpx.post(
        f"{base}/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "Say hi."}],
            "max_tokens": 3,
            "temperature": 0,
            "logit_bias": {str(banana): 100},
        },
        timeout=120,
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["content"] == _text(base, [banana] * 3)


def test_a_minus_100_bias_moves_greedy_off_its_token(default_model_server: str) -> None:
    base = default_model_server
    first = _complete(base, max_tokens=1)["choices"][0]["text"]
    ids = _ids(base, first)
    assert _text(base, ids) == first and len(ids) == 1
    other = _complete(base, max_tokens=1, logit_bias={str(ids[0]): -100})["choices"][0]["text"]
    assert other != first


def test_the_grammar_still_holds_over_a_bias(default_model_server: str) -> None:
    """A +100 bias on tokens the schema forbids at most places: every answer still validates."""
    base = default_model_server
    biased = {str(t): 100 for t in _ids(base, " banana!") + _ids(base, "}")}
    for seed in range(3):
        reply = _complete(
            base,
            prompt='A film as JSON: {"title": "Alien", "year": 1979}\n',
            max_tokens=40,
            temperature=1.0,
            seed=seed,
            logit_bias=biased,
            response_format={"type": "json_schema", "json_schema": {"schema": FILM}},
        )
        jsonschema.validate(json.loads(reply["choices"][0]["text"]), FILM)


def test_a_biased_request_gets_the_same_tokens_alone_and_in_a_batch(
    default_model_server: str,
) -> None:
    base = default_model_server
    bias = {str(t): 8 for t in _ids(base, " red green blue yellow")}
    biased = {"max_tokens": 12, "temperature": 0.9, "seed": 7, "logit_bias": bias}
    plain = {"max_tokens": 12, "temperature": 0.9, "seed": 7}
    alone = _complete(base, **biased)["choices"][0]["text"]
    alone_plain = _complete(base, **plain)["choices"][0]["text"]
    assert alone != alone_plain  # the bias changes the answer
    bodies = [biased, plain, plain | {"prompt": "Once upon a time"}, biased]
    with ThreadPoolExecutor(len(bodies)) as pool:
        texts = [r["choices"][0]["text"] for r in pool.map(lambda b: _complete(base, **b), bodies)]
    assert texts[0] == texts[3] == alone
    assert texts[1] == alone_plain


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(
    ("bias", "words"),
    [
        ({"banana": 1}, "token ids"),
        ({"1": 101}, "[-100, 100]"),
        ({"1": "high"}, "[-100, 100]"),
        ({"99999999": 1}, "vocab size"),
        ([1, 2], "dict"),
    ],
)
def test_a_bad_logit_bias_is_a_400_naming_it(
    default_model_server: str, path: str, bias: Any, words: str
) -> None:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 1, "logit_bias": bias}
    if path == "/v1/completions":
        body["prompt"] = PROMPT
    else:
        body["messages"] = [{"role": "user", "content": "Hi"}]
    reply = httpx.post(f"{default_model_server}{path}", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "logit_bias" and words in error["message"], error


def test_an_empty_logit_bias_changes_nothing(default_model_server: str) -> None:
    base = default_model_server
    text = _complete(base)["choices"][0]["text"]
    assert _complete(base, logit_bias={})["choices"][0]["text"] == text


# ------------------------------------------------- the server's default reasoning budget


def _chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}], **fields)


def test_the_servers_default_budget_fills_structured_requests_only() -> None:
    config = ServerConfig(served_model_name="m", reasoning_parser="qwen3", max_reasoning_tokens=5)
    structured = {"response_format": {"type": "json_schema", "json_schema": {"schema": FILM}}}
    params, _ = chat_sampling_params(_chat(**structured), config)
    assert params.max_reasoning_tokens == 5
    params, _ = chat_sampling_params(_chat(**structured, max_reasoning_tokens=9), config)
    assert params.max_reasoning_tokens == 9
    # The engine refuses a budget without a constraint: a free request gets none.
    assert chat_sampling_params(_chat(), config)[0].max_reasoning_tokens is None
    completion = CompletionRequest(prompt="x", structured_outputs={"regex": "[a-z]+"})
    assert completion_sampling_params(completion, config)[0].max_reasoning_tokens == 5
    plain = ServerConfig(served_model_name="m", reasoning_parser="qwen3")
    assert chat_sampling_params(_chat(**structured), plain)[0].max_reasoning_tokens is None


def test_max_reasoning_tokens_flag_reaches_the_server_config() -> None:
    args = build_parser().parse_args(["serve", "--max-reasoning-tokens", "5"])
    assert args.max_reasoning_tokens == 5
    # Refused before any model is loaded: a budget needs a reasoning parser.
    with pytest.raises(ValueError, match="needs reasoning_parser"):
        run_serve(args)
    for bad in (-1, True, 2.5):
        with pytest.raises(ValueError, match="max_reasoning_tokens must be"):
            ServerConfig(served_model_name="m", reasoning_parser="qwen3", max_reasoning_tokens=bad)
