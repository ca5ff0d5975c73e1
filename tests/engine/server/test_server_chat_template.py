"""A request's own ``chat_template`` and its ``reasoning_effort`` (chat completions,
``/tokenize``, ``/v1/responses``) on the default model, whose template reads no
``reasoning_effort``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from serving import DEFAULT_SERVED_MODEL as MODEL
from serving import serve_in_thread

from baton.engine.server.chat_plan import render_chat
from baton.engine.server.errors import APIError
from baton.engine.server.protocol import ChatCompletionRequest

MESSAGES = [{"role": "user", "content": "Name a colour."}]
MARKED = (
    "MARKER {% for m in messages %}<<{{ m.role }}>> {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<<assistant>> {% endif %}"
)
# Writes the effort it is given before the conversation.
EFFORT = "effort={{ reasoning_effort }}\n" + MARKED


@pytest.fixture(scope="module")
def trusting_server(default_model_engine: Any) -> Iterator[str]:
    """The default model served with ``--trust-request-chat-template``."""
    from baton.engine.server.app import build_app
    from baton.engine.server.config import ServerConfig

    config = ServerConfig(served_model_name=MODEL, trust_request_chat_template=True)
    with serve_in_thread(build_app(default_model_engine, config)) as base:
        yield base


def _chat(base: str, **fields: Any) -> httpx.Response:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1, **fields}
    return httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)


def _error(r: httpx.Response, param: str) -> str:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    return error["message"]


def test_a_server_refuses_request_templates_unless_it_trusts_them(
    default_model_server: str,
) -> None:
    """Off by default (as in vLLM): a template's loops may hold a CPU as long as they like."""
    for r in (
        _chat(default_model_server, chat_template=MARKED),
        httpx.post(
            f"{default_model_server}/tokenize",
            json={"messages": MESSAGES, "chat_template": MARKED},
        ),
    ):
        assert "--trust-request-chat-template" in _error(r, "chat_template")


def test_a_requests_chat_template_renders_the_prompt(trusting_server: str, tokenizer) -> None:
    """/tokenize and a chat completion render the conversation with the request's template,
    not the model's."""
    want = tokenizer.encode(
        "MARKER <<user>> Name a colour.\n<<assistant>> ", add_special_tokens=False
    )
    base = trusting_server
    r = httpx.post(f"{base}/tokenize", json={"messages": MESSAGES, "chat_template": MARKED})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == want
    plain = httpx.post(f"{base}/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    assert plain != want
    chat = _chat(base, chat_template=MARKED)
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == len(want)


@pytest.mark.parametrize(
    ("template", "word"),
    [
        ("{% for m in messages %}", "does not parse"),
        ("{{ messages[0].content | nosuchfilter }}", "nosuchfilter"),  # found when parsed
        ("{{ raise_exception('no thanks') }}", "no thanks"),  # the template refuses the chat
        ("{{ 1 // 0 }}", "ZeroDivisionError"),  # a Python error while rendering
    ],
)
def test_a_broken_request_template_is_a_400_naming_chat_template(
    trusting_server: str, template: str, word: str
) -> None:
    message = _error(_chat(trusting_server, chat_template=template), "chat_template")
    assert message.startswith("chat_template") and word in message, message
    r = httpx.post(
        f"{trusting_server}/tokenize", json={"messages": MESSAGES, "chat_template": template}
    )
    assert word in _error(r, "chat_template")
    # The server goes on serving.
    assert _chat(trusting_server).status_code == 200


def test_reasoning_effort_reaches_a_template_that_reads_it(tokenizer) -> None:
    def rendered(**fields: Any) -> str:
        body = ChatCompletionRequest(messages=MESSAGES, chat_template=EFFORT, **fields)
        return tokenizer.decode(render_chat(tokenizer, body))

    assert rendered(reasoning_effort="high").startswith("effort=high\nMARKER <<user>>")
    assert rendered(reasoning_effort="low").startswith("effort=low\n")
    assert rendered().startswith("effort=\n")
    # chat_template_kwargs may say the same, not something else.
    same = {"reasoning_effort": "low"}
    assert rendered(reasoning_effort="low", chat_template_kwargs=same).startswith("effort=low")
    with pytest.raises(APIError) as caught:
        rendered(reasoning_effort="high", chat_template_kwargs=same)
    assert caught.value.param == "reasoning_effort"


def test_reasoning_effort_over_http(trusting_server: str) -> None:
    """The effort changes the prompt a reading template renders; the model's template reads
    none, so an effort is refused (not dropped), except "none", which asks for nothing."""
    base = trusting_server
    counts = {}
    for effort in ("low", "medium"):
        r = _chat(base, chat_template=EFFORT, reasoning_effort=effort)
        assert r.status_code == 200, r.text
        counts[effort] = r.json()["usage"]["prompt_tokens"]
    without = _chat(base, chat_template=EFFORT)
    assert without.json()["usage"]["prompt_tokens"] < min(counts.values())
    message = _error(_chat(base, reasoning_effort="high"), "reasoning_effort")
    assert "does not read reasoning_effort" in message
    message = _error(_chat(base, reasoning_effort="extreme"), "reasoning_effort")
    assert "extreme" in message and "one of" in message
    _error(_chat(base, chat_template=MARKED, reasoning_effort="high"), "reasoning_effort")
    assert _chat(base, reasoning_effort="none").status_code == 200


@pytest.mark.parametrize(
    ("effort", "word"), [("high", "does not read reasoning_effort"), ("extreme", "one of")]
)
def test_responses_reasoning_effort_is_refused_where_the_template_reads_none(
    default_model_server: str, effort: str, word: str
) -> None:
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 1, "reasoning": {"effort": effort}}
    r = httpx.post(f"{default_model_server}/v1/responses", json=body, timeout=60)
    assert word in _error(r, "reasoning.effort")


def test_responses_reasoning_effort_none_is_accepted_and_echoed(default_model_server: str) -> None:
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 1, "reasoning": {"effort": "none"}}
    r = httpx.post(f"{default_model_server}/v1/responses", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["reasoning"]["effort"] == "none"
