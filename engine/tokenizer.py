"""Text <-> token ids and chat templates, over a Hugging Face ``tokenizers.Tokenizer``.

A ``Tokenizer`` is built either from a GGUF file's metadata (``from_gguf_metadata``) or from a
Hugging Face folder (``from_files``). Both aim to tokenize exactly as transformers does for the
same source, so that baton and transformers see the same ids.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import processors

from baton.engine.gguf_tokenizer import gguf_backend, gguf_specials


class _GenerationTag(jinja2.ext.Extension):
    """Accepts transformers' ``{% generation %}...{% endgeneration %}`` blocks and renders their
    body unchanged (transformers uses them only to build assistant masks)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the same sandboxed environment transformers uses."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


@lru_cache(maxsize=16)
def chat_template_variables(source: str) -> frozenset[str]:
    """The variables a chat template reads that it does not set itself (``messages``,
    ``add_generation_prompt``, ``reasoning_effort``, ...), found in its source text.

    Raises:
        jinja2.TemplateSyntaxError: the template does not parse.
    """
    env = _compile_chat_template(source).environment
    return frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))


def _special_token_content(value: Any) -> str | None:
    # tokenizer_config.json writes a special token as a string or as an AddedToken dict.
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"special token must be a string or a dict with 'content', got {value!r}")


def _id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return list(value)
    raise ValueError(f"expected a token id or a list of token ids, got {value!r}")


def _bos_eos_post_processor(
    bos: tuple[str, int] | None, eos: tuple[str, int] | None
) -> processors.TemplateProcessing:
    """The post-processor transformers builds for explicit add_bos_token / add_eos_token."""
    head = f"{bos[0]}:0 " if bos else ""
    tail = f" {eos[0]}:0" if eos else ""
    single = f"{head}$A:0{tail}"
    pair = (
        f"{single}{(' ' + bos[0] + ':1') if bos else ''} $B:1{(' ' + eos[0] + ':1') if eos else ''}"
    )
    return processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[t for t in (bos, eos) if t is not None]
    )


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus the special ids and chat template of one model.

    Attributes are read-only by convention. ``vocab_size`` counts every id the tokenizer can
    produce, added tokens included. ``eos_token_ids`` holds every id that ends a generation;
    ``eos_token_id`` is the first of them. ``special_ids``: the ids the backend holds as special
    tokens where the caller knows them (None: read from the backend); ``all_special_ids`` adds
    the named ones. Constructors raise ``ValueError`` for inconsistent input (unknown special
    ids, no end-of-sequence token).
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        eos_token_ids: Sequence[int],
        bos_token_id: int | None = None,
        pad_token_id: int | None = None,
        unk_token_id: int | None = None,
        chat_template: str | None = None,
        add_bos_token: bool = False,
        special_ids: Collection[int] | None = None,
    ) -> None:
        self.backend = backend
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        eos = tuple(dict.fromkeys(eos_token_ids))
        if not eos:
            raise ValueError("a tokenizer needs at least one end-of-sequence token id")
        for name, value in (
            ("bos_token_id", bos_token_id),
            ("pad_token_id", pad_token_id),
            ("unk_token_id", unk_token_id),
            *(("eos_token_ids", e) for e in eos),
        ):
            if value is not None and not 0 <= value < self.vocab_size:
                raise ValueError(f"{name} {value} is outside the vocabulary [0, {self.vocab_size})")
        if add_bos_token and bos_token_id is None:
            raise ValueError("add_bos_token is set but the tokenizer has no BOS token")
        self.bos_token_id: int | None = bos_token_id
        self.eos_token_ids: tuple[int, ...] = eos
        self.eos_token_id: int = eos[0]
        self.pad_token_id: int | None = pad_token_id
        self.unk_token_id: int | None = unk_token_id
        self.chat_template: str | None = chat_template
        self.add_bos_token: bool = add_bos_token
        # The caller that built the backend may know its special ids: asking the backend
        # builds an object per added token (79k in the bench's padded GGUF vocabularies).
        if special_ids is None:
            special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        else:
            special = set(special_ids)
        special.update(i for i in (bos_token_id, pad_token_id, unk_token_id, *eos) if i is not None)
        self.all_special_ids: frozenset[int] = frozenset(special)
        self._token_strings: tuple[str, ...] | None = None

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """Build the tokenizer a GGUF file describes, from its metadata as plain Python values.

        Supports ``tokenizer.ggml.model`` "gpt2" (byte-level BPE, with the ``pre`` types in
        ``gguf_tokenizer.SUPPORTED_GGUF_PRE_TYPES``) and "llama" (SentencePiece BPE with byte
        fallback: Llama 2, Mistral up to v0.3, Phi-3; built by transformers' GGUF converter).
        Raises ``ValueError`` naming the key for another model or pre-tokenizer, or for
        missing/inconsistent vocabulary data.
        """
        specials = gguf_specials(metadata)
        backend, special_ids = gguf_backend(metadata, specials)
        if specials.add_bos or specials.add_eos:
            backend.post_processor = _bos_eos_post_processor(specials.bos_token, specials.eos_token)
        else:  # transformers' SentencePiece class brings its own BOS template
            backend.post_processor = None
        return cls(
            backend,
            eos_token_ids=specials.eos_token_ids,
            bos_token_id=specials.bos_token_id,
            pad_token_id=specials.pad_token_id,
            unk_token_id=specials.unk_token_id,
            chat_template=specials.chat_template,
            add_bos_token=specials.add_bos,
            special_ids=special_ids,
        )

    @classmethod
    def from_files(cls, directory: str | Path) -> Tokenizer:
        """Build the tokenizer of a Hugging Face model folder.

        Reads ``tokenizer.json`` (required; its post-processor decides whether a BOS is added),
        and when present ``tokenizer_config.json`` (special tokens, chat_template),
        ``chat_template.jinja`` and
        ``generation_config.json`` (extra end-of-sequence ids). Raises ``FileNotFoundError`` when
        tokenizer.json is missing and ``ValueError`` for contents it cannot use.
        """
        directory = Path(directory)
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"{tokenizer_file} not found (expected a tokenizers JSON file)")
        try:
            backend = BackendTokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust library raises a bare Exception
            raise ValueError(f"{tokenizer_file} is not a valid tokenizers file: {exc}") from exc
        config = _read_json(directory / "tokenizer_config.json")
        generation = _read_json(directory / "generation_config.json")

        def token_id(field: str) -> int | None:
            content = _special_token_content(config.get(field))
            if content is None:
                return None
            index = backend.token_to_id(content)
            if index is None:
                raise ValueError(
                    f"{directory / 'tokenizer_config.json'}: {field} {content!r} is not in the "
                    "vocabulary"
                )
            return index

        bos, eos, pad, unk = (
            token_id(f) for f in ("bos_token", "eos_token", "pad_token", "unk_token")
        )
        eos_ids = ([eos] if eos is not None else []) + _id_list(generation.get("eos_token_id"))
        if bos is None and isinstance(generation.get("bos_token_id"), int):
            bos = generation["bos_token_id"]

        # As in transformers 5, tokenizer.json's post-processor alone decides whether a BOS is
        # added; add_bos_token / add_eos_token in tokenizer_config.json are ignored.
        probe = backend.encode("", add_special_tokens=True).ids
        add_bos_token = bos is not None and probe[:1] == [bos]

        template: Any = None
        jinja_file = directory / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        else:
            template = config.get("chat_template")
            if isinstance(template, list):
                # The list form holds named templates; "default" is the one transformers uses.
                named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
                template = named.get("default")
        if template is not None and not isinstance(template, str):
            raise ValueError(f"{directory}: chat_template must be a string, got {type(template)}")
        return cls(
            backend,
            eos_token_ids=eos_ids,
            bos_token_id=bos,
            pad_token_id=pad,
            unk_token_id=unk,
            chat_template=template,
            add_bos_token=add_bos_token,
        )

    # ------------------------------------------------------------------ encoding

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. Special tokens written in the text map to their ids; with
        ``add_special_tokens`` the tokenizer's BOS (when it adds one) is prepended."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; special tokens are left out when ``skip_special_tokens``. Raises
        ``ValueError`` for an id outside the vocabulary."""
        ids = self._checked_ids(ids)
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """The vocabulary strings of ``ids`` (byte-level spelling, e.g. ``"Ġthe"``)."""
        strings = self.token_strings()
        return [strings[i] for i in self._checked_ids(ids)]

    def token_strings(self) -> tuple[str, ...]:
        """Every vocabulary string indexed by id, added tokens included (for grammar backends).

        Computed once and cached.
        """
        if self._token_strings is None:
            strings = [""] * self.vocab_size
            for token, index in self.backend.get_vocab(with_added_tokens=True).items():
                strings[index] = token
            # A tuple of strings, which the garbage collector stops tracking: a list of the
            # 49,152 strings was walked by every full collection on the engine thread.
            self._token_strings = tuple(strings)
        return self._token_strings

    def _checked_ids(self, ids: Sequence[int]) -> list[int]:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(
                f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})"
            )
        return ids

    # ------------------------------------------------------------------ chat

    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens as strings (``bos_token``, ``eos_token``, ...), the variables
        transformers hands every chat template."""
        named = {
            "bos_token": self.bos_token_id,
            "eos_token": self.eos_token_id,
            "unk_token": self.unk_token_id,
            "pad_token": self.pad_token_id,
        }
        return {k: self.backend.id_to_token(v) for k, v in named.items() if v is not None}

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render ``messages`` with the chat template, as transformers' ``apply_chat_template``.

        Extra keyword arguments (``tools``, ``documents``, anything the template reads) are passed
        to the template and override the special-token variables. Keys whose value is None are
        dropped from each message. With ``continue_final_message`` the text ends where the last
        message's content ends (its end-of-turn markup cut off), so generation continues that
        message. With ``tokenize`` the text is encoded without adding special tokens. Raises
        ``ValueError`` when there is no template or no message, when ``continue_final_message``
        comes with ``add_generation_prompt`` or the template does not write the last message's
        text, ``TypeError`` for a message that is not a dict and ``jinja2.TemplateError`` when
        the template rejects the chat. ``chat_template``: a template to use instead of the
        tokenizer's own (``baton serve --chat-template``).
        """
        template = chat_template if chat_template is not None else self.chat_template
        if template is None:
            raise ValueError("this tokenizer has no chat template")
        if not messages:
            raise ValueError("cannot apply a chat template to an empty conversation")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be set")
        chat = []
        for message in messages:
            if not isinstance(message, Mapping):
                raise TypeError(f"chat messages must be dicts, got {message!r}")
            chat.append({k: v for k, v in message.items() if v is not None})
        variables: dict[str, Any] = {"tools": None, "documents": None}
        variables.update(self.special_tokens_map())
        variables.update(kwargs)
        text = _compile_chat_template(template).render(
            messages=chat, add_generation_prompt=add_generation_prompt, **variables
        )
        if continue_final_message:
            text = _up_to_final_message(text, chat[-1].get("content"))
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos_token_id={self.bos_token_id}, "
            f"eos_token_ids={self.eos_token_ids}, add_bos_token={self.add_bos_token})"
        )


def _up_to_final_message(text: str, content: Any) -> str:
    """``text`` (a rendered chat) cut right after the last message's ``content``: templates may
    strip the content, so it is looked for stripped, and its leading and trailing spaces are
    kept only where the template kept them (transformers' rule)."""
    if not isinstance(content, str):
        raise ValueError("continue_final_message needs the last message's content as text")
    stripped = content.strip()
    at = text.rfind(stripped)
    if not stripped or at < 0:
        raise ValueError(
            "continue_final_message: the chat template does not write the last message's text"
        )
    kept = content.lstrip()
    if text[at : at + len(kept)] == kept:
        return text[: at + len(kept)]
    return text[: at + len(stripped)]


def _read_json(path: Path) -> dict[str, Any]:
    """The object in ``path``, or {} when the file does not exist."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data
