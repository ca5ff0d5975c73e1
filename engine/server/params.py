"""Request bodies -> ``SamplingParams`` (with the structured-output constraint).

Every bad value becomes an ``APIError`` 400 that names the parameter and what was expected;
so does every field that baton does not implement but that would change the answer
(``baton.engine.server.fields``).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from baton.engine.sampling_params import SamplingParams
from baton.engine.server.config import ServerConfig
from baton.engine.server.constraints import Constraint, request_constraint, requested_backend
from baton.engine.server.errors import APIError, bad_request
from baton.engine.server.fields import check_extra_fields
from baton.engine.server.protocol import ChatCompletionRequest, CompletionRequest
from baton.engine.server.tools import ToolPlan, tool_constraint

_MAX_TOP_LOGPROBS = 20


_NO_DEFAULTS: Mapping[str, float | int] = MappingProxyType({})


def _common_kwargs(
    req: ChatCompletionRequest | CompletionRequest,
    config: ServerConfig,
    defaults: Mapping[str, float | int],
) -> dict[str, Any]:
    check_extra_fields(req)
    if req.n > config.max_n:
        raise bad_request(f"n must be at most {config.max_n}, got {req.n}", "n")
    # The model's sampling defaults first (its generation config); the request's fields win.
    kwargs: dict[str, Any] = {
        **defaults,
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
        "max_reasoning_tokens",
    ):
        value = getattr(req, name)
        if value is not None:
            kwargs[name] = value
    if req.logit_bias:
        kwargs["logit_bias"] = parse_logit_bias(req.logit_bias)
    if req.prompt_logprobs is not None:
        if req.stream:  # as vLLM: they come with the whole answer only
            raise bad_request("prompt_logprobs is not available with stream", "prompt_logprobs")
        kwargs["prompt_logprobs"] = req.prompt_logprobs
    return kwargs


def parse_logit_bias(raw: Mapping[str, Any]) -> dict[int, Any]:
    """A body's ``logit_bias`` with its keys as token ids; the values are checked by
    ``SamplingParams`` (numbers in [-100, 100]), the ids against the vocabulary by the engine.

    Raises:
        APIError: 400 naming ``logit_bias`` for a key that is not a token id (a decimal
            integer string).
    """
    out: dict[int, Any] = {}
    for key, bias in raw.items():
        # Past 18 digits no id fits a vocabulary (and int() refuses thousands of digits).
        if not (key.isascii() and key.isdigit()) or len(key) > 18:
            raise bad_request(
                f"logit_bias keys must be token ids (decimal integers >= 0), got {key!r}",
                "logit_bias",
            )
        out[int(key)] = bias
    return out


def _build(kwargs: dict[str, Any]) -> SamplingParams:
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        message = str(exc)
        param = message.split(" ", 1)[0] if message.split(" ", 1)[0] in kwargs else None
        raise bad_request(message, param) from None


def chat_sampling_params(
    req: ChatCompletionRequest,
    config: ServerConfig,
    tools: ToolPlan | None = None,
    *,
    defaults: Mapping[str, float | int] = _NO_DEFAULTS,
) -> tuple[SamplingParams, Constraint | None]:
    """Sampling parameters of a chat completion request, and the constraint in them (with
    the body field that carried it), tool calls included when ``tools`` is given.
    ``defaults`` (the model's sampling defaults) fill the sampling fields the request leaves
    out.

    Raises:
        APIError: 400 naming the bad parameter.
    """
    kwargs = _common_kwargs(req, config, defaults)
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
    backend = config.structured_outputs_backend
    constraint = request_constraint(req, backend)
    if tools is not None:
        budget = req.max_reasoning_tokens
        budget = config.max_reasoning_tokens if budget is None else budget
        constraint = tool_constraint(tools, constraint, requested_backend(req, backend), budget)
        if tools.forces_special_tokens:  # the parser reads the marker from the text
            kwargs["skip_special_tokens"] = False
    _set_constraint(kwargs, constraint, config)
    return _build(kwargs), constraint


def completion_sampling_params(
    req: CompletionRequest,
    config: ServerConfig,
    *,
    defaults: Mapping[str, float | int] = _NO_DEFAULTS,
) -> tuple[SamplingParams, Constraint | None]:
    """Sampling parameters of a text completion request (default max_tokens 16, as OpenAI),
    and the constraint in them with the body field that carried it. ``defaults`` (the model's
    sampling defaults) fill the sampling fields the request leaves out.

    Raises:
        APIError: 400 naming the bad parameter.
    """
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of is not supported (it must equal n)", "best_of")
    kwargs = _common_kwargs(req, config, defaults)
    kwargs["max_tokens"] = 16 if req.max_tokens is None else req.max_tokens
    if req.logprobs is not None:
        kwargs["logprobs"] = req.logprobs
        if req.echo:  # the echoed prompt's tokens get logprobs too (as vLLM)
            kwargs.setdefault("prompt_logprobs", req.logprobs)
    constraint = request_constraint(req, config.structured_outputs_backend)
    _set_constraint(kwargs, constraint, config)
    return _build(kwargs), constraint


def _set_constraint(
    kwargs: dict[str, Any], constraint: Constraint | None, config: ServerConfig
) -> None:
    """The constraint's spec into ``kwargs``, with the server's default thinking budget
    where the request is structured and gives none (a budget bounds the thoughts before a
    structured answer: the engine refuses one without a constraint)."""
    kwargs["structured_outputs"] = constraint.spec if constraint is not None else None
    if constraint is not None and config.max_reasoning_tokens is not None:
        kwargs.setdefault("max_reasoning_tokens", config.max_reasoning_tokens)


def check_model(model: str | None, config: ServerConfig) -> None:
    """Raises a 404 ``APIError`` unless ``model`` is None or the served model's name."""
    if model is not None and model != config.served_model_name:
        raise APIError(
            404,
            f"The model `{model}` does not exist; this server serves `{config.served_model_name}`.",
            param="model",
            code="model_not_found",
        )
