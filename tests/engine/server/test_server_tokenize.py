"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's shapes) on the default model."""

from __future__ import annotations

import httpx
import pytest
from serving import DEFAULT_SERVED_MODEL as MODEL

MESSAGES = [{"role": "user", "content": "Name a colour."}]


def test_tokenize_a_prompt_and_detokenize_it_back(default_model_server: str, tokenizer) -> None:
    text = "Hello there, 東京 🙂"
    r = httpx.post(f"{default_model_server}/tokenize", json={"model": MODEL, "prompt": text})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tokenizer.encode(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 2048 and body["token_strs"] is None
    strs = httpx.post(
        f"{default_model_server}/tokenize", json={"prompt": text, "return_token_strs": True}
    ).json()["token_strs"]
    assert strs == tokenizer.convert_ids_to_tokens(body["tokens"])
    back = httpx.post(f"{default_model_server}/detokenize", json={"tokens": body["tokens"]})
    assert back.status_code == 200 and back.json()["prompt"].endswith(text)


def test_tokenize_messages_as_the_chat_endpoint_renders_them(default_model_server: str) -> None:
    """The conversation's ids are those a chat completion of it counts as its prompt."""
    r = httpx.post(f"{default_model_server}/tokenize", json={"messages": MESSAGES})
    assert r.status_code == 200, r.text
    chat = httpx.post(
        f"{default_model_server}/v1/chat/completions",
        json={"model": MODEL, "messages": MESSAGES, "max_tokens": 1},
        timeout=60,
    )
    assert chat.json()["usage"]["prompt_tokens"] == r.json()["count"]


@pytest.mark.parametrize(
    "path,body,status,word",
    [
        ("/tokenize", {}, 400, "exactly one of prompt and messages"),
        ("/tokenize", {"prompt": "a", "messages": MESSAGES}, 400, "exactly one"),
        ("/tokenize", {"prompt": "a", "model": "other"}, 404, "other"),
        ("/tokenize", {"prompt": "a", "frob": 1}, 400, "frob"),
        ("/detokenize", {"tokens": [1, 10**9]}, 400, "not ids of the vocabulary"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ],
)
def test_bad_tokenize_requests_are_clear_errors(
    default_model_server: str, path: str, body: dict, status: int, word: str
) -> None:
    r = httpx.post(f"{default_model_server}{path}", json=body)
    assert r.status_code == status and word in r.text, r.text


def test_the_server_chat_template_replaces_the_models(tokenizer, tmp_path) -> None:
    """``baton serve --chat-template FILE``: conversations render with that template (the
    tokenize endpoint shows it); a template file that does not parse is refused at startup."""
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    from baton.engine.server.app import build_app
    from baton.engine.server.config import ServerConfig
    from baton.engine.server.serve import chat_template_text

    template = tmp_path / "t.jinja"
    template.write_text(
        "{% for m in messages %}<<{{ m.role }}>> {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}<<assistant>> {% endif %}"
    )
    text = chat_template_text(str(template))
    engine = SimpleNamespace(
        get_tokenizer=lambda: tokenizer, model_architecture=lambda: "llama", max_model_len=64
    )
    config = ServerConfig(served_model_name=MODEL, chat_template=text)
    with TestClient(build_app(engine, config)) as client:  # type: ignore[arg-type]
        r = client.post("/tokenize", json={"messages": MESSAGES})
    assert r.status_code == 200, r.text
    want = tokenizer.encode("<<user>> Name a colour.\n<<assistant>> ", add_special_tokens=False)
    assert r.json()["tokens"] == want
    assert chat_template_text("{{ messages }}") == "{{ messages }}"
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match="not a valid Jinja template"):
        chat_template_text(str(broken))
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        chat_template_text(str(tmp_path / "missing.jinja"))
