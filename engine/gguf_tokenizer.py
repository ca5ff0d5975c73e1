"""A GGUF file's tokenizer as a Hugging Face ``tokenizers.Tokenizer``, from its metadata.

llama.cpp stores no tokenizer.json: the vocabulary, merges, scores, token types and special ids
are metadata under ``tokenizer.ggml.*``. Two kinds are built here, each to tokenize exactly as
transformers does for the same file:
- "gpt2", byte-level BPE (Llama 3, Qwen, SmolLM, ...): built here, with transformers' table of
  split regexes per ``tokenizer.ggml.pre``;
- "llama", SentencePiece BPE with byte fallback (Llama 2, Mistral up to v0.3, Phi-3): built
  by transformers' own GGUF converter (``integrations.gguf``), which knows each family's
  normaliser and pre-tokenizer.
``Tokenizer.from_gguf_metadata`` wraps the result with the special ids ``gguf_specials`` reads.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from baton.grammar.vocab import byte_to_unicode

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Split regexes for `tokenizer.ggml.pre` values that do not use GPT-2's. Same table as
# transformers' GGUF loader (integrations/gguf/gguf_tokenizer_mapping.py), so ids agree with it.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_SPLITS: dict[str, str] = {
    **dict.fromkeys(
        (
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
            "dbrx",
            "smaug-bpe",
        ),
        _LLAMA3_SPLIT,
    ),
    **dict.fromkeys(
        ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"),
        _QWEN2_SPLIT,
    ),
    "qwen35": _QWEN35_SPLIT,
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}
# `pre` values tokenized with GPT-2's own regex (ByteLevel(use_regex=True)), as transformers does.
# llama.cpp additionally splits every digit apart for smollm/starcoder/refact/command-r/
# codeshell/exaone/minerva; that differs from transformers only on whitespace right before a
# digit, and transformers is the reference baton is checked against.
_GPT2_REGEX_PRE_TYPES = frozenset(
    {
        "default",
        "gpt2",
        "gpt-2",
        "mpt",
        "olmo",
        "jais",
        "trillion",
        "smollm",
        "starcoder",
        "refact",
        "command-r",
        "codeshell",
        "exaone",
        "minerva-7b",
    }
)
SUPPORTED_GGUF_PRE_TYPES = tuple(sorted(_GPT2_REGEX_PRE_TYPES | set(_PRE_TOKENIZER_SPLITS)))

SUPPORTED_GGUF_MODELS = ("gpt2", "llama")

# A character outside GPT-2's byte alphabet: a token with one is stored as raw text. (A regex
# search over 128k tokens took half the time of building a set of each token's characters.)
_OUTSIDE_BYTE_ALPHABET = re.compile(
    "[^" + "".join(re.escape(c) for c in sorted(set(byte_to_unicode().values()))) + "]"
)


def gguf_backend(
    metadata: Mapping[str, Any], specials: GgufSpecials
) -> tuple[BackendTokenizer, frozenset[int] | None]:
    """The tokenizer ``tokenizer.ggml.model`` names, its control tokens (and ``specials``'
    named tokens) special and its user-defined ones added (no BOS/EOS post-processor: the
    caller sets that); and the ids it made special, where known (None: ask the backend).

    Raises:
        ValueError: another tokenizer model or ``pre`` type, or missing or inconsistent
            vocabulary data (naming the key).
    """
    kind = metadata.get("tokenizer.ggml.model")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if kind not in SUPPORTED_GGUF_MODELS:
        raise ValueError(
            f"tokenizer.ggml.model {kind!r} is not supported; expected 'gpt2' (byte-level BPE) "
            "or 'llama' (SentencePiece)"
        )
    if not isinstance(tokens, list) or not tokens:
        raise ValueError("tokenizer.ggml.tokens is missing or empty")
    token_types = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(token_types) != len(tokens):
        raise ValueError(
            f"tokenizer.ggml.token_type has {len(token_types)} entries, "
            f"expected one per token ({len(tokens)})"
        )
    if kind == "llama":
        return _sentencepiece(metadata, tokens, token_types), None
    return _byte_level(metadata, tokens, token_types, specials)


def _sentencepiece(
    metadata: Mapping[str, Any], tokens: list[str], token_types: Sequence[int]
) -> BackendTokenizer:
    scores = metadata.get("tokenizer.ggml.scores")
    if not isinstance(scores, list) or len(scores) != len(tokens):
        raise ValueError(
            "tokenizer.ggml.scores is missing or not one per token (a SentencePiece vocabulary "
            "derives its merges from them)"
        )
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
    except ImportError as exc:  # transformers 4 has another GGUF API
        raise ValueError(
            "a SentencePiece GGUF tokenizer needs transformers >= 5 (its GGUF converter)"
        ) from exc
    data: dict[str, Any] = {
        "tokenizer_type": "llama",
        "tokens": tokens,
        "scores": scores,
        "token_type": list(token_types),
    }
    if isinstance(metadata.get("tokenizer.ggml.merges"), list):
        data["merges"] = metadata["tokenizer.ggml.merges"]
    architecture = str(metadata.get("general.architecture", ""))
    backend, _ = convert_gguf_tokenizer(architecture, data)
    return backend


def _byte_level(
    metadata: Mapping[str, Any],
    tokens: list[str],
    token_types: Sequence[int],
    specials: GgufSpecials,
) -> tuple[BackendTokenizer, frozenset[int]]:
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in _GPT2_REGEX_PRE_TYPES and pre not in _PRE_TOKENIZER_SPLITS:
        raise ValueError(
            f"tokenizer.ggml.pre {pre!r} is not supported; expected one of "
            f"{', '.join(SUPPORTED_GGUF_PRE_TYPES)}"
        )
    merges = metadata.get("tokenizer.ggml.merges")
    if not isinstance(merges, list):
        raise ValueError("tokenizer.ggml.merges is missing (a byte-level BPE needs its merges)")
    # A byte-level vocabulary spells every token in GPT-2's byte alphabet; respell the few
    # that llama.cpp stored as raw text (transformers does the same).
    byte_map = byte_to_unicode()
    outside = _OUTSIDE_BYTE_ALPHABET.search
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        spelled = (
            token if outside(token) is None else "".join(byte_map[b] for b in token.encode("utf-8"))
        )
        vocab.setdefault(spelled, index)
    if len(vocab) != len(tokens):
        raise ValueError("tokenizer.ggml.tokens contains duplicate tokens")
    pairs: list[tuple[str, str]] = []
    for merge in merges:
        parts = merge.split(" ")
        if len(parts) != 2:
            raise ValueError(f"tokenizer.ggml.merges entry {merge!r} is not two tokens")
        pairs.append((parts[0], parts[1]))
    backend = BackendTokenizer(
        models.BPE(
            vocab=vocab,
            merges=pairs,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    split = _PRE_TOKENIZER_SPLITS.get(pre)
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    # Control tokens become special added tokens so text containing them maps to one id; a
    # "control" token outside the byte alphabet is a llama.cpp mislabel (transformers skips
    # those too). The named special tokens are special whatever their type.
    named = {i for i in (specials.bos_token_id, specials.unk_token_id, specials.pad_token_id)}
    named.add(specials.eos_token_ids[0])
    special_ids = [
        index
        for index, (token, kind) in enumerate(zip(tokens, token_types, strict=True))
        if (kind == _TOKEN_TYPE_CONTROL and outside(token) is None) or index in named
    ]
    if special_ids:
        backend.add_special_tokens(
            [AddedToken(tokens[i], normalized=False, special=True) for i in special_ids]
        )
    user_defined = [
        AddedToken(token, normalized=False, special=False)
        for token, kind in zip(tokens, token_types, strict=True)
        if kind == _TOKEN_TYPE_USER_DEFINED and token in vocab
    ]
    if user_defined:
        backend.add_tokens(user_defined)
    return backend, frozenset(special_ids)


@dataclass(frozen=True)
class GgufSpecials:
    """A GGUF tokenizer's special ids, BOS/EOS flags and chat template."""

    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # eos, then eot and eom where set
    unk_token_id: int | None
    pad_token_id: int | None
    add_bos: bool
    add_eos: bool
    bos_token: tuple[str, int] | None  # (text, id) where add_bos, for the post-processor
    eos_token: tuple[str, int] | None  # (text, id) where add_eos
    chat_template: str | None


def gguf_specials(metadata: Mapping[str, Any]) -> GgufSpecials:
    """The special ids and flags of ``metadata``. A SentencePiece ("llama") vocabulary that
    does not say adds BOS, as llama.cpp and transformers do.

    Raises:
        ValueError: an id that is no token of the vocabulary, or no EOS id.
    """
    tokens = metadata.get("tokenizer.ggml.tokens") or []

    def special_id(key: str) -> int | None:
        value = metadata.get(f"tokenizer.ggml.{key}")
        if value is None:
            return None
        if not isinstance(value, int) or not 0 <= value < len(tokens):
            raise ValueError(f"tokenizer.ggml.{key} {value!r} is not a token id")
        return value

    bos, eos, unk, pad = (
        special_id(k)
        for k in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id")
    )
    if eos is None:
        raise ValueError("tokenizer.ggml.eos_token_id is missing")
    extra_eos = [
        e for e in (special_id("eot_token_id"), special_id("eom_token_id")) if e is not None
    ]
    spm = metadata.get("tokenizer.ggml.model") == "llama"
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", spm)) and bos is not None
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    template = metadata.get("tokenizer.chat_template")
    return GgufSpecials(
        bos_token_id=bos,
        eos_token_ids=tuple(dict.fromkeys([eos, *extra_eos])),
        unk_token_id=unk,
        pad_token_id=pad,
        add_bos=add_bos,
        add_eos=add_eos,
        bos_token=(tokens[bos], bos) if add_bos and bos is not None else None,
        eos_token=(tokens[eos], eos) if add_eos else None,
        chat_template=template if isinstance(template, str) else None,
    )
