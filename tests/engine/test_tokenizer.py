"""baton's Tokenizer against transformers' tokenizer built from the same GGUF / folder."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import jinja2
import pytest
from gguf_files import tokenizer_metadata, write_gguf
from hypothesis import given, settings
from hypothesis import strategies as st

from baton.engine.tokenizer import Tokenizer

TEXTS = [
    "Hello world",
    " Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure they'll say it's what we've done, didn't they?",
    "ÉCOLE naïve café façade Ærø ß Ω ω",
    "日本語のテキストと中文文本，한국어 텍스트",
    "مرحبا بالعالم — שלום עולם",
    "e\u0301 combining, zero\u200bwidth, nbsp\u00a0here",
    "emoji 😀🎉👍🏽 family 👨‍👩‍👧‍👦 flag 🇫🇷 keycap 1️⃣",
    "digits 0 12 345 6789 3.14159 1e-10 1,000,000 -42 007",
    "a  1  22   333\n4444\t55555",
    "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
    '{"key": [1, 2, {"nested": null}], "s": "va\\"lue"}',
    "   leading spaces and trailing spaces   ",
    "\n\n\nnewlines\r\nand\rreturns\n",
    "\t\ttabs\t \t mixed \u3000 ideographic space",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more<|im_end|><|im_end|>",
    "<|im_start  not special <|im_end |> <repo_name>x<filename>y",
    "<jupyter_code>print(1)<jupyter_output>1<empty_output>",
    "URL https://example.com/path?q=1&r=%20#frag and email a.b@c.org",
    "~!@#$%^&*()_+`-=[]{}|;':\",./<>?",
    "",
    " ",
    "x" * 300,
    "othello hello HELLO",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour. 🎨"},
    ],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Write <|im_end|> literally\n  with   spaces\n"},
    ],
    [{"role": "user", "content": "日本語 and numbers 12345", "name": None}],
]


@pytest.fixture(scope="module")
def random_id_sequences() -> list[list[int]]:
    rng = random.Random(0)
    sequences = [[rng.randrange(49152) for _ in range(rng.randrange(1, 40))] for _ in range(200)]
    # Runs of byte tokens split multi-byte characters: decoding must replace them the same way.
    sequences += [[rng.randrange(17, 300) for _ in range(12)] for _ in range(50)]
    sequences.append(list(range(20)))  # every special token
    return sequences


# ---------------------------------------------------------------- default GGUF tokenizer


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_equals_transformers(
    tokenizer: Tokenizer, hf_tokenizer: Any, add_special_tokens: bool
) -> None:
    for text in TEXTS:
        expected = hf_tokenizer.encode(text, add_special_tokens=add_special_tokens)
        assert tokenizer.encode(text, add_special_tokens=add_special_tokens) == expected, text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_equals_transformers(
    tokenizer: Tokenizer,
    hf_tokenizer: Any,
    random_id_sequences: list[list[int]],
    skip_special_tokens: bool,
) -> None:
    encoded = [tokenizer.encode(text) for text in TEXTS]
    for ids in encoded + random_id_sequences:
        expected = hf_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) == expected, ids


@settings(max_examples=200, derandomize=True, deadline=None)
@given(text=st.text(max_size=40))
def test_random_text_equals_transformers(
    tokenizer: Tokenizer, hf_tokenizer: Any, text: str
) -> None:
    ids = tokenizer.encode(text)
    assert ids == hf_tokenizer.encode(text)
    assert tokenizer.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids)


def test_round_trip(tokenizer: Tokenizer) -> None:
    for text in TEXTS:
        assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == text


def test_special_tokens(tokenizer: Tokenizer, hf_tokenizer: Any) -> None:
    assert tokenizer.vocab_size == len(hf_tokenizer) == 49152
    assert tokenizer.bos_token_id == hf_tokenizer.bos_token_id == 1
    assert tokenizer.eos_token_id == hf_tokenizer.eos_token_id == 2
    assert tokenizer.eos_token_ids == (2,)
    assert tokenizer.pad_token_id == hf_tokenizer.pad_token_id == 2
    assert tokenizer.unk_token_id == hf_tokenizer.unk_token_id == 0
    assert tokenizer.add_bos_token is False
    hf_special = {
        i for i, t in hf_tokenizer.backend_tokenizer.get_added_tokens_decoder().items() if t.special
    }
    assert tokenizer.all_special_ids == frozenset(hf_special) == frozenset(range(17))
    assert tokenizer.encode("<|im_start|>") == [1]
    assert tokenizer.encode("<|im_end|>", add_special_tokens=True) == [2]
    assert tokenizer.decode([1, 28120, 2]) == "hello"
    assert tokenizer.special_tokens_map() == hf_tokenizer.special_tokens_map


def test_token_strings_equal_transformers(tokenizer: Tokenizer, hf_tokenizer: Any) -> None:
    strings = tokenizer.token_strings()
    assert list(strings) == hf_tokenizer.convert_ids_to_tokens(list(range(49152)))
    assert strings[1] == "<|im_start|>" and strings[216] == "Ġ"
    assert tokenizer.token_strings() is strings  # cached
    ids = tokenizer.encode("Hello world")
    assert tokenizer.convert_ids_to_tokens(ids) == hf_tokenizer.convert_ids_to_tokens(ids)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_equals_transformers(
    tokenizer: Tokenizer, hf_tokenizer: Any, add_generation_prompt: bool
) -> None:
    for messages in CONVERSATIONS:
        expected = hf_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        rendered = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt
        )
        assert rendered == expected
        expected_ids = hf_tokenizer.apply_chat_template(
            messages,
            tokenize=True,
            return_dict=False,
            add_generation_prompt=add_generation_prompt,
        )
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True
        )
        assert ids == list(expected_ids)


def test_default_chat_template_shape(tokenizer: Tokenizer) -> None:
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def _with_template(tokenizer: Tokenizer, template: str) -> Tokenizer:
    """``tokenizer`` with another chat template."""
    return Tokenizer(
        tokenizer.backend,
        eos_token_ids=tokenizer.eos_token_ids,
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        unk_token_id=tokenizer.unk_token_id,
        chat_template=template,
    )


TRIMMING_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] | trim }}</{{ m['role'] }}>\n"
    "{% endfor %}"
)


@pytest.mark.parametrize("content", ["My colour is", "My colour is ", "  padded  "])
@pytest.mark.parametrize("template", [None, TRIMMING_TEMPLATE])
def test_continue_final_message_equals_transformers(
    tokenizer: Tokenizer, hf_tokenizer: Any, content: str, template: str | None
) -> None:
    messages = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": content},
    ]
    ours = tokenizer if template is None else _with_template(tokenizer, template)
    expected = hf_tokenizer.apply_chat_template(
        messages,
        chat_template=template,
        tokenize=False,
        add_generation_prompt=False,
        continue_final_message=True,
    )
    got = ours.apply_chat_template(
        messages, add_generation_prompt=False, continue_final_message=True
    )
    assert got == expected
    assert got.rstrip().endswith(content.strip())
    with pytest.raises(ValueError, match="cannot both be set"):
        ours.apply_chat_template(messages, continue_final_message=True)


def test_continue_final_message_needs_the_text_in_the_chat(tokenizer: Tokenizer) -> None:
    dropping = _with_template(tokenizer, "{% for m in messages %}{{ m['role'] }}\n{% endfor %}")
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure"}]
    with pytest.raises(ValueError, match="does not write the last message"):
        dropping.apply_chat_template(
            messages, add_generation_prompt=False, continue_final_message=True
        )


CUSTOM_TEMPLATE = """
{%- set ns = namespace(count=0) -%}
{{ bos_token }}
{% for message in messages %}
    {% if message['role'] == 'tool' %}{{ raise_exception('tools are not allowed') }}{% endif %}
    {% if loop.index > 3 %}{% break %}{% endif %}
    {% set ns.count = ns.count + 1 %}
    {% generation %}[{{ message['role'] | upper }}] {{ message['content'] | trim }}
    {% endgeneration %}
    {{ message | tojson }}
{% endfor %}
{{ ns.count }} {{ extra | default('none') }} {{ strftime_now('%Y') | length }}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}
"""


def test_custom_template_features_equal_transformers(
    tokenizer: Tokenizer, hf_tokenizer: Any
) -> None:
    messages = [
        {"role": "user", "content": '  é "quoted" <tag> & 😀  '},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "again"},
        {"role": "user", "content": "dropped by break"},
    ]
    custom = _with_template(tokenizer, CUSTOM_TEMPLATE)
    for kwargs in ({}, {"extra": "value"}):
        for prompt in (True, False):
            expected = hf_tokenizer.apply_chat_template(
                messages,
                chat_template=CUSTOM_TEMPLATE,
                tokenize=False,
                add_generation_prompt=prompt,
                **kwargs,
            )
            assert custom.apply_chat_template(messages, add_generation_prompt=prompt, **kwargs) == (
                expected
            )
    with pytest.raises(jinja2.TemplateError, match="tools are not allowed"):
        custom.apply_chat_template([{"role": "tool", "content": "x"}])


def test_errors(tokenizer: Tokenizer) -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tokenizer.decode([1, 49152])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tokenizer.convert_ids_to_tokens([-1])
    with pytest.raises(TypeError, match="expects a str"):
        tokenizer.encode(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="empty conversation"):
        tokenizer.apply_chat_template([])
    with pytest.raises(TypeError, match="must be dicts"):
        tokenizer.apply_chat_template(["hi"])  # type: ignore[list-item]
    plain = Tokenizer(tokenizer.backend, eos_token_ids=[2])
    with pytest.raises(ValueError, match="no chat template"):
        plain.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="at least one end-of-sequence"):
        Tokenizer(tokenizer.backend, eos_token_ids=[])
    with pytest.raises(ValueError, match="bos_token_id 50000 is outside"):
        Tokenizer(tokenizer.backend, eos_token_ids=[2], bos_token_id=50000)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tokenizer.ggml.model": "bert"}, "tokenizer.ggml.model 'bert' is not supported"),
        ({"tokenizer.ggml.model": "llama"}, "tokenizer.ggml.scores is missing"),
        (
            {"tokenizer.ggml.pre": "chatglm-bpe"},
            "tokenizer.ggml.pre 'chatglm-bpe' is not supported",
        ),
        ({"tokenizer.ggml.merges": None}, "merges is missing"),
        ({"tokenizer.ggml.eos_token_id": None}, "eos_token_id is missing"),
        ({"tokenizer.ggml.bos_token_id": 10**6}, "bos_token_id 1000000 is not a token id"),
        ({"tokenizer.ggml.token_type": [1, 3]}, "token_type has 2 entries"),
    ],
)
def test_gguf_metadata_errors(
    default_gguf_metadata: dict[str, Any], change: dict[str, Any], message: str
) -> None:
    metadata = {**tokenizer_metadata(default_gguf_metadata), **change}
    metadata = {k: v for k, v in metadata.items() if v is not None}
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        Tokenizer.from_gguf_metadata(metadata)


# ---------------------------------------------------------------- other GGUF tokenizer settings


@pytest.mark.slow
def test_variant_gguf_equals_transformers(
    default_gguf_metadata: dict[str, Any], tmp_path: Path
) -> None:
    # A Llama-3 style split regex, a BOS added by the tokenizer and a user-defined token: the
    # code paths the default model does not reach, checked against transformers' GGUF import.
    from transformers import AutoTokenizer

    metadata = tokenizer_metadata(default_gguf_metadata)
    metadata["tokenizer.ggml.pre"] = "llama-bpe"
    metadata["tokenizer.ggml.add_bos_token"] = True
    token_types = list(metadata["tokenizer.ggml.token_type"])
    hello = metadata["tokenizer.ggml.tokens"].index("hello")
    token_types[hello] = 4  # USER_DEFINED
    metadata["tokenizer.ggml.token_type"] = token_types
    metadata["llama.context_length"] = 64
    path = write_gguf(tmp_path / "variant.gguf", "llama", metadata, {})

    ours = Tokenizer.from_gguf_metadata(metadata)
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    assert ours.add_bos_token
    for text in TEXTS:
        for add in (True, False):
            assert ours.encode(text, add_special_tokens=add) == theirs.encode(
                text, add_special_tokens=add
            ), text
    assert ours.encode("x")[0] == 1
    assert ours.encode("othello")[-1] == hello  # matched whole, as llama.cpp does
    assert ours.all_special_ids == frozenset(range(17))
    messages = CONVERSATIONS[1]
    assert ours.apply_chat_template(messages, tokenize=True) == list(
        theirs.apply_chat_template(
            messages, tokenize=True, return_dict=False, add_generation_prompt=True
        )
    )


# ---------------------------------------------------------------- Hugging Face folders


def _write_folder(
    directory: Path, tokenizer: Tokenizer, config: dict[str, Any], **files: Any
) -> Path:
    directory.mkdir()
    tokenizer.backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    for name, content in files.items():
        target = directory / name.replace("__", ".")
        target.write_text(content if isinstance(content, str) else json.dumps(content))
    return directory


@pytest.mark.parametrize("add_bos", [True, False])
def test_folder_bos_follows_tokenizer_json_like_transformers(
    tokenizer: Tokenizer, tmp_path: Path, add_bos: bool
) -> None:
    # transformers 5 lets tokenizer.json's post-processor decide and ignores add_bos_token in
    # tokenizer_config.json; the config here says the opposite on purpose.
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers import processors
    from transformers import AutoTokenizer

    backend = BackendTokenizer.from_str(tokenizer.backend.to_str())
    if add_bos:
        backend.post_processor = processors.TemplateProcessing(
            single="<|im_start|>:0 $A:0",
            pair="<|im_start|>:0 $A:0 <|im_start|>:1 $B:1",
            special_tokens=[("<|im_start|>", 1)],
        )
    source = Tokenizer(backend, eos_token_ids=[2])
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "special": True},
        "add_bos_token": not add_bos,
    }
    directory = _write_folder(tmp_path / "tok", source, config)
    ours = Tokenizer.from_files(directory)
    theirs = AutoTokenizer.from_pretrained(directory)
    assert ours.add_bos_token is add_bos
    for text in TEXTS[:8]:
        assert ours.encode(text) == theirs.encode(text)
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(
            text, add_special_tokens=False
        )
    assert (ours.encode("hi")[0] == 1) is add_bos
    assert ours.eos_token_id == 2 and ours.pad_token_id is None and ours.chat_template is None


def test_folder_template_sources_and_generation_eos(tokenizer: Tokenizer, tmp_path: Path) -> None:
    config = {
        "eos_token": "<|im_end|>",
        "chat_template": [
            {"name": "tool_use", "template": "TOOLS"},
            {"name": "default", "template": "{{ messages[0]['content'] }}!"},
        ],
    }
    listed = _write_folder(
        tmp_path / "listed", tokenizer, config, generation_config__json={"eos_token_id": [0, 2]}
    )
    ours = Tokenizer.from_files(listed)
    assert ours.apply_chat_template([{"role": "user", "content": "yo"}]) == "yo!"
    assert ours.eos_token_ids == (2, 0) and ours.eos_token_id == 2
    assert ours.all_special_ids >= {0, 2}

    jinja = _write_folder(
        tmp_path / "jinja", tokenizer, config, chat_template__jinja="{{ eos_token }}"
    )
    assert Tokenizer.from_files(jinja).apply_chat_template([{"role": "user", "content": ""}]) == (
        "<|im_end|>"
    )


def test_folder_errors(tokenizer: Tokenizer, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_files(tmp_path)
    unknown = _write_folder(tmp_path / "unknown", tokenizer, {"eos_token": "<|nope|>"})
    with pytest.raises(ValueError, match=r"eos_token '<\|nope\|>' is not in the vocabulary"):
        Tokenizer.from_files(unknown)
    no_eos = _write_folder(tmp_path / "noeos", tokenizer, {"bos_token": "<|im_start|>"})
    with pytest.raises(ValueError, match="end-of-sequence"):
        Tokenizer.from_files(no_eos)
    broken = _write_folder(tmp_path / "broken", tokenizer, {"eos_token": "<|im_end|>"})
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a valid tokenizers file"):
        Tokenizer.from_files(broken)
