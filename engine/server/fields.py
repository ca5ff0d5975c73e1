"""Request fields baton does not implement: accepted when they change nothing, a 400 naming
them when they would change the answer.

OpenAI's API itself refuses arguments it does not know, so a client written for it sends only
its documented fields; a client written for vLLM adds vLLM's. Every such field that the
request models do not declare is listed here, either as harmless (it changes neither the
tokens nor the response: bookkeeping, caching hints, latency hints) or as refused unless it
holds its neutral value (the value that asks for nothing: null, false, an empty list, the
default). Any other field is a 400 too: an unknown field may be a misspelt one, and answering
as if it were absent is what this module exists to prevent.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from baton.engine.server.errors import bad_request
from baton.engine.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ResponsesRequest,
)

# Fields that do not change what the client gets back.
HARMLESS: frozenset[str] = frozenset(
    {
        # OpenAI: bookkeeping and routing.
        "store",
        "metadata",
        "service_tier",
        "safety_identifier",
        # OpenAI: caching and speed hints (a predicted output changes latency, not tokens).
        "prompt_cache_key",
        "prompt_cache_retention",
        "prompt_cache_options",
        "prediction",
        # vLLM: request bookkeeping and scheduling.
        "request_id",
        "priority",
        "cache_salt",
    }
)


def _is(value: Any) -> Any:
    return lambda v: v == value


def _empty(v: Any) -> bool:
    return v in ({}, [], "")


def _text_only(v: Any) -> bool:
    return v == ["text"]


def _one(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isclose(v, 1.0)


# Refused fields: why, and the values that ask for nothing (null always does).
_CHAT_REFUSED: dict[str, tuple[str, Any]] = {
    "functions": ("functions (the legacy form of tools) is not supported; use tools", _empty),
    "function_call": ("function_call is not supported; use tool_choice", _is("none")),
    "audio": ("audio output is not supported", _empty),
    "modalities": ("only the text modality is supported", _text_only),
    # "medium" is OpenAI's default (and what /v1/responses takes in text.verbosity).
    "verbosity": ("verbosity is not supported (only its default, 'medium')", _is("medium")),
    "web_search_options": ("web search is not supported", lambda v: False),
    "moderation": ("moderation is not supported", lambda v: False),
    "documents": ("documents are not supported", _empty),
    "echo": ("echo is not supported", _is(False)),
}
_COMPLETION_REFUSED: dict[str, tuple[str, Any]] = {
    "suffix": ("suffix is not supported", _empty),
}
# Responses API fields that baton does not implement (``store``, ``previous_response_id``,
# ``include`` and the rest are declared by ``ResponsesRequest``).
_RESPONSES_REFUSED: dict[str, tuple[str, Any]] = {
    "background": ("background responses are not supported", _is(False)),
    "conversation": ("conversations are not supported; use previous_response_id", lambda v: False),
    "prompt": ("prompt templates are not supported", lambda v: False),
    "max_tool_calls": ("max_tool_calls is not supported", lambda v: False),
    "prompt_logprobs": (
        "prompt_logprobs is not supported on /v1/responses (use /v1/completions or "
        "/v1/chat/completions)",
        lambda v: False,
    ),
    "truncation": ("truncation 'auto' is not supported", _is("disabled")),
    # Obfuscation pads the events; it changes no output.
    "stream_options": (
        "stream_options: only include_obfuscation is supported on /v1/responses",
        lambda v: isinstance(v, dict) and set(v) <= {"include_obfuscation"},
    ),
    # OpenAI's Responses API has none; chat and completions take it.
    "logit_bias": (
        "logit_bias is not a Responses API field (use /v1/chat/completions or /v1/completions)",
        _empty,
    ),
}
# vLLM's sampling extras that baton does not implement, on both endpoints.
_VLLM_REFUSED: dict[str, tuple[str, Any]] = {
    "use_beam_search": ("beam search is not supported", _is(False)),
    "length_penalty": ("length_penalty is not supported (no beam search)", _one),
    "allowed_token_ids": ("allowed_token_ids is not supported", lambda v: False),
    "bad_words": ("bad_words is not supported", _empty),
    "logits_processors": ("logits_processors are not supported", _empty),
    "truncate_prompt_tokens": ("truncate_prompt_tokens is not supported", lambda v: False),
    "return_tokens_as_token_ids": ("return_tokens_as_token_ids is not supported", _is(False)),
    "spaces_between_special_tokens": ("spaces_between_special_tokens is not supported", _is(True)),
    "guided_decoding": ("guided_decoding is not supported; use structured_outputs", _empty),
    "vllm_xargs": ("vllm_xargs is not supported", _empty),
}


def check_extra_fields(
    body: ChatCompletionRequest | CompletionRequest | ResponsesRequest,
) -> None:
    """Refuses the undeclared fields of a request body that would change the answer.

    Raises:
        APIError: 400 naming the first such field, with why (not supported) or that it is
            unknown.
    """
    extra: Mapping[str, Any] = body.model_extra or {}
    own = (
        _CHAT_REFUSED
        if isinstance(body, ChatCompletionRequest)
        else _RESPONSES_REFUSED
        if isinstance(body, ResponsesRequest)
        else _COMPLETION_REFUSED
    )
    for name, value in extra.items():
        if name in HARMLESS or value is None:
            continue
        refused = own.get(name) or _VLLM_REFUSED.get(name)
        if refused is None:
            raise bad_request(
                f"unknown field {name!r}: baton does not implement it (refused rather than "
                "ignored, as it may change the answer)",
                name,
            )
        why, neutral = refused
        if not neutral(value):
            raise bad_request(why, name)
