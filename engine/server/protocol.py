"""Request bodies of the OpenAI-compatible endpoints, as pydantic models.

The top-level bodies keep the fields they do not declare (``model_extra``):
``baton.engine.server.fields`` accepts those that change nothing and refuses the rest with a
400 naming them, so that no field that would change the answer is dropped silently. Values
are range-checked by ``SamplingParams`` when the handlers build it, so the messages name the
same limits everywhere.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

# The values of ``reasoning_effort`` (and the Responses API's ``reasoning.effort``) OpenAI takes.
REASONING_EFFORTS: tuple[str, ...] = ("none", "minimal", "low", "medium", "high")


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class ContentPart(_Body):
    """One part of a multi-part message content; only text parts are supported."""

    type: str
    text: str | None = None


class ChatMessage(_Body):
    """One chat message; content is text or a list of text parts. An assistant message may
    carry the ``tool_calls`` it made, a ``tool`` message the ``tool_call_id`` it answers."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class JsonSchemaFormat(_Body):
    """``response_format.json_schema``: OpenAI's named schema."""

    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's ``response_format``; ``schema`` at the top level is the spelling several
    hosted APIs (and instructor's older JSON_SCHEMA mode) send with ``json_object`` or
    ``json_schema``. The type is checked by the handlers, so that an unknown one is a 400
    naming it."""

    type: str
    json_schema: JsonSchemaFormat | None = None
    inline_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")


class StructuredOutputsField(_Body):
    """baton's ``structured_outputs`` body field: exactly one constraint plus options (the
    fields of ``StructuredOutputsParams``, and vLLM's ``disable_any_whitespace``,
    ``whitespace_pattern`` and ``disable_fallback``); an unknown key is a 400."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_schema: dict[str, Any] | str | bool | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: dict[str, Any] | str | None = None
    backend: str | None = None
    whitespace: str | None = None
    max_whitespace_cnt: int | None = None
    disable_additional_properties: bool | None = None
    allow_unenforced: bool | None = None
    open_objects: bool | None = None
    disable_any_whitespace: bool | None = None
    whitespace_pattern: str | None = None
    disable_fallback: bool | None = None


class StreamOptions(_Body):
    """``stream_options``: ``include_usage`` adds a final chunk carrying usage."""

    include_usage: bool = False


class _GenerationRequest(_Body):
    """Fields shared by chat and text completions (OpenAI's plus vLLM-style extras)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    # vLLM's older spellings of structured_outputs.
    guided_json: dict[str, Any] | str | bool | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    # Outlines' vLLM client sends the whitespace pattern at the top level.
    whitespace_pattern: str | None = None
    # Extras beyond OpenAI's API (vLLM's names).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # With the server's reasoning parser: thinking tokens before a structured answer.
    max_reasoning_tokens: int | None = None
    # OpenAI's: token id (a string, as JSON keys are) -> bias in [-100, 100].
    logit_bias: dict[str, Any] | None = None
    # vLLM's: each prompt token's logprob and the top-k at its position, in the response's
    # prompt_logprobs (not with stream, as vLLM).
    prompt_logprobs: int | None = None


class ChatCompletionRequest(_GenerationRequest):
    """Body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # A Jinja chat template used instead of the server's and the model's (vLLM's field).
    chat_template: str | None = None
    # Passed to a chat template that reads it (one of REASONING_EFFORTS).
    reasoning_effort: str | None = None


class CompletionRequest(_GenerationRequest):
    """Body of ``POST /v1/completions``: a string, strings, token ids or lists of them."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    best_of: int | None = None
    # The prompt's text before each choice's text.
    echo: bool = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        # One clear message instead of pydantic's one line per union member.
        def ids(v: Any) -> bool:
            return isinstance(v, list) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in v
            )

        ok = (
            isinstance(value, str)
            or ids(value)
            or (isinstance(value, list) and all(isinstance(p, str) for p in value))
            or (isinstance(value, list) and all(ids(p) for p in value))
        )
        if not ok:
            raise ValueError(
                "prompt must be a string, a list of strings, a list of token ids "
                "or a list of token-id lists"
            )
        return value


class ResponsesRequest(_Body):
    """Body of ``POST /v1/responses`` (OpenAI's Responses API). ``input``, ``text``,
    ``tools``, ``tool_choice`` and ``reasoning`` are checked by
    ``baton.engine.server.responses_input`` so that a 400 names the part that is wrong."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    text: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: dict[str, Any] | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # Extra output data: only "message.output_text.logprobs" (checked by responses_input).
    include: list[Any] | None = None
    # Alternatives per position in the output_text logprobs (with that include).
    top_logprobs: int | None = None
    # With the server's reasoning parser: thinking tokens before a structured answer.
    max_reasoning_tokens: int | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _input_shape(cls, value: Any) -> Any:
        # One clear message instead of pydantic's one line per union member.
        if not isinstance(value, (str, list)):
            raise ValueError("input must be a string or a list of input items")
        return value
