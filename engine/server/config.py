"""``ServerConfig``: the HTTP server's own settings (the engine has ``EngineConfig``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from baton.engine.config import REASONING_PARSERS
from baton.engine.model_parsers import resolve_parsers
from baton.engine.tokenizer import Tokenizer
from baton.grammar.spec import BACKENDS
from baton.grammar.tool_formats import TOOL_CALL_PARSERS

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_RESPONSES_STORE_SIZE = 1024


@dataclass(frozen=True)
class ServerConfig:
    """Settings of one OpenAI-compatible server.

    Attributes:
        served_model_name: the model name clients must send (and ``/v1/models`` lists).
        api_key: when set, every ``/v1`` request needs ``Authorization: Bearer <api_key>``.
        max_body_bytes: largest request body accepted (413 above it).
        structured_outputs_backend: backend of structured requests that name none
            ("auto", "xgrammar", "outlines" or "guidance").
        max_n: largest ``n`` (completions per prompt) one request may ask for.
        reasoning_parser: the engine's reasoning parser (``EngineConfig.reasoning_parser``):
            chat answers then carry the model's thoughts as ``reasoning_content``. None: none,
            or for gpt-oss harmony's, "openai_gptoss" (``resolved``, which ``build_app`` runs).
        chat_template: a Jinja chat template used instead of the tokenizer's (``baton serve
            --chat-template``); None: the tokenizer's.
        trust_request_chat_template: whether a request may send its own ``chat_template``
            (``baton serve --trust-request-chat-template``). Off by default, as in vLLM: a
            template runs in Jinja's sandbox, yet its loops can hold a CPU for as long as
            they like.
        responses_store_size: how many ``/v1/responses`` responses are kept (in memory,
            least recently used evicted first) for ``previous_response_id`` and ``GET``.
        tool_call_parser: the models' tool-call syntax, by vLLM's parser name
            (``TOOL_CALL_PARSERS``: ``baton serve --tool-call-parser``); None: for gpt-oss
            harmony's, "openai" (``resolved``), for other models the one the chat template
            writes, else Hermes'.
        max_reasoning_tokens: the thinking budget of a structured request that gives no
            ``max_reasoning_tokens`` (``baton serve --max-reasoning-tokens``); needs
            ``reasoning_parser``. None: such requests think unbounded.

    Raises:
        ValueError: naming the field that is out of range. What depends on the model (which
            parsers fit it, a budget without a reasoning parser) is checked by ``resolved``.
    """

    served_model_name: str
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    structured_outputs_backend: str = "auto"
    max_n: int = 64
    reasoning_parser: str | None = None
    chat_template: str | None = None
    trust_request_chat_template: bool = False
    responses_store_size: int = DEFAULT_RESPONSES_STORE_SIZE
    tool_call_parser: str | None = None
    max_reasoning_tokens: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.served_model_name, str) or not self.served_model_name:
            raise ValueError(
                f"served_model_name must be a non-empty string, got {self.served_model_name!r}"
            )
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError("api_key must be None or a non-empty string")
        for name in ("max_body_bytes", "max_n", "responses_store_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, "
                f"got {self.reasoning_parser!r}"
            )
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                f"got {self.tool_call_parser!r}"
            )
        budget = self.max_reasoning_tokens
        if budget is not None and (
            not isinstance(budget, int) or isinstance(budget, bool) or budget < 0
        ):
            raise ValueError(f"max_reasoning_tokens must be None or an int >= 0, got {budget!r}")
        if self.structured_outputs_backend not in BACKENDS:
            raise ValueError(
                f"structured_outputs_backend must be one of {', '.join(BACKENDS)}, "
                f"got {self.structured_outputs_backend!r}"
            )

    def resolved(self, architecture: str | None, tokenizer: Tokenizer | None) -> ServerConfig:
        """This config with the parsers in force for a model of ``architecture``
        (``ModelConfig.architecture``) and ``tokenizer`` (None: not loaded yet), as
        ``model_parsers.resolve_parsers`` chooses them, the engine's reasoning parser alike:
        gpt-oss gets harmony's where none is named. A new config; this one is unchanged.

        Raises:
            ValueError: a parser that cannot read this model (naming the model type and the
                parser that fits), tool_call_parser "openai" without reasoning_parser
                "openai_gptoss", or max_reasoning_tokens without a reasoning parser.
        """
        parsers = resolve_parsers(
            architecture, tokenizer, self.reasoning_parser, self.tool_call_parser
        )
        if self.max_reasoning_tokens is not None and parsers.reasoning is None:
            raise ValueError(
                "max_reasoning_tokens bounds a reasoning model's thoughts: it needs "
                "reasoning_parser (--reasoning-parser)"
            )
        return dataclasses.replace(
            self, reasoning_parser=parsers.reasoning, tool_call_parser=parsers.tool_call
        )
