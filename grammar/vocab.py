"""The tokenizer's vocabulary as raw bytes: what grammar backends match against."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Protocol


class VocabSource(Protocol):
    """What the grammar layer needs from a tokenizer (baton's ``Tokenizer`` fits)."""

    backend: object  # a tokenizers.Tokenizer
    all_special_ids: frozenset[int]
    eos_token_ids: tuple[int, ...]

    def token_strings(self) -> Sequence[str]: ...


@dataclass(frozen=True)
class Vocab:
    """Token bytes by id, with the ids that no grammar may ever produce.

    Attributes:
        token_bytes: raw bytes of each token id (special tokens: their text).
        special_ids: control tokens (never allowed inside a grammar).
        eos_token_ids: the ids that end a sequence.
        vocab_type: "byte_level" (GPT-2 style), "byte_fallback" (SentencePiece) or "raw".
        key: identifies the vocabulary, for compile-cache keys.
        tokenizer_json: the tokenizer's own serialization (Hugging Face ``tokenizers`` JSON),
            for backends that tokenize themselves (llguidance); None when unknown.
    """

    token_bytes: tuple[bytes, ...]
    special_ids: frozenset[int]
    eos_token_ids: tuple[int, ...]
    vocab_type: str
    key: str
    tokenizer_json: str | None = field(default=None, repr=False, compare=False)

    @property
    def size(self) -> int:
        return len(self.token_bytes)


@lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (the byte-level alphabet)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    return {c: b for b, c in byte_to_unicode().items()}


_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def build_vocab(tokenizer: VocabSource | Vocab) -> Vocab:
    """Reads the vocabulary's bytes from a tokenizer (a ``Vocab`` is returned as it is, so
    that a vocabulary read once can build several backends, in compile workers too).

    Byte-level BPE (GPT-2, SmolLM, Llama 3, Qwen2) maps each character back to
    a byte; SentencePiece vocabularies turn "▁" into a space and "<0xNN>" into
    that byte.

    Raises:
        ValueError: a byte-level token holds a character outside the byte alphabet.
    """
    if isinstance(tokenizer, Vocab):
        return tokenizer
    strings = tokenizer.token_strings()
    tokenizer_json = tokenizer.backend.to_str()  # type: ignore[attr-defined]
    config = json.loads(tokenizer_json)
    decoder = config.get("decoder") or {}
    kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders", [])}
    special = frozenset(tokenizer.all_special_ids)
    added = {t["id"] for t in config.get("added_tokens", [])}
    out: list[bytes] = []
    if "ByteLevel" in kinds:
        vocab_type = "byte_level"
        table = _byte_decoder()
        for i, s in enumerate(strings):
            if i in special or i in added:
                out.append(s.encode())
                continue
            try:
                out.append(bytes(table[c] for c in s))
            except KeyError as exc:
                raise ValueError(f"token {i} ({s!r}) is not byte-level: {exc}") from None
    else:
        vocab_type = "byte_fallback" if "ByteFallback" in kinds else "raw"
        for s in strings:
            m = _BYTE_TOKEN.match(s)
            out.append(bytes([int(m.group(1), 16)]) if m else s.replace("▁", " ").encode())
    digest = hashlib.sha1(b"\x00".join(out)).hexdigest()[:16]
    key = f"{vocab_type}:{len(out)}:{digest}"
    eos = tuple(tokenizer.eos_token_ids)
    return Vocab(tuple(out), special, eos, vocab_type, key, tokenizer_json)
