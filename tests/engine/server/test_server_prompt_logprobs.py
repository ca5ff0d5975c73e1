"""``prompt_logprobs`` over HTTP (issue 55) on the default model's server: ``echo`` with
``logprobs`` on ``/v1/completions`` gives OpenAI's lists with the prompt's tokens first (the
first one null), streamed too, and vLLM's ``prompt_logprobs`` field answers on completions
(per choice) and chat (beside the choices) in vLLM's shape. Their values against a reference
are checked in test_prompt_logprobs.py; bad values are 400s in test_server_fields.py."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import pytest
from serving import DEFAULT_SERVED_MODEL as MODEL

PROMPT_B = "Once upon a time, in a land far away,"


def test_responses_refuse_prompt_logprobs_naming_it() -> None:
    from baton.engine.server.errors import APIError
    from baton.engine.server.fields import check_extra_fields
    from baton.engine.server.protocol import ResponsesRequest

    body = ResponsesRequest.model_validate({"input": "hi", "prompt_logprobs": 1})
    with pytest.raises(APIError, match="not supported on /v1/responses") as err:
        check_extra_fields(body)
    assert err.value.param == "prompt_logprobs"


_NUMBER_OR_NULL = {"type": ["number", "null"]}
COMPLETION_LOGPROBS = {
    "type": "object",
    "required": ["tokens", "token_logprobs", "top_logprobs", "text_offset"],
    "properties": {
        "tokens": {"type": "array", "items": {"type": "string"}},
        "token_logprobs": {"type": "array", "items": _NUMBER_OR_NULL},
        "top_logprobs": {
            "type": "array",
            "items": {"type": ["object", "null"], "additionalProperties": {"type": "number"}},
        },
        "text_offset": {"type": "array", "items": {"type": "integer"}},
    },
}
PROMPT_LOGPROBS = {
    "type": "array",
    "prefixItems": [{"type": "null"}],
    "items": {
        "type": "object",
        "minProperties": 1,
        "propertyNames": {"pattern": "^[0-9]+$"},
        "additionalProperties": {
            "type": "object",
            "required": ["logprob", "rank", "decoded_token"],
            "properties": {
                "logprob": {"type": "number", "maximum": 0},
                "rank": {"type": "integer", "minimum": 1},
                "decoded_token": {"type": "string"},
            },
            "additionalProperties": False,
        },
    },
}


def _post(base: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    reply = httpx.post(f"{base}{path}", json={"model": MODEL, **body}, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _prompt_ids(base: str, text: str) -> list[int]:
    reply = httpx.post(f"{base}/tokenize", json={"prompt": text}, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()["tokens"]


def test_echo_with_logprobs_puts_the_prompts_logprobs_first(default_model_server: str) -> None:
    base = default_model_server
    body = {"prompt": PROMPT_B, "max_tokens": 3, "temperature": 0, "logprobs": 2}
    plain = _post(base, "/v1/completions", body)["choices"][0]
    echoed = _post(base, "/v1/completions", body | {"echo": True})["choices"][0]
    lp = echoed["logprobs"]
    jsonschema.validate(lp, COMPLETION_LOGPROBS)
    jsonschema.validate(echoed["prompt_logprobs"], PROMPT_LOGPROBS)
    n = len(_prompt_ids(base, PROMPT_B))
    assert len(lp["tokens"]) == n + 3 and len(echoed["prompt_logprobs"]) == n
    # The first prompt token has no logprob; the others have theirs and the top 2.
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(v, float) for v in lp["token_logprobs"][1:])
    assert all(1 <= len(t) <= 2 for t in lp["top_logprobs"][1:])
    # Then the output's, as without echo (offsets past the prompt's tokens).
    for key in ("tokens", "token_logprobs", "top_logprobs"):
        assert lp[key][n:] == plain["logprobs"][key], key
    prompt_text = sum(len(t) for t in lp["tokens"][:n])
    assert lp["text_offset"][n:] == [prompt_text + o for o in plain["logprobs"]["text_offset"]]
    assert echoed["text"] == PROMPT_B + plain["text"]
    # vLLM's prompt_logprobs: each prompt token's entry holds the token's logprob.
    ids = _prompt_ids(base, PROMPT_B)
    for pos in range(1, n):
        entry = echoed["prompt_logprobs"][pos][str(ids[pos])]
        assert entry["logprob"] == pytest.approx(lp["token_logprobs"][pos], abs=1e-6)


def test_echo_with_logprobs_streams_the_prompts_logprobs_first(default_model_server: str) -> None:
    body = {
        "model": MODEL,
        "prompt": PROMPT_B,
        "max_tokens": 3,
        "temperature": 0,
        "logprobs": 1,
        "echo": True,
    }
    unary = _post(default_model_server, "/v1/completions", body)["choices"][0]["logprobs"]
    with httpx.stream(
        "POST", f"{default_model_server}/v1/completions", json=body | {"stream": True}, timeout=120
    ) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e)["choices"][0]["logprobs"] for e in events[:-1]]
    for c in chunks:
        jsonschema.validate(c, COMPLETION_LOGPROBS)
    for key in ("tokens", "token_logprobs", "top_logprobs"):
        assert [v for c in chunks for v in c[key]] == unary[key], key


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_the_prompt_logprobs_field_answers_as_vllm(default_model_server: str, path: str) -> None:
    body: dict[str, Any] = {"max_tokens": 2, "temperature": 0, "prompt_logprobs": 1}
    if path == "/v1/completions":
        reply = _post(default_model_server, path, body | {"prompt": PROMPT_B})
        plp = reply["choices"][0]["prompt_logprobs"]
        assert reply["choices"][0]["logprobs"] is None
    else:
        messages = [{"role": "user", "content": PROMPT_B}]
        reply = _post(default_model_server, path, body | {"messages": messages})
        plp = reply["prompt_logprobs"]
    jsonschema.validate(plp, PROMPT_LOGPROBS)
    assert len(plp) == reply["usage"]["prompt_tokens"]
    for entry in plp[1:]:
        # The prompt token, and the top 1 when that is another token.
        assert 1 <= len(entry) <= 2 and min(v["rank"] for v in entry.values()) == 1
