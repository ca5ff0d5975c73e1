"""Incremental detokenisation of a request's output tokens, with stop-string detection.

A request's output grows a few tokens per engine step. ``IncrementalDetokenizer``
turns those tokens into text without decoding the whole sequence each step: it
decodes a short window (the tokens since the last-but-one character boundary plus
the new ones) and keeps the part of the window's text not shown yet (the
prefix-offset / read-offset technique of vLLM and Hugging Face TGI). Byte-level
BPE vocabularies split multi-byte characters across tokens; such a half
character decodes to U+FFFD and is held back until a later token completes it.

Stop strings are searched only in the newly added text plus ``len(stop) - 1``
characters before it, so the work per step does not grow with the output.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

# How many prompt tokens give the first output token its context (a leading space,
# for instance, depends on the token before it); vLLM uses the same number.
_PROMPT_CONTEXT_TOKENS = 5
# A real character spans at most 4 bytes, so real text never leaves this many tokens
# in a row without a character boundary; only garbage (lone UTF-8 lead bytes) does, and
# then the pending text is released as it decodes, replacement characters included,
# to keep the decoded window short.
_MAX_PENDING_TOKENS = 16
# Tokens before the window are dropped from memory once this many pile up.
_TRIM_AT = 1024

_REPLACEMENT_CHAR = "\ufffd"


@runtime_checkable
class DecodeProtocol(Protocol):
    """What the detokenizer needs from a tokenizer: ids -> text.

    ``tokenizers.Tokenizer`` and baton's ``Tokenizer`` wrapper both satisfy it.
    Undecodable bytes must come out as U+FFFD (as ``bytes.decode(errors="replace")``
    does); the detokenizer relies on that to hold back half characters.
    """

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; special tokens are dropped when ``skip_special_tokens``."""
        ...


def find_stop_string(text: str, search_from: int, stop: Sequence[str]) -> tuple[str, int] | None:
    """Find the first stop string that is complete in ``text`` and ends after ``search_from``.

    "First" means the occurrence whose end comes first, ties going to the one that
    starts first: that is the stop a reader streaming the text sees complete first,
    so the answer does not depend on how the text was split into tokens or steps.
    Only ``text[search_from - len(s) + 1:]`` is searched for each stop string ``s``;
    the caller guarantees that no stop string ended before ``search_from``.

    Returns:
        ``(stop_string, start_index)`` of the match, or None.
    """
    best: tuple[int, int, str] | None = None
    for s in stop:
        start = text.find(s, max(search_from - len(s) + 1, 0))
        if start == -1:
            continue
        key = (start + len(s), start, s)
        if best is None or key[:2] < best[:2]:
            best = key
    if best is None:
        return None
    return best[2], best[1]


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text, one step at a time.

    ``output_text`` is the text so far (what the user sees). It never ends in a
    character whose bytes are still incomplete; for byte-level vocabularies it equals
    ``tokenizer.decode(output_ids, skip_special_tokens)`` with trailing U+FFFD held
    back, whatever the sizes of the updates.

    Decoders that change a sequence's first token (SentencePiece's Metaspace drops its
    leading space) see the prompt's last tokens as context, so the first output token
    keeps the space it has after the prompt.
    """

    def __init__(
        self,
        tokenizer: DecodeProtocol,
        prompt_token_ids: Sequence[int] | None,
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        """Start an empty output after ``prompt_token_ids`` (None: no prompt context).

        Args:
            tokenizer: decodes token ids (see ``DecodeProtocol``).
            prompt_token_ids: the prompt; only its last few tokens are used, as context.
            skip_special_tokens: drop special tokens' text, as ``decode`` does.
            stop: stop strings (a single string counts as one stop string).
            include_stop_str_in_output: keep a matched stop string (and a stop-terminating
                token's text) in the output.
            min_tokens: stop strings that end in the text of the first ``min_tokens``
                output tokens are ignored (vLLM's ``min_tokens``).

        Raises:
            ValueError: a tokenizer without ``decode``, an empty or non-string stop
                string, a bad prompt token id, or a negative ``min_tokens``.
        """
        # Not isinstance(tokenizer, DecodeProtocol): a runtime protocol check took ~140 us, a
        # cost paid by every request as it is admitted.
        if not callable(getattr(tokenizer, "decode", None)):
            raise ValueError(
                f"tokenizer must have a decode(ids, skip_special_tokens) method, "
                f"got {type(tokenizer).__name__}"
            )
        if isinstance(stop, str):
            stop = (stop,)
        stops = tuple(stop)
        for s in stops:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must hold non-empty strings, got {s!r}")
        if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {min_tokens!r}")

        self._tokenizer = tokenizer
        self._skip_special_tokens = bool(skip_special_tokens)
        self._stop = stops
        self._include_stop_str_in_output = bool(include_stop_str_in_output)
        self._min_tokens = min_tokens
        # Characters a streamed client must not see yet: they may be the start of a stop
        # string that a later token completes and that will then be cut away.
        self._stop_buffer_length = (
            max(len(s) for s in stops) - 1 if stops and not include_stop_str_in_output else 0
        )

        context = _as_token_ids(prompt_token_ids or (), "prompt_token_ids")
        # Decode window over self._ids: text of _ids[_prefix_offset:] is decoded each step;
        # _read_offset is the last token boundary known to be a character boundary;
        # _emitted is how many characters of the window's text are in output_text.
        self._ids: list[int] = context[-_PROMPT_CONTEXT_TOKENS:]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        context_text = self._decode(self._ids) if self._ids else ""
        if context_text.endswith(_REPLACEMENT_CHAR):
            # The prompt ends in a half character; the output's first bytes would complete
            # it and vanish into the prompt. Decode the output on its own instead.
            self._ids, self._read_offset, context_text = [], 0, ""
        self._emitted = len(context_text)

        self._text = ""
        self._num_output_tokens = 0
        self._last_output_text_offset = 0
        self._finished = False
        self._stop_reason: str | None = None

    @property
    def output_text(self) -> str:
        """The output text so far (after any stop-string cut)."""
        return self._text

    @property
    def num_output_tokens(self) -> int:
        """How many output tokens were given to ``update``, a stop-terminating one included."""
        return self._num_output_tokens

    @property
    def stop_reason(self) -> str | None:
        """The stop string that ended the output, or None."""
        return self._stop_reason

    @property
    def finished(self) -> bool:
        """True once a stop string matched or a stop-terminated update came in."""
        return self._finished

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool = False) -> str | None:
        """Append output tokens, extend ``output_text`` and look for stop strings.

        Args:
            new_token_ids: the tokens sampled since the last call, in order (may be empty).
            stop_terminated: the last of ``new_token_ids`` is EOS or a stop token; its
                text is not shown unless ``include_stop_str_in_output`` (vLLM's rule; with
                ``skip_special_tokens`` a special EOS has no text anyway). It still counts
                in ``num_output_tokens``.

        Returns:
            The stop string that matched, or None. On a match ``output_text`` is cut
            before the stop string (after it with ``include_stop_str_in_output``) and the
            detokenizer is finished; the caller finishes the request with finish reason
            "stop" and this string as the stop reason.

        Raises:
            ValueError: a token id that is not an int >= 0.
            RuntimeError: the detokenizer already finished (stop string or
                stop-terminated update).
        """
        if self._finished:
            raise RuntimeError(
                "update() called on a finished detokenizer "
                f"(stop reason {self._stop_reason!r}); the request is already done"
            )
        ids = _as_token_ids(new_token_ids, "new_token_ids")
        if not ids:
            return None
        skipped_stop_token = stop_terminated and not self._include_stop_str_in_output
        if skipped_stop_token:
            ids.pop()

        # Text of the first min_tokens tokens cannot end a stop string: decode them apart
        # so that the search starts right after their text.
        check_from = len(self._text)
        before_min = self._min_tokens - self._num_output_tokens
        if before_min > 0 and ids:
            self._append(ids[:before_min])
            ids = ids[before_min:]
            check_from = len(self._text)
        if ids:
            self._append(ids)
        if skipped_stop_token:
            self._num_output_tokens += 1
        if stop_terminated:
            self._finished = True

        if (
            not self._stop
            or self._num_output_tokens <= self._min_tokens
            or len(self._text) == check_from
        ):
            return None
        match = find_stop_string(self._text, check_from, self._stop)
        if match is None:
            return None
        stop_string, start = match
        end = start + len(stop_string) if self._include_stop_str_in_output else start
        self._text = self._text[:end]
        self._finished = True
        self._stop_reason = stop_string
        return stop_string

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text to show the user now.

        While not ``finished`` the last (longest stop string - 1) characters are held
        back, so a streaming client never sees text that a stop string later removes.

        Args:
            finished: the request is done; nothing is held back.
            delta: return only the text added since the previous delta call (streaming);
                otherwise the whole text shown so far.
        """
        buffer_length = 0 if finished else self._stop_buffer_length
        length = max(len(self._text) - buffer_length, 0)
        if not delta:
            return self._text[:length]
        last = self._last_output_text_offset
        if last >= length:
            return ""
        self._last_output_text_offset = length
        return self._text[last:length]

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _append(self, ids: list[int]) -> None:
        """Add tokens to the window and append their completed characters to the text."""
        self._num_output_tokens += len(ids)
        checked = len(self._ids)
        self._ids.extend(ids)
        window = self._decode(self._ids[self._prefix_offset :])
        stable = window.rstrip(_REPLACEMENT_CHAR)
        boundary: int | None = len(self._ids)
        if len(stable) != len(window):
            boundary = self._find_boundary(checked)
            if boundary is None and len(self._ids) - self._read_offset > _MAX_PENDING_TOKENS:
                stable, boundary = window, len(self._ids)
        if len(stable) > self._emitted:
            self._text += stable[self._emitted :]
            self._emitted = len(stable)
        if boundary is not None:
            self._advance(boundary, pending=len(window) - self._emitted)

    def _find_boundary(self, checked: int) -> int | None:
        """The last character boundary among the newest tokens, or None.

        The window's text ends in a half character, whose bytes lie in the last three
        tokens at most; token ends up to ``checked`` were looked at by earlier calls.
        """
        lowest = max(self._read_offset, checked, len(self._ids) - 4)
        for end in range(len(self._ids) - 1, lowest, -1):
            if not self._decode(self._ids[self._prefix_offset : end]).endswith(_REPLACEMENT_CHAR):
                return end
        return None

    def _advance(self, boundary: int, pending: int) -> None:
        """Slide the window: it now starts at the old read offset and reads from ``boundary``.

        ``pending`` characters at the end of the old window's text are not shown yet; the
        new window's text ends with the same characters, since both windows start on a
        character boundary and end on the same tokens.
        """
        self._prefix_offset, self._read_offset = self._read_offset, boundary
        window = self._decode(self._ids[self._prefix_offset :])
        self._emitted = max(len(window) - pending, 0)
        if self._prefix_offset >= _TRIM_AT:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0


def _as_token_ids(ids: Sequence[int], name: str) -> list[int]:
    """``ids`` as a list of Python ints, each >= 0."""
    try:
        out = [operator.index(t) for t in ids]
    except TypeError as exc:
        raise ValueError(f"{name} must be a sequence of ints >= 0, got {ids!r}") from exc
    for t in out:
        if t < 0:
            raise ValueError(f"{name} must hold token ids >= 0, got {t}")
    return out
