"""gpt-oss's harmony format (``--reasoning-parser openai_gptoss``) without a server: the thoughts
end with the token sequence ``<|channel|>final<|message|>``, so the reasoning matcher switches
after a sequence (forced token by token once the budget is spent, rolled back across); harmony
messages, analysis and final split from the token ids, whole and streamed; harmony tool calls as
OpenAI's; a structured answer on the tiny gpt-oss validates."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
from harmony_testing import WEATHER, _ids
from test_gpt_oss import folder, harmony_folder  # noqa: F401 - the tiny gpt-oss fixtures
from test_reasoning import SCHEMA, _Digits

from baton.engine import LLM, SamplingParams
from baton.engine.loader import load_tokenizer
from baton.engine.server.harmony import HarmonyTokens, harmony_messages
from baton.engine.server.reasoning import HarmonySplitter, ReasoningDeltas, reasoning_splitter
from baton.grammar.backend import allocate_bitmask
from baton.grammar.reasoning import ReasoningMatcher, ReasoningSpec
from baton.grammar.spec import StructuredOutputsParams

# A vocabulary of 40 for the matcher: EOS 11, the end of thoughts 31 32 33 (as
# <|channel|> final <|message|>), the forced prefix 34 35 (as <|end|> <|start|>assistant).
END, PREFIX = (31, 32, 33), (34, 35)


def _matcher(budget: int | None) -> ReasoningMatcher:
    spec = ReasoningSpec(33, True, budget, (11,), END[:-1], PREFIX)
    return ReasoningMatcher(_Digits(), spec, vocab_size=40)


def _allowed(m: ReasoningMatcher) -> list[int]:
    bitmask = allocate_bitmask(1, 40)
    m.fill_bitmask(bitmask, 0)
    return [t for t in range(40) if (int(bitmask[0, t // 32]) >> (t % 32)) & 1]


def test_the_matcher_switches_after_the_whole_end_sequence_and_rolls_back_across_it():
    m = _matcher(None)
    assert m.accept_tokens([33, 31, 32, 20])  # <|message|> alone, a broken end: thoughts
    assert m.thinking and m.num_thinking_tokens == 4
    assert not m.accept_tokens([11])  # no end of sequence while thinking
    assert m.validate_tokens([31, 32, 33, 5, 6, 39]) == 5
    assert m.thinking and m.num_thinking_tokens == 4  # validate changed nothing
    assert m.accept_tokens([31, 32, 33, 5]) and not m.thinking and m.inner.seen == [5]
    assert m.num_thinking_tokens == 6  # the token that ends the thoughts is not counted
    m.rollback(2)  # 5 and <|message|>: thinking again, inside the end
    assert m.thinking and m.inner.seen == [] and m.num_thinking_tokens == 6
    assert m.accept_tokens([33, 7, 11]) and m.is_terminated()
    m.reset()
    assert (
        m.thinking
        and m.num_thinking_tokens == 0
        and _allowed(m) == [t for t in range(40) if t != 11]
    )


def test_a_spent_budget_forces_the_end_token_by_token():
    m = _matcher(2)
    assert m.accept_tokens([20, 21]) and m.budget_spent
    forced = []
    while m.thinking:
        (token,) = _allowed(m)
        assert not m.accept_tokens([(token + 1) % 40])  # nothing else is taken
        assert m.accept_tokens([token])
        forced.append(token)
    assert forced == [*PREFIX, *END] and m.num_thinking_tokens == 2
    m.rollback(3)  # back into the forced sequence
    assert m.thinking and _allowed(m) == [31]
    m.rollback(3)  # 35, 34 and 21
    assert not m.budget_spent and m.num_thinking_tokens == 1


def test_a_budget_spent_inside_the_end_continues_it():
    m = _matcher(2)
    assert m.accept_tokens([20, 31]) and m.budget_spent
    assert _allowed(m) == [32]  # <|channel|> written: final, not the prefix
    assert m.accept_tokens([32, 33, 4]) and m.inner.seen == [4]
    m = _matcher(3)
    assert m.accept_tokens([20, 34, 35]) and _allowed(m) == [31]  # inside the prefix


@pytest.fixture(scope="module")
def harmony_tokenizer(harmony_folder):  # noqa: F811
    return load_tokenizer(harmony_folder)


ANSWER = (
    "<|channel|>analysis<|message|>Think of red.<|end|>"
    '<|start|>assistant<|channel|>final<|message|>{"name": "red", "ok": true}<|return|>'
)


def test_harmony_messages_read_channels_recipients_and_open_messages(harmony_tokenizer):
    tok = harmony_tokenizer
    special = HarmonyTokens.of(tok)
    text = (
        "<|channel|>analysis<|message|>Need weather.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Paris"}<|call|>'
        "<|start|>assistant to=functions.f<|channel|>commentary<|message|>{}<|call|>"
        "<|start|>assistant<|channel|>final<|message|>Sun"
    )
    got = [
        (m.channel, m.recipient, m.constrain, m.body, m.closed)
        for m in harmony_messages(_ids(tok, text), special, tok.decode)
    ]
    assert got == [
        ("analysis", "", "", "Need weather.", True),
        ("commentary", "functions.get_weather", "json", '{"city": "Paris"}', True),
        ("commentary", "functions.f", "", "{}", True),
        ("final", "", "", "Sun", False),
    ]
    # A character whose bytes are split over tokens is held back until it is whole.
    ids = _ids(tok, "<|channel|>final<|message|>ok 靬")
    (m,) = harmony_messages(ids[:-1], special, tok.decode)
    assert m.body == "ok " and "\ufffd" in tok.decode(ids[-3:-1])
    (m,) = harmony_messages(ids, special, tok.decode)
    assert m.body == "ok 靬"
    # A body the prompt opened (no header in the completion) is the analysis channel's.
    (m,) = harmony_messages(_ids(tok, "just thinking"), special, tok.decode)
    assert (m.channel, m.body, m.closed) == ("analysis", "just thinking", False)


def test_the_splitter_reads_analysis_as_reasoning_and_final_as_content(harmony_tokenizer):
    tok = harmony_tokenizer
    splitter = reasoning_splitter(tok, "openai_gptoss")
    assert isinstance(splitter, HarmonySplitter)
    ids = _ids(tok, ANSWER)
    visible = tok.decode(ids)  # as the engine detokenises: the markers left out
    assert splitter.split(visible, ids, True) == ("Think of red.", '{"name": "red", "ok": true}')
    final_at = ids.index(_ids(tok, "<|message|>")[0], ids.index(_ids(tok, "final")[0]))
    assert splitter.reasoning_tokens(ids, True) == final_at + 1
    thoughts = ids[: ids.index(_ids(tok, "<|end|>")[0])]
    assert splitter.split(tok.decode(thoughts), thoughts, True) == ("Think of red.", None)
    assert splitter.split("plain", _ids(tok, "plain"), False) == (None, "plain")
    # Whether the prompt left the model thinking: after <|start|>assistant yes, after the
    # final channel's header no.
    prompt = "<|start|>user<|message|>Hi<|end|><|start|>assistant"
    assert splitter.thinks_first(_ids(tok, prompt))
    assert not splitter.thinks_first(_ids(tok, prompt + "<|channel|>final<|message|>"))


def test_streamed_deltas_split_anywhere_add_up_to_the_whole_split(harmony_tokenizer):
    tok = harmony_tokenizer
    splitter = reasoning_splitter(tok, "openai_gptoss")
    ids = _ids(tok, ANSWER)
    whole = splitter.split(tok.decode(ids), ids, True)
    assert whole == ("Think of red.", '{"name": "red", "ok": true}')
    for step in (1, 2, 3, 5):
        deltas = ReasoningDeltas(splitter, True)
        parts = {"reasoning_content": "", "content": ""}
        for n in range(step, len(ids) + step, step):
            for key, part in deltas.delta(tok.decode(ids[:n]), ids[:n]).items():
                parts[key] += part
        assert (parts["reasoning_content"], parts["content"]) == whole, step


def test_bad_parser_names_and_tokenizers_are_clear_errors(harmony_folder, tiny_model_dir):  # noqa: F811
    from baton.engine.server.config import ServerConfig

    with pytest.raises(ValueError, match="expected one of qwen3, deepseek_r1, openai_gptoss"):
        LLM(str(harmony_folder), reasoning_parser="harmony")
    with pytest.raises(ValueError, match="openai_gptoss"):
        ServerConfig(served_model_name="m", reasoning_parser="harmony")
    tok = load_tokenizer(tiny_model_dir)
    with pytest.raises(ValueError, match=re.escape("needs '<|start|>' as one token")):
        reasoning_splitter(tok, "openai_gptoss")


PROMPT = "<|start|>user<|message|>A name and a flag, as JSON.<|end|><|start|>assistant"


def test_a_structured_answer_follows_the_forced_final_channel(harmony_folder):  # noqa: F811
    """Random weights at temperature 1: at most 6 thinking tokens, then the end of thoughts
    (forced where the model did not write it), then an object that validates."""
    llm = LLM(
        str(harmony_folder),
        dtype="float32",
        max_model_len=256,
        max_num_seqs=4,
        reasoning_parser="openai_gptoss",
    )
    try:
        tok = llm.get_tokenizer()
        end = tuple(_ids(tok, "<|channel|>final<|message|>"))
        forced = _ids(tok, "<|end|><|start|>assistant")
        params = [
            SamplingParams(
                max_tokens=80,
                temperature=1.0,
                seed=seed,
                structured_outputs=StructuredOutputsParams(json=SCHEMA),
                max_reasoning_tokens=6,
            )
            for seed in range(6)
        ]
        outs = llm.generate([{"prompt_token_ids": _ids(tok, PROMPT)}] * 6, params, use_tqdm=False)
        forced_runs = 0
        for out in outs:
            ids = list(out.outputs[0].token_ids)
            cut = next(i for i in range(len(ids)) if tuple(ids[i : i + len(end)]) == end)
            forced_runs += ids[cut - len(forced) : cut] == forced
            answer = tok.decode(ids[cut + len(end) :])
            assert out.outputs[0].finish_reason == "stop", (ids, answer)
            jsonschema.validate(json.loads(answer), SCHEMA)
        assert forced_runs >= 1  # random weights do not write the final channel themselves
    finally:
        llm.shutdown()


CALLS = (
    "<|channel|>analysis<|message|>Need the weather.<|end|>"
    "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris", "days": 2}<|call|>'
    "<|start|>assistant to=functions.get_weather<|channel|>commentary<|message|>"
    '{"city": "Oslo"}<|call|>'
)


def _plan(tokenizer: Any) -> Any:
    from baton.engine.server.chat_plan import ChatPlan
    from baton.engine.server.tools import ToolPlan
    from baton.grammar.tool_formats import OPENAI, FunctionTool

    function = FunctionTool("get_weather", WEATHER)
    tools = ToolPlan(({},), (function,), (function,), "auto", True, OPENAI)
    return ChatPlan(
        [], SamplingParams(), None, tools, reasoning_splitter(tokenizer, "openai_gptoss")
    )


def test_harmony_tool_calls_become_openai_tool_calls(harmony_tokenizer):
    """The server's reading of a finished choice: the analysis is the reasoning, the preamble
    the content, each message to functions.NAME a call with its JSON arguments."""
    from baton.engine.outputs import CompletionOutput
    from baton.engine.server.chat_plan import assistant_reply

    tok = harmony_tokenizer
    ids = _ids(tok, CALLS)
    c = CompletionOutput(0, tok.decode(ids), ids, None, None, "stop")
    reasoning, message, reason = assistant_reply(c, _plan(tok), True)
    assert reasoning == "Need the weather."
    assert message["content"] == "Checking."
    calls = [
        (t["function"]["name"], json.loads(t["function"]["arguments"]))
        for t in message["tool_calls"]
    ]
    assert calls == [
        ("get_weather", {"city": "Paris", "days": 2}),
        ("get_weather", {"city": "Oslo"}),
    ]
    for _, arguments in calls:
        jsonschema.validate(arguments, WEATHER)
    assert reason == "tool_calls"


def test_harmony_tool_calls_stream_split_anywhere(harmony_tokenizer):
    """The splitter's content fed to the tool-call deltas at every few tokens: the deltas add
    up to the calls and content of the whole answer."""
    from baton.engine.server.tool_output import ToolCallDeltas

    tok = harmony_tokenizer
    plan = _plan(tok)
    ids = _ids(tok, CALLS)
    for step in (1, 2, 3, 7):
        thoughts = ReasoningDeltas(plan.splitter, True)
        deltas = ToolCallDeltas(plan.tools.fmt, plan.tools.functions)
        content, reasoning, calls = "", "", {}
        for n in range(step, len(ids) + step, step):
            part = ids[:n]
            reasoning += thoughts.delta(tok.decode(part), part).get("reasoning_content", "")
            _, text = plan.splitter.split(tok.decode(part), part, True)
            delta = deltas.delta(text or "", n >= len(ids))
            content += delta.get("content", "")
            for call in delta.get("tool_calls", []):
                name, arguments = calls.get(call["index"], ("", ""))
                function = call["function"]
                calls[call["index"]] = (
                    name + function.get("name", ""),
                    arguments + function["arguments"],
                )
        assert reasoning == "Need the weather." and content == "Checking.", step
        assert [(n, json.loads(a)) for n, a in calls.values()] == [
            ("get_weather", {"city": "Paris", "days": 2}),
            ("get_weather", {"city": "Oslo"}),
        ], step
