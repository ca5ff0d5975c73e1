"""The reasoning and tool-call parsers a model is served with: the ones the user named, or, for
gpt-oss, harmony's (``openai_gptoss`` and ``openai``) when none is named, as vLLM does. The
engine (``LLM``, ``processing/model_setup.py``) and the server (``server/config.py``) both
resolve here, so they never disagree.

How gpt-oss is recognised: by its architecture (Hugging Face ``model_type`` ``gpt_oss``, a
GGUF's ``general.architecture`` ``gpt-oss``; the loaders name both "gpt_oss"), as vLLM does.
It is in every gpt-oss checkpoint and is known before any weight is read. The chat template is
not reliable: a GGUF or a folder may come without one, ``--chat-template`` may replace it, and
another model's template could write the same text. One more condition: the model's
vocabulary must hold harmony's markers as single tokens (``has_harmony_tokens``), since
harmony is read from the token ids; a gpt-oss-shaped model without them (a random-weight test
model, a retokenised fine-tune) cannot write harmony and stays a plain model.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from baton.engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

HARMONY_ARCHITECTURE = "gpt_oss"
HARMONY_REASONING_PARSER = "openai_gptoss"
HARMONY_TOOL_CALL_PARSER = "openai"
# What harmony's parsers read as one token each (its turn, channel and message markers).
HARMONY_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>")


@dataclass(frozen=True)
class ModelParsers:
    """The parsers in force (vLLM's names; None: none) and whether they are harmony's because
    the model is gpt-oss and none was named (``harmony_default``)."""

    reasoning: str | None
    tool_call: str | None
    harmony_default: bool = False


def has_harmony_tokens(tokenizer: Tokenizer) -> bool:
    """Whether each of harmony's markers (``HARMONY_TOKENS``) is one token of ``tokenizer``."""
    return all(len(tokenizer.encode(t, add_special_tokens=False)) == 1 for t in HARMONY_TOKENS)


def resolve_parsers(
    architecture: str | None,
    tokenizer: Tokenizer | None,
    reasoning_parser: str | None = None,
    tool_call_parser: str | None = None,
) -> ModelParsers:
    """The parsers a model of ``architecture`` (``ModelConfig.architecture``; None: unknown)
    is served with when the user named ``reasoning_parser`` and ``tool_call_parser`` (None:
    not named; names already checked against ``REASONING_PARSERS`` and ``TOOL_CALL_PARSERS``).

    A gpt-oss model whose ``tokenizer`` has harmony's markers (None: not loaded yet, taken to
    have them) gets ``openai_gptoss`` and ``openai`` where none is named; any other model
    exactly what was named. Pure: reads only its arguments.

    Raises:
        ValueError: a gpt-oss model with a parser named that does not read harmony (naming
            the model type and the parser that fits), or tool_call_parser "openai" without
            reasoning_parser "openai_gptoss" for any other model.
    """
    if architecture == HARMONY_ARCHITECTURE:
        _refuse_non_harmony("reasoning_parser", reasoning_parser, HARMONY_REASONING_PARSER)
        _refuse_non_harmony("tool_call_parser", tool_call_parser, HARMONY_TOOL_CALL_PARSER)
        if tokenizer is None or has_harmony_tokens(tokenizer):
            named = reasoning_parser is not None and tool_call_parser is not None
            return ModelParsers(HARMONY_REASONING_PARSER, HARMONY_TOOL_CALL_PARSER, not named)
        logger.warning(
            "model type %s without harmony's tokens (%s) in its vocabulary: served as a plain "
            "model, without harmony's parsers",
            architecture,
            " ".join(HARMONY_TOKENS),
        )
    if tool_call_parser == HARMONY_TOOL_CALL_PARSER and reasoning_parser != (
        HARMONY_REASONING_PARSER
    ):
        raise ValueError(
            "tool_call_parser 'openai' reads gpt-oss's harmony tokens: it needs "
            "reasoning_parser 'openai_gptoss' (--reasoning-parser openai_gptoss)"
        )
    return ModelParsers(reasoning_parser, tool_call_parser)


def _refuse_non_harmony(field: str, named: str | None, fits: str) -> None:
    if named is not None and named != fits:
        flag = "--" + field.replace("_", "-")
        raise ValueError(
            f"model type {HARMONY_ARCHITECTURE} (gpt-oss) writes OpenAI's harmony format, which "
            f"{field} {named!r} cannot read: use {fits!r} ({flag} {fits}), or name none and "
            "gpt-oss gets harmony's parsers"
        )
