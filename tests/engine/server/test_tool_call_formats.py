"""Every model's tool-call syntax (``baton serve --tool-call-parser``): the format chosen from
the flag or the chat template, the grammar that forces calls in it (compiled by xgrammar and
walked token by token), and the parser that reads them back, whole and as stream deltas."""

from __future__ import annotations

import argparse
import json
from typing import Any

import jsonschema
import pytest

from baton.engine.server.config import ServerConfig
from baton.engine.server.serve import add_serve_parser
from baton.engine.server.tool_output import ToolCallDeltas, tool_message
from baton.engine.server.tools import prepare_messages
from baton.engine.tokenizer import Tokenizer
from baton.grammar.backend import allocate_bitmask
from baton.grammar.spec import StructuredOutputsParams
from baton.grammar.tool_calls import (
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    QWEN3_CODER,
    TOOL_CALL_FORMATS,
    FunctionTool,
    ParsedToolCall,
    ToolCallFormat,
    choose_tool_call_format,
    detect_tool_call_format,
    parse_tool_calls,
    tool_call_tag,
)
from baton.grammar.tool_parse import xml_value
from baton.grammar.validation import validate_spec
from baton.grammar.xgrammar.backend import XGrammarBackend, bitmask_allowed

VOCAB = 49152
EOS = 2

WEATHER = FunctionTool(
    "get_weather",
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer"},
        },
        "required": ["city", "unit"],
    },
)
TIME = FunctionTool("get_time", {"type": "object", "properties": {"tz": {"type": "string"}}})
TOOLS = [WEATHER, TIME]
SCHEMAS = {t.name: t.parameters for t in TOOLS}
FORMATS = list(TOOL_CALL_FORMATS.values())
# Compact JSON: baton's JSON grammar allows no free whitespace by default.
PARIS = ("get_weather", '{"city":"Paris","unit":"celsius","days":2}')
UTC = ("get_time", '{"tz":"UTC"}')


@pytest.fixture(scope="module")
def backend(tokenizer: Tokenizer) -> XGrammarBackend:
    return XGrammarBackend(tokenizer, VOCAB)


def accepts(backend: XGrammarBackend, tokenizer: Tokenizer, tag: dict[str, Any], text: str) -> bool:
    """Whether the tag's grammar takes ``text`` and may then end."""
    spec = StructuredOutputsParams(structural_tag=tag)
    validate_spec(spec)
    matcher = backend.compile(spec).new_matcher()
    for token in tokenizer.encode(text, add_special_tokens=False):
        bitmask = allocate_bitmask(1, VOCAB)
        matcher.fill_bitmask(bitmask, 0)
        if token not in bitmask_allowed(bitmask, 0, VOCAB) or not matcher.accept_tokens([token]):
            return False
    return matcher.accept_tokens([EOS])


def check(calls: tuple[ParsedToolCall, ...]) -> list[tuple[str, dict[str, Any]]]:
    """The (name, arguments) of finished calls, each validated against its function."""
    out = []
    for c in calls:
        assert c.complete
        args = json.loads(c.arguments)
        jsonschema.validate(args, SCHEMAS[c.name])
        out.append((c.name, args))
    return out


# ------------------------------------------------------------------- choosing the format


def test_the_format_comes_from_the_flag_or_the_template() -> None:
    assert list(TOOL_CALL_FORMATS) == ["hermes", "llama3_json", "mistral", "qwen3_coder"]
    for name, fmt in TOOL_CALL_FORMATS.items():
        assert choose_tool_call_format(name, "{{ '<tool_call>' }}") is fmt
    templates = {
        "{% for t in tools %}<tool_call>{% endfor %}": HERMES,
        "{% if m.role == 'ipython' %}{% endif %}": LLAMA3_JSON,
        "{{ '<|python_tag|>' + call | tojson }}": LLAMA3_JSON,
        "{{ '[TOOL_CALLS]' + calls | tojson }}": MISTRAL,
        "<tool_call>\n<function={{ name }}>\n<parameter={{ p }}>": QWEN3_CODER,
    }
    for template, fmt in templates.items():
        assert detect_tool_call_format(template) is fmt, template
        assert choose_tool_call_format(None, template) is fmt
    assert detect_tool_call_format("{{ messages }}") is None
    assert choose_tool_call_format(None, "{{ messages }}") is HERMES
    assert choose_tool_call_format(None, None) is HERMES


def test_the_server_state_exposes_the_chosen_format() -> None:
    """The flag wins; else the server's --chat-template, else the tokenizer's template."""
    from types import SimpleNamespace

    from baton.engine.server.metrics import ServerMetrics
    from baton.engine.server.state import ServerState

    tokenizer = SimpleNamespace(chat_template="{{ '[TOOL_CALLS]' }}")
    engine = SimpleNamespace(get_tokenizer=lambda: tokenizer)

    def chosen(**config: Any) -> ToolCallFormat:
        state = ServerState(engine, ServerConfig(served_model_name="m", **config), ServerMetrics())  # type: ignore[arg-type]
        return state.tool_call_format

    assert chosen() is MISTRAL
    assert chosen(chat_template="<function={{ f }}>") is QWEN3_CODER
    assert chosen(chat_template="{{ messages }}") is HERMES
    assert chosen(tool_call_parser="llama3_json") is LLAMA3_JSON


def test_an_unknown_parser_is_refused_at_startup() -> None:
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral, qwen3_coder"):
        choose_tool_call_format("pythonic", None)
    with pytest.raises(ValueError, match="tool_call_parser must be one of hermes, llama3_json"):
        ServerConfig(served_model_name="m", tool_call_parser="pythonic")
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    assert parser.parse_args(["serve", "--tool-call-parser", "mistral"]).tool_call_parser == (
        "mistral"
    )
    assert parser.parse_args(["serve"]).tool_call_parser is None
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--tool-call-parser", "pythonic"])


def test_bad_formats() -> None:
    with pytest.raises(ValueError, match="trigger"):
        ToolCallFormat("x", trigger="<b>", call_prefix="<a>", name_suffix=">", end="", separator="")


# ----------------------------------------------------------------------- the grammar


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_required_named_and_auto_in_each_format(
    fmt: ToolCallFormat, backend: XGrammarBackend, tokenizer: Tokenizer
) -> None:
    paris, utc, both = fmt.render(*PARIS), fmt.render(*UTC), fmt.render_calls([PARIS, UTC])
    wrong = fmt.render("get_weather", '{"city":"Paris","unit":"kelvin"}')
    missing = fmt.render("get_weather", '{"city":"Paris"}')
    required = tool_call_tag(TOOLS, "required", fmt=fmt)
    assert accepts(backend, tokenizer, required, paris)
    assert accepts(backend, tokenizer, required, both)
    other = (MISTRAL if fmt is HERMES else HERMES).render(*UTC)  # another model's syntax
    for text in ("", "Sure. " + paris, wrong, missing, fmt.render("nope", "{}"), other):
        assert not accepts(backend, tokenizer, required, text), text
    one = tool_call_tag(TOOLS, "required", parallel=False, fmt=fmt)
    assert accepts(backend, tokenizer, one, utc)
    assert not accepts(backend, tokenizer, one, both)
    named = tool_call_tag([TIME], "required", parallel=False, fmt=fmt)
    assert accepts(backend, tokenizer, named, utc)
    assert not accepts(backend, tokenizer, named, paris)
    auto = tool_call_tag(TOOLS, "auto", fmt=fmt)
    assert accepts(backend, tokenizer, auto, "Just text, no call.")
    assert accepts(backend, tokenizer, auto, "Let me look. " + both)
    assert not accepts(backend, tokenizer, auto, "Let me look. " + wrong)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    answer = tool_call_tag(
        TOOLS, "auto", fmt=fmt, answer={"type": "json_schema", "json_schema": schema}
    )
    assert accepts(backend, tokenizer, answer, paris)
    assert accepts(backend, tokenizer, answer, '{"a":1}')
    assert not accepts(backend, tokenizer, answer, "free text")


# ------------------------------------------------------------------------ the parser

SAMPLES = {
    "hermes": 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
    '"unit": "celsius", "days": 2}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
    '"arguments": {"tz": "UTC"}}\n</tool_call>',
    "llama3_json": 'Let me check. <|python_tag|>{"name": "get_weather", "parameters": {"city": '
    '"Paris", "unit": "celsius", "days": 2}}; {"name": "get_time", "parameters": {"tz": "UTC"}}',
    "mistral": 'Let me check. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", '
    '"unit": "celsius", "days": 2}}, {"name": "get_time", "arguments": {"tz": "UTC"}}]',
    "qwen3_coder": "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
    "</parameter>\n<parameter=unit>\n celsius \n</parameter>\n<parameter=days>\n2\n</parameter>\n"
    "</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=tz>\nUTC\n"
    "</parameter>\n</function>\n</tool_call>",
}
WANT = [
    ("get_weather", {"city": "Paris", "unit": "celsius", "days": 2}),
    ("get_time", {"tz": "UTC"}),
]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_parse_content_and_parallel_calls(fmt: ToolCallFormat) -> None:
    out = parse_tool_calls(SAMPLES[fmt.name], fmt, final=True, tools=TOOLS)
    assert out.content == "Let me check."
    assert check(out.tool_calls) == WANT
    # What the parser reads back, the format writes (earlier calls in a prompt).
    again = parse_tool_calls(fmt.render_calls([PARIS, UTC]), fmt, final=True, tools=TOOLS)
    assert again.content == "" and check(again.tool_calls) == WANT
    # No call: the text as it is.
    plain = parse_tool_calls("plain answer, {no} [call] <here> \n", fmt, final=True, tools=TOOLS)
    assert plain.content == "plain answer, {no} [call] <here> \n" and plain.tool_calls == ()


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_unfinished_calls_and_headers(fmt: ToolCallFormat) -> None:
    text = SAMPLES[fmt.name]
    # Cut inside the first call's header: no call, the text stays.
    header = text.index(fmt.trigger) + len(fmt.trigger) + 2
    out = parse_tool_calls(text[:header], fmt, final=True, tools=TOOLS)
    assert out.tool_calls == () and out.content == text[:header]
    # Cut inside the second call (max_tokens): the first is whole, the second unfinished.
    cut = text[: text.index("get_time") + 30]
    out = parse_tool_calls(cut, fmt, final=True, tools=TOOLS)
    assert out.content == "Let me check."
    assert check(out.tool_calls[:1]) == WANT[:1]
    assert out.tool_calls[1].name == "get_time" and not out.tool_calls[1].complete


def stream(fmt: ToolCallFormat, chunks: list[str]) -> tuple[str, list[dict[str, str]]]:
    """The content and calls a client rebuilds from the deltas of ``chunks`` (the text grows
    by one chunk per step; the last step is the finished text)."""
    deltas = ToolCallDeltas(fmt, TOOLS)
    content, calls = "", []
    text = ""
    for i, chunk in enumerate(chunks):
        text += chunk
        d = deltas.delta(text, finished=i == len(chunks) - 1)
        content += d.get("content", "")
        for c in d.get("tool_calls", []):
            if "id" in c:  # a call's first delta names it, once
                assert c["index"] == len(calls) and c["function"]["name"]
                calls.append({"name": c["function"]["name"], "arguments": ""})
            else:
                assert "name" not in c["function"]
            calls[c["index"]]["arguments"] += c["function"]["arguments"]
    return content, calls


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_streamed_deltas_at_every_split_point(fmt: ToolCallFormat) -> None:
    """Split anywhere (and one character at a time), the deltas joined are the whole
    parse: the content and each call's name and arguments."""
    text = SAMPLES[fmt.name]
    message, reason = tool_message(text, "stop", fmt, TOOLS)
    assert reason == "tool_calls"
    want = (
        message["content"] or "",
        [
            {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
            for c in message["tool_calls"]
        ],
    )
    for k in range(len(text) + 1):
        assert stream(fmt, [text[:k], text[k:]]) == want, k
    content, calls = stream(fmt, list(text))
    assert (content, calls) == want
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == WANT


def test_stream_arguments_arrive_in_pieces() -> None:
    """JSON arguments grow character by character; XML ones by whole parameters."""
    for fmt, least in ((HERMES, 20), (QWEN3_CODER, 4)):
        deltas = ToolCallDeltas(fmt, TOOLS)
        text, pieces = SAMPLES[fmt.name], 0
        for n in range(1, len(text) + 1):
            for c in deltas.delta(text[:n], finished=n == len(text)).get("tool_calls", []):
                pieces += c["function"]["arguments"] != ""
        assert pieces >= least, (fmt.name, pieces)


def test_llama3_python_tag_and_separators() -> None:
    out = parse_tool_calls(
        '<|python_tag|>{"name": "get_time", "parameters": {"tz": "CET"}}', LLAMA3_JSON, final=True
    )
    assert out.content == "" and check(out.tool_calls) == [("get_time", {"tz": "CET"})]
    # A half-written separator or tag is held back until it is known.
    partial = parse_tool_calls('{"name": "get_time", "parameters": {}}; ', LLAMA3_JSON, final=False)
    assert partial.content == "" and len(partial.tool_calls) == 1
    assert parse_tool_calls("Hi <|python_t", LLAMA3_JSON, final=False).content == "Hi"
    # JSON in the answer that is not a call stays text.
    text = 'Use {"name": "x y"} here'
    assert parse_tool_calls(text, LLAMA3_JSON, final=True).content == text


def test_qwen_xml_values_follow_the_schema() -> None:
    assert xml_value("\nParis\n", {"type": "string"}) == "Paris"
    assert xml_value("\n  def f():\n    pass\n", {"type": "string"}) == "  def f():\n    pass"
    assert xml_value("\n celsius \n", {"enum": ["celsius"]}) == "celsius"
    assert xml_value("\n12\n", {"type": "integer"}) == 12
    assert xml_value("\n1.5\n", {"type": "number"}) == 1.5
    assert xml_value("\ntrue\n", {"type": "boolean"}) is True
    assert xml_value('\n{"a": [1]}\n', {"type": "object"}) == {"a": [1]}
    assert xml_value("\nnull\n", {"type": ["integer", "null"]}) is None
    assert xml_value("\n12\n", {"type": "string"}) == "12"
    assert xml_value("\n12\n", None) == "12"  # undeclared: a string, as vLLM reads it
    assert xml_value("\n[1, 2]\n", {}) == [1, 2]
    assert xml_value("\nabc\n", {"type": "integer"}) == "abc"  # not JSON: left as text


@pytest.mark.parametrize("fmt", [LLAMA3_JSON, MISTRAL, QWEN3_CODER], ids=lambda f: f.name)
def test_earlier_calls_in_the_prompt_use_the_format(
    fmt: ToolCallFormat, tokenizer: Tokenizer
) -> None:
    """The default model's template knows no tools: baton shows the syntax and writes earlier
    calls in it, so the prompt and the grammar agree."""
    definitions = tuple({"type": "function", "function": {"name": t.name}} for t in TOOLS)
    from baton.engine.server.tools import ToolPlan

    plan = ToolPlan(definitions, tuple(TOOLS), tuple(TOOLS), "auto", True, fmt)
    messages = [
        {"role": "user", "content": "Weather and time?"},
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "a", "function": {"name": PARIS[0], "arguments": PARIS[1]}},
                {"id": "b", "function": {"name": UTC[0], "arguments": json.loads(UTC[1])}},
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": "21C"},
    ]
    prepared, variables = prepare_messages(messages, plan, tokenizer.chat_template)
    assert variables == {}
    text = tokenizer.apply_chat_template(prepared, add_generation_prompt=True, tokenize=False)
    assert fmt.render_calls([PARIS, (UTC[0], '{"tz": "UTC"}')]) in text  # a dict: dumped
    shown = {"llama3_json": '"parameters"', "mistral": "[TOOL_CALLS]", "qwen3_coder": "<function="}
    assert shown[fmt.name] in text.split("<|im_start|>user")[0]  # the system message shows it


# ------------------------------------------------------------ markers as their own tokens

MARKERS = {"<tool_call>": False, "</tool_call>": False, "[TOOL_CALLS]": True}
"""Qwen's <tool_call> pair (added tokens, not special) and Mistral v3's [TOOL_CALLS] (a
control token), added to the tiny model's vocabulary: name -> special."""


# Bounded: a random-weight model writes strings and numbers until max_tokens where it may.
BOUNDED = {
    "get_weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 8},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    "get_time": {
        "type": "object",
        "properties": {"tz": {"enum": ["UTC", "CET"]}},
        "required": ["tz"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def marker_folder(tiny_model_dir: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tiny Llama with ``MARKERS`` added as its last ids, the embedding grown to them."""
    import torch
    from safetensors.torch import load_file, save_file
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as Backend

    out = tmp_path_factory.mktemp("markers")
    for file in tiny_model_dir.iterdir():
        (out / file.name).write_bytes(file.read_bytes())
    backend = Backend.from_file(str(out / "tokenizer.json"))
    for text, special in MARKERS.items():
        backend.add_tokens([AddedToken(text, special=special, normalized=False)])
    backend.save(str(out / "tokenizer.json"))
    tensors = load_file(str(out / "model.safetensors"))
    generator = torch.Generator().manual_seed(5)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in tensors:
            old = tensors[name]
            rows = backend.get_vocab_size() - old.shape[0]
            extra = 0.1 * torch.randn(rows, old.shape[1], generator=generator)
            tensors[name] = torch.cat([old, extra.to(old.dtype)])
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    vocab = backend.get_vocab_size()
    (out / "config.json").write_text(json.dumps({**config, "vocab_size": vocab}))
    return out


@pytest.fixture(scope="module")
def marker_servers(marker_folder: Any) -> Any:
    """``baton serve`` on the tiny model with marker tokens: one app per parser (hermes,
    mistral, qwen3_coder) on one engine."""
    from contextlib import ExitStack

    from serving import serve_in_thread

    from baton.engine.entrypoints.async_llm import AsyncLLM
    from baton.engine.server.app import build_app

    engine = AsyncLLM.from_engine_args(
        str(marker_folder), dtype="float32", max_num_seqs=4, max_model_len=768
    )
    try:
        with ExitStack() as stack:
            urls = {}
            for name in ("hermes", "mistral", "qwen3_coder"):
                config = ServerConfig(served_model_name="m", tool_call_parser=name)
                urls[name] = stack.enter_context(serve_in_thread(build_app(engine, config)))
            yield urls
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    ("parser", "markers"),
    [
        ("hermes", ("<tool_call>", "</tool_call>")),
        ("mistral", ("[TOOL_CALLS]",)),
        ("qwen3_coder", ("<tool_call>", "</tool_call>")),
    ],
)
def test_forced_calls_write_the_markers_as_their_tokens(
    marker_servers: dict[str, str], parser: str, markers: tuple[str, ...]
) -> None:
    """Random weights at temperature 1, required and named, 3 seeds each: the call validates
    and each marker is written as its one token (the logprobs' tokens), never spelled in
    pieces; Mistral's [TOOL_CALLS] is a control token the parser still finds."""
    import httpx

    tools = [
        {"type": "function", "function": {"name": n, "parameters": p}} for n, p in BOUNDED.items()
    ]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        for seed in range(3):
            body = {
                "model": "m",
                "messages": [{"role": "user", "content": "Weather?"}],
                "tools": tools,
                "tool_choice": choice,
                "max_tokens": 200,
                "temperature": 1.0,
                "seed": seed,
                "logprobs": True,
                "parallel_tool_calls": False,  # random weights would call until max_tokens
            }
            url = f"{marker_servers[parser]}/v1/chat/completions"
            reply = httpx.post(url, json=body, timeout=120)
            assert reply.status_code == 200, reply.text
            out = reply.json()["choices"][0]
            calls = out["message"]["tool_calls"]
            assert calls and out["finish_reason"] == "tool_calls", out
            for call in calls:
                args = json.loads(call["function"]["arguments"])
                jsonschema.validate(args, BOUNDED[call["function"]["name"]])
            tokens = [t["token"] for t in out["logprobs"]["content"]]
            for marker in markers:
                per_call = 1 if parser == "mistral" else len(calls)
                assert tokens.count(marker) == per_call, (marker, tokens)
                assert "".join(tokens).count(marker) == per_call, tokens  # no spelled copy


def test_a_control_token_is_allowed_only_where_a_tag_names_it(marker_folder: Any) -> None:
    """xgrammar gets a control token's text after a 0xFF byte: no string, regex or free text
    can write [TOOL_CALLS], the required tag's token format must (and an added token that is
    not special, <tool_call>, is then its one id too, not its spelling)."""
    from baton.engine.loader import load_tokenizer

    tok = load_tokenizer(marker_folder)
    ids = {m: tok.encode(m, add_special_tokens=False) for m in MARKERS}
    assert all(len(i) == 1 for i in ids.values()) and ids["[TOOL_CALLS]"][0] in tok.all_special_ids
    backend = XGrammarBackend(tok, tok.vocab_size)
    markers = {m: i[0] for m, i in ids.items()}

    def first(spec: StructuredOutputsParams) -> list[int]:
        bitmask = allocate_bitmask(1, tok.vocab_size)
        backend.compile(spec).new_matcher().fill_bitmask(bitmask, 0)
        return bitmask_allowed(bitmask, 0, tok.vocab_size)

    for free in (
        StructuredOutputsParams(regex=".*"),
        StructuredOutputsParams(grammar='root ::= [^"]*'),
    ):
        assert markers["[TOOL_CALLS]"] not in first(free)
    for fmt, marker in (
        (MISTRAL, "[TOOL_CALLS]"),
        (HERMES, "<tool_call>"),
        (QWEN3_CODER, "<tool_call>"),
    ):
        tag = tool_call_tag(TOOLS, "required", fmt=fmt, markers=markers)
        assert first(StructuredOutputsParams(structural_tag=tag)) == [markers[marker]]
        unbound = first(
            StructuredOutputsParams(structural_tag=tool_call_tag(TOOLS, "required", fmt=fmt))
        )
        # As text: the control token never, the added one among its pieces ("<", "[" ...).
        assert (markers[marker] in unbound) is not MARKERS[marker]
        assert unbound != [markers[marker]]


def test_xml_arguments_bound_their_whitespace(
    backend: XGrammarBackend, tokenizer: Tokenizer
) -> None:
    """Qwen3-Coder's XML arguments allow a few whitespace characters in a row, not a run a
    small model would write until max_tokens."""
    tag = tool_call_tag([TIME], "required", fmt=QWEN3_CODER)
    call = QWEN3_CODER.render(*UTC)
    assert accepts(backend, tokenizer, tag, call)
    assert accepts(backend, tokenizer, tag, call.replace("<parameter=", "\n<parameter="))
    assert not accepts(
        backend, tokenizer, tag, call.replace("<parameter=", "\n" * 8 + "<parameter=")
    )
