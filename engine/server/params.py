"""Request bodies -> ``SamplingParams`` (with the structured-output constraint).

Every bad value becomes an ``APIError`` 400 that names the parameter and what was expected.
"""

from __future__ import annotations

from typing import Any

from baton.engine.sampling_params import SamplingParams
from baton.engine.server.config import ServerConfig
from baton.engine.server.errors import APIError, bad_request
from baton.engine.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ResponseFormat,
    StructuredOutputsField,
)
from baton.grammar.spec import StructuredOutputsParams

_MAX_TOP_LOGPROBS = 20


def structured_from_field(
    field: StructuredOutputsField, default_backend: str
) -> StructuredOutputsParams:
    """baton's ``structured_outputs`` body field as ``StructuredOutputsParams``.

    Raises:
        APIError: 400 naming what is wrong (no or several constraints, bad options).
    """
    kwargs: dict[str, Any] = {
        "json": field.json_schema,
        "json_object": bool(field.json_object),
        "regex": field.regex,
        "choice": field.choice,
        "grammar": field.grammar,
        "structural_tag": field.structural_tag,
        "backend": field.backend or default_backend,
    }
    for name in (
        "whitespace",
        "max_whitespace_cnt",
        "disable_additional_properties",
        "allow_unenforced",
    ):
        value = getattr(field, name)
        if value is not None:
            kwargs[name] = value
    try:
        return StructuredOutputsParams(**kwargs)
    except ValueError as exc:
        raise bad_request(f"structured_outputs: {exc}", "structured_outputs") from None


def structured_from_response_format(
    fmt: ResponseFormat, default_backend: str
) -> StructuredOutputsParams | None:
    """OpenAI's ``response_format`` as a constraint (None for ``{"type": "text"}``).

    Raises:
        APIError: 400 for a json_schema format without a schema.
    """
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True, backend=default_backend)
    spec = fmt.json_schema
    if spec is None or spec.json_schema is None:
        raise bad_request(
            "response_format of type json_schema needs json_schema.schema (a JSON schema)",
            "response_format.json_schema",
        )
    try:
        return StructuredOutputsParams(json=spec.json_schema, backend=default_backend)
    except ValueError as exc:
        raise bad_request(f"response_format: {exc}", "response_format") from None


def _common_kwargs(
    req: ChatCompletionRequest | CompletionRequest, config: ServerConfig
) -> dict[str, Any]:
    if req.logit_bias:
        raise bad_request("logit_bias is not supported", "logit_bias")
    if req.n > config.max_n:
        raise bad_request(f"n must be at most {config.max_n}, got {req.n}", "n")
    kwargs: dict[str, Any] = {
        "n": req.n,
        "seed": req.seed,
        "stop": [req.stop] if isinstance(req.stop, str) else (req.stop or []),
        "stop_token_ids": req.stop_token_ids or [],
        "min_tokens": req.min_tokens,
        "ignore_eos": req.ignore_eos,
        "skip_special_tokens": req.skip_special_tokens,
        "include_stop_str_in_output": req.include_stop_str_in_output,
    }
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
    ):
        value = getattr(req, name)
        if value is not None:
            kwargs[name] = value
    return kwargs


def _build(kwargs: dict[str, Any]) -> SamplingParams:
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        message = str(exc)
        param = message.split(" ", 1)[0] if message.split(" ", 1)[0] in kwargs else None
        raise bad_request(message, param) from None


def _structured(
    req: ChatCompletionRequest | CompletionRequest,
    response_format: ResponseFormat | None,
    config: ServerConfig,
) -> StructuredOutputsParams | None:
    backend = config.structured_outputs_backend
    if req.structured_outputs is not None:
        if response_format is not None and response_format.type != "text":
            raise bad_request(
                "give either response_format or structured_outputs, not both",
                "structured_outputs",
            )
        return structured_from_field(req.structured_outputs, backend)
    if response_format is not None:
        return structured_from_response_format(response_format, backend)
    return None


def chat_sampling_params(req: ChatCompletionRequest, config: ServerConfig) -> SamplingParams:
    """Sampling parameters of a chat completion request.

    Raises:
        APIError: 400 naming the bad parameter.
    """
    if req.tools:
        raise bad_request("tools are not supported", "tools")
    kwargs = _common_kwargs(req, config)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else None
    kwargs["max_tokens"] = max_tokens if max_tokens is not None else req.max_tokens
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
        if not 0 <= req.top_logprobs <= _MAX_TOP_LOGPROBS:
            raise bad_request(
                f"top_logprobs must be an int in [0, {_MAX_TOP_LOGPROBS}], got {req.top_logprobs}",
                "top_logprobs",
            )
    if req.logprobs:
        kwargs["logprobs"] = req.top_logprobs or 0
    kwargs["structured_outputs"] = _structured(req, req.response_format, config)
    return _build(kwargs)


def completion_sampling_params(req: CompletionRequest, config: ServerConfig) -> SamplingParams:
    """Sampling parameters of a text completion request (default max_tokens 16, as OpenAI).

    Raises:
        APIError: 400 naming the bad parameter.
    """
    if req.echo:
        raise bad_request("echo is not supported", "echo")
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of is not supported (it must equal n)", "best_of")
    kwargs = _common_kwargs(req, config)
    kwargs["max_tokens"] = 16 if req.max_tokens is None else req.max_tokens
    if req.logprobs is not None:
        kwargs["logprobs"] = req.logprobs
    kwargs["structured_outputs"] = _structured(req, None, config)
    return _build(kwargs)


def check_model(model: str | None, config: ServerConfig) -> None:
    """Raises a 404 ``APIError`` unless ``model`` is None or the served model's name."""
    if model is not None and model != config.served_model_name:
        raise APIError(
            404,
            f"The model `{model}` does not exist; this server serves `{config.served_model_name}`.",
            param="model",
            code="model_not_found",
        )
