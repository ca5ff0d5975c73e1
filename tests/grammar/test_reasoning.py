"""Reasoning before a structured answer (``EngineConfig.reasoning_parser``): the grammar holds
from the token after ``</think>``, never over the thoughts; ``max_reasoning_tokens`` forces the
end of thoughts, so a random-weight model's answer is a valid object every time."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from model_files import build_tiny_model_dir

from baton.engine import LLM, SamplingParams
from baton.grammar.backend import GrammarMatcher, allocate_bitmask
from baton.grammar.reasoning import ReasoningMatcher, ReasoningSpec
from baton.grammar.spec import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory, tokenizer) -> Path:
    """The tiny Llama with <think> and </think> added as special tokens (the last ids) and
    its embedding grown to cover them."""
    from safetensors.torch import load_file, save_file
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as Backend

    folder = build_tiny_model_dir(tmp_path_factory.mktemp("think"), tokenizer, "llama")
    backend = Backend.from_file(str(folder / "tokenizer.json"))
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in ("<think>", "</think>")]
    )
    backend.save(str(folder / "tokenizer.json"))
    vocab = backend.get_vocab_size()
    tensors = load_file(str(folder / "model.safetensors"))
    embed = tensors["model.embed_tokens.weight"]
    extra = 0.1 * torch.randn(vocab - embed.shape[0], embed.shape[1])
    tensors["model.embed_tokens.weight"] = torch.cat([embed, extra])
    save_file(tensors, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": vocab}))
    return folder


def _answer(llm: LLM, prompt: str, seed: int, budget: int | None) -> tuple[list[int], Any]:
    """(token ids, the object after </think>) of one JSON request with ``budget``."""
    spec = StructuredOutputsParams(json=SCHEMA)
    params = SamplingParams(
        max_tokens=120,
        temperature=1.0,
        seed=seed,
        structured_outputs=spec,
        max_reasoning_tokens=budget,
    )
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    ids = list(out.outputs[0].token_ids)
    return ids, out.outputs[0]


def test_a_budget_of_16_ends_with_a_valid_object_for_every_seed(thinking_model):
    """50 seeds at temperature 1 on random weights: the thoughts take at most 16 tokens, then
    </think> (forced where the model did not write it), then an object that validates."""
    llm = LLM(str(thinking_model), dtype="float32", max_model_len=256, reasoning_parser="qwen3")
    try:
        end = llm.get_tokenizer().encode("</think>", add_special_tokens=False)[0]
        thought_lengths = []
        for seed in range(50):
            ids, completion = _answer(llm, "Think, then answer in JSON:", seed, 16)
            # Everything a failure needs to be understood.
            seen = (seed, completion.finish_reason, completion.stop_reason, ids)
            assert end in ids, seen
            cut = ids.index(end)
            assert cut <= 16, seen
            thought_lengths.append(cut)
            answer = llm.get_tokenizer().decode(ids[cut + 1 :])
            assert completion.finish_reason == "stop", (*seen, answer)
            jsonschema.validate(json.loads(answer), SCHEMA)
    finally:
        llm.shutdown()
    # Random weights think freely: most runs spend the budget, and thoughts are not JSON.
    assert max(thought_lengths) == 16 and sum(thought_lengths) > 0


def test_a_prompt_that_closed_its_thoughts_is_constrained_from_the_first_token(
    thinking_model,
):
    """Thinking switched off by the chat template (``<think></think>`` in the prompt): the
    grammar holds from the first generated token."""
    llm = LLM(str(thinking_model), dtype="float32", max_model_len=256, reasoning_parser="qwen3")
    try:
        for seed in range(5):
            ids, completion = _answer(llm, "Answer:<think>\n\n</think>\n\n", seed, None)
            jsonschema.validate(json.loads(completion.text), SCHEMA)
    finally:
        llm.shutdown()


def test_bad_reasoning_settings_are_clear_errors(thinking_model, tiny_model_dir):
    with pytest.raises(ValueError, match="reasoning_parser 'nope' is not supported"):
        LLM(str(thinking_model), reasoning_parser="nope")
    with pytest.raises(ValueError, match="needs '<think>' as one token"):
        LLM(str(tiny_model_dir), dtype="float32", max_model_len=64, reasoning_parser="qwen3")
    with pytest.raises(ValueError, match="max_reasoning_tokens must be None or an int >= 0"):
        SamplingParams(max_reasoning_tokens=-1)
    llm = LLM(str(thinking_model), dtype="float32", max_model_len=256)
    try:
        spec = StructuredOutputsParams(json=SCHEMA)
        with pytest.raises(ValueError, match="needs a reasoning model"):
            llm.generate(["x"], SamplingParams(structured_outputs=spec, max_reasoning_tokens=4))
    finally:
        llm.shutdown()
    llm = LLM(str(thinking_model), dtype="float32", max_model_len=256, reasoning_parser="qwen3")
    try:
        with pytest.raises(ValueError, match="has no structured_outputs"):
            llm.generate(["x"], SamplingParams(max_reasoning_tokens=4))
    finally:
        llm.shutdown()


class _Digits(GrammarMatcher):
    """A grammar of digits (ids 0-9) ending with EOS (id 11): a stand-in inner matcher."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def accept_tokens(self, tokens):
        for t in tokens:
            if self.is_terminated() or not (t < 10 or (t == 11 and self.seen)):
                return False
            self.seen.append(t)
        return True

    def validate_tokens(self, tokens):
        n = 0
        for t in tokens:
            if not self.accept_tokens([t]):
                break
            n += 1
        self.rollback(n)
        return n

    def rollback(self, num_tokens):
        del self.seen[len(self.seen) - num_tokens :]

    def fill_bitmask(self, bitmask, row):
        bitmask[row].zero_()
        bitmask[row, 0] = 0x3FF | ((1 << 11) if self.seen else 0)

    def is_terminated(self):
        return bool(self.seen) and self.seen[-1] == 11

    def reset(self):
        self.seen.clear()

    def jump_forward_string(self):
        return ""


def test_reasoning_matcher_switches_rolls_back_and_spends_its_budget():
    """Vocabulary of 40: </think> is 30, EOS 11. Thoughts allow all but EOS; 30 hands over
    to the digits; a rollback across the switch goes back to thinking; the budget leaves only
    30."""
    spec = ReasoningSpec(end_token_id=30, thinking=True, max_tokens=3, banned=(11,))
    m = ReasoningMatcher(_Digits(), spec, vocab_size=40)
    bitmask = allocate_bitmask(1, 40)
    m.fill_bitmask(bitmask, 0)
    allowed = [t for t in range(40) if (int(bitmask[0, t // 32]) >> (t % 32)) & 1]
    assert allowed == [t for t in range(40) if t != 11]
    assert not m.accept_tokens([11])  # no end of sequence while thinking
    assert m.accept_tokens([20, 21, 22])
    assert m.budget_spent and not m.accept_tokens([23])  # only </think> now
    m.fill_bitmask(bitmask, 0)
    assert bitmask[0].tolist() == [1 << 30, 0]
    assert m.validate_tokens([30, 5, 6, 39]) == 3  # 39 is no digit
    assert m.thinking and m.num_thinking_tokens == 3  # validate changed nothing
    assert m.accept_tokens([30, 5, 6]) and not m.thinking and m.inner.seen == [5, 6]
    m.rollback(3)  # 6, 5 and </think>
    assert m.thinking and m.inner.seen == [] and m.num_thinking_tokens == 3
    m.rollback(1)
    assert m.num_thinking_tokens == 2 and not m.budget_spent
    assert m.accept_tokens([24, 30, 7, 11]) and m.is_terminated()
    m.reset()
    assert m.thinking and m.num_thinking_tokens == 0 and not m.inner.seen


@pytest.fixture(scope="module")
def reasoning_engine(thinking_model):
    """An ``AsyncLLM`` on the thinking model with the qwen3 reasoning parser."""
    from baton.engine.entrypoints.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(
        str(thinking_model),
        dtype="float32",
        max_num_seqs=4,
        max_model_len=256,
        reasoning_parser="qwen3",
    )
    try:
        yield engine
    finally:
        engine.shutdown()


def _serve(engine, **settings):
    from serving import serve_in_thread

    from baton.engine.server.app import build_app
    from baton.engine.server.config import ServerConfig

    config = ServerConfig(served_model_name="thinker", reasoning_parser="qwen3", **settings)
    return serve_in_thread(build_app(engine, config))


@pytest.fixture(scope="module")
def reasoning_server(reasoning_engine):
    """``baton serve --reasoning-parser qwen3``'s app on the thinking model."""
    with _serve(reasoning_engine) as base:
        yield base


def _chat_body(seed: int) -> dict[str, Any]:
    """A JSON-schema chat request with 8 reasoning tokens at most, sampled with ``seed``."""
    return {
        "model": "thinker",
        "messages": [{"role": "user", "content": "A name and a flag, as JSON."}],
        "max_tokens": 100,
        "temperature": 1.0,
        "seed": seed,
        "max_reasoning_tokens": 8,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": SCHEMA},
        },
    }


def test_the_server_returns_the_thoughts_as_reasoning_content(reasoning_server):
    """message.reasoning_content holds the thoughts (at most 8 tokens, then </think>), content
    the validated object; usage counts the reasoning tokens; streamed, the deltas add up to
    the same message."""
    import httpx

    for seed in range(5):
        url = f"{reasoning_server}/v1/chat/completions"
        reply = httpx.post(url, json=_chat_body(seed), timeout=120)
        assert reply.status_code == 200, reply.text
        message = reply.json()["choices"][0]["message"]
        assert isinstance(message["reasoning_content"], str)
        assert message["reasoning"] == message["reasoning_content"]
        jsonschema.validate(json.loads(message["content"]), SCHEMA)
        spent = reply.json()["usage"]["completion_tokens_details"]["reasoning_tokens"]
        assert 1 <= spent <= 9
        body = {"stream": True, "stream_options": {"include_usage": True}}
        parts = {"reasoning_content": "", "content": ""}
        usage = None
        with httpx.stream("POST", url, json=_chat_body(seed) | body, timeout=120) as stream:
            for line in stream.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                usage = chunk.get("usage") or usage
                for choice in chunk["choices"]:
                    for key in parts:
                        parts[key] += choice["delta"].get(key) or ""
        assert parts == {
            "reasoning_content": message["reasoning_content"],
            "content": message["content"],
        }
        assert usage["completion_tokens_details"]["reasoning_tokens"] == spent


TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "parameters": SCHEMA,
    },
}


def _streamed_message(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """A streamed chat choice's deltas added up: reasoning_content, content, and each tool
    call's name and arguments."""
    import httpx

    parts: dict[str, Any] = {"reasoning_content": "", "content": "", "tool_calls": {}}
    with httpx.stream("POST", url, json=body | {"stream": True}, timeout=120) as stream:
        for line in stream.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[len("data: ") :])["choices"]:
                delta = choice["delta"]
                for key in ("reasoning_content", "content"):
                    parts[key] += delta.get(key) or ""
                for call in delta.get("tool_calls") or []:
                    got = parts["tool_calls"].setdefault(call["index"], ["", ""])
                    got[0] += call["function"].get("name") or ""
                    got[1] += call["function"].get("arguments") or ""
    return parts


def test_streamed_tool_calls_keep_the_thoughts_apart(reasoning_server):
    """With both the reasoning parser and tools, a streamed chat sends the thoughts as
    reasoning_content deltas and reads the tool calls out of the text after them only: the
    deltas add up to the non-streamed message (thoughts, no content, the same calls)."""
    import httpx

    url = f"{reasoning_server}/v1/chat/completions"
    for seed in range(3):
        body = _chat_body(seed)
        del body["response_format"]
        body |= {"tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False}
        reply = httpx.post(url, json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        message = reply.json()["choices"][0]["message"]
        assert message["reasoning_content"] and not message["content"]
        (call,) = message["tool_calls"]
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMA)
        streamed = _streamed_message(url, body)
        assert streamed == {
            "reasoning_content": message["reasoning_content"],
            "content": "",
            "tool_calls": {0: [call["function"]["name"], call["function"]["arguments"]]},
        }


def _responses_events(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    import httpx

    events = []
    with httpx.stream("POST", url, json=body | {"stream": True}, timeout=120) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: ") :]))
    return events


def _responses_body(seed: int) -> dict[str, Any]:
    """``_chat_body(seed)`` as a /v1/responses request (a JSON-schema text format)."""
    return {
        "model": "thinker",
        "input": _chat_body(seed)["messages"][0]["content"],
        "max_output_tokens": 100,
        "temperature": 1.0,
        "seed": seed,
        "max_reasoning_tokens": 8,
        "text": {"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA}},
    }


def test_responses_carry_the_thoughts_as_a_reasoning_item(reasoning_server):
    """/v1/responses: a reasoning item with the thoughts before the message with the
    validated object, reasoning tokens in usage; streamed, the reasoning and text deltas add
    up to the same items, the reasoning item done before the message begins."""
    import httpx

    url = f"{reasoning_server}/v1/responses"
    for seed in range(3):
        body = _responses_body(seed)
        reply = httpx.post(url, json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        response = reply.json()
        thought, message = response["output"]
        assert thought["type"] == "reasoning" and thought["id"].startswith("rs_")
        assert message["type"] == "message"
        text = message["content"][0]["text"]
        jsonschema.validate(json.loads(text), SCHEMA)
        assert 1 <= response["usage"]["output_tokens_details"]["reasoning_tokens"] <= 9
        events = _responses_events(url, body)
        kinds = [e["type"] for e in events]
        deltas = {
            kind: "".join(e["delta"] for e in events if e["type"] == kind)
            for kind in ("response.reasoning_text.delta", "response.output_text.delta")
        }
        assert deltas == {
            "response.reasoning_text.delta": thought["content"][0]["text"],
            "response.output_text.delta": text,
        }
        first_done = kinds.index("response.output_item.done")
        assert first_done < kinds.index("response.content_part.added")
        assert kinds[-1] == "response.completed"
        assert [i["type"] for i in events[-1]["response"]["output"]] == ["reasoning", "message"]


def test_the_servers_default_budget_bounds_requests_that_give_none(reasoning_engine):
    """``baton serve --max-reasoning-tokens 2``: a structured request without its own budget
    thinks at most 2 tokens (then </think>) and answers a valid object, one with its own keeps
    it; the same requests on a server without the default think longer (random weights think
    freely)."""
    import httpx

    def spent(base: str, seed: int, answers: bool, **extra: Any) -> int:
        body = {k: v for k, v in _chat_body(seed).items() if k != "max_reasoning_tokens"}
        reply = httpx.post(f"{base}/v1/chat/completions", json=body | extra, timeout=120)
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        if answers:
            assert choice["finish_reason"] == "stop", choice
            jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
        return reply.json()["usage"]["completion_tokens_details"]["reasoning_tokens"]

    seeds = range(4)
    with _serve(reasoning_engine, max_reasoning_tokens=2) as base:
        assert all(spent(base, seed, True) <= 3 for seed in seeds)
        assert max(spent(base, seed, True, max_reasoning_tokens=12) for seed in seeds) > 3
    with _serve(reasoning_engine) as base:
        # Unbounded thoughts may run out of tokens before any answer.
        assert max(spent(base, seed, False, max_tokens=30) for seed in seeds) > 3


def test_the_servers_default_budget_bounds_structured_responses(reasoning_engine):
    """``baton serve --max-reasoning-tokens 2`` on /v1/responses as on chat: a structured
    response without its own budget thinks at most 2 tokens (then </think>) and its message
    is a valid object; one with its own budget (12) keeps it and thinks longer."""
    import httpx

    def spent(base: str, seed: int, **extra: Any) -> int:
        body = {k: v for k, v in _responses_body(seed).items() if k != "max_reasoning_tokens"}
        reply = httpx.post(f"{base}/v1/responses", json=body | extra, timeout=120)
        assert reply.status_code == 200, reply.text
        response = reply.json()
        assert response["status"] == "completed", response
        message = response["output"][-1]
        jsonschema.validate(json.loads(message["content"][0]["text"]), SCHEMA)
        return response["usage"]["output_tokens_details"]["reasoning_tokens"]

    seeds = range(4)
    with _serve(reasoning_engine, max_reasoning_tokens=2) as base:
        assert all(spent(base, seed) <= 3 for seed in seeds)
        assert max(spent(base, seed, max_reasoning_tokens=12) for seed in seeds) > 3
