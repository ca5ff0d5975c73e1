"""Engine logprobs (one ``{token id: Logprob}`` dict per position) in OpenAI's two shapes:
chat's ``{"content": [...]}`` and completions' parallel lists."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from baton.engine.outputs import Logprob

# JSON has no -inf: a token masked out by a grammar reports this instead (as vLLM does).
_MIN_LOGPROB = -9999.0


def _finite(value: float) -> float:
    return value if math.isfinite(value) else _MIN_LOGPROB


def _text(lp: Logprob | None, token_id: int) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return f"token_id:{token_id}"


def _top(entry: dict[int, Logprob], n: int) -> list[tuple[int, Logprob]]:
    return sorted(entry.items(), key=lambda kv: kv[1].logprob, reverse=True)[:n]


def chat_logprobs(
    token_ids: Sequence[int], entries: Sequence[dict[int, Logprob]], top_n: int
) -> list[dict[str, Any]]:
    """The ``logprobs.content`` list of a chat choice for these sampled tokens."""
    content = []
    for tid, entry in zip(token_ids, entries, strict=False):
        lp = entry.get(tid)
        text = _text(lp, tid)
        content.append(
            {
                "token": text,
                "logprob": _finite(lp.logprob) if lp is not None else _MIN_LOGPROB,
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": [
                    {
                        "token": _text(t, t_id),
                        "logprob": _finite(t.logprob),
                        "bytes": list(_text(t, t_id).encode("utf-8")),
                    }
                    for t_id, t in _top(entry, top_n)
                ],
            }
        )
    return content


def completion_logprobs(
    token_ids: Sequence[int],
    entries: Sequence[dict[int, Logprob] | None],
    top_n: int,
    text_offset: int = 0,
    decode: Callable[[int], str] | None = None,
) -> dict[str, Any]:
    """A completion choice's ``logprobs``: tokens, token_logprobs, top_logprobs and
    text_offset (offsets start at ``text_offset``). A None entry (an echoed prompt's first
    token, which has no logprob) gets null logprobs and its text from ``decode``."""
    tokens, values, tops, offsets = [], [], [], []
    offset = text_offset
    for tid, entry in zip(token_ids, entries, strict=False):
        if entry is None:
            text = decode(tid) if decode is not None else _text(None, tid)
            tokens.append(text)
            values.append(None)
            tops.append(None)
        else:
            lp = entry.get(tid)
            text = _text(lp, tid)
            tokens.append(text)
            values.append(_finite(lp.logprob) if lp is not None else _MIN_LOGPROB)
            tops.append({_text(t, t_id): _finite(t.logprob) for t_id, t in _top(entry, top_n)})
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def prompt_logprobs_json(
    prompt_logprobs: Sequence[dict[int, Logprob] | None],
) -> list[dict[str, dict[str, Any]] | None]:
    """A response's ``prompt_logprobs`` as vLLM writes it: null for the first prompt token,
    then per token ``{token id: {"logprob", "rank", "decoded_token"}}``."""
    return [
        None
        if entry is None
        else {
            str(tid): {
                "logprob": _finite(lp.logprob),
                "rank": lp.rank,
                "decoded_token": lp.decoded_token,
            }
            for tid, lp in entry.items()
        }
        for entry in prompt_logprobs
    ]
