"""The one structured-output constraint of a request, from whichever field carries it.

A request may spell its constraint as OpenAI's ``response_format`` (``json_schema``,
``json_object``, or ``json_object`` with a ``schema`` key, which is then enforced), baton's
``structured_outputs`` field, or vLLM's older ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar`` fields (with ``guided_decoding_backend`` and
``guided_whitespace_pattern``, or a top-level ``whitespace_pattern``, as options). Several
fields asking for the same constraint are one constraint; different ones are a 400. Tool
calls are added on top by ``baton.engine.server.tools``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from baton.engine.server.errors import bad_request
from baton.engine.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ResponseFormat,
    StructuredOutputsField,
)
from baton.grammar.spec import BACKENDS, StructuredOutputsParams

# The backend "auto" tries first: what vLLM's disable_fallback keeps.
AUTO_FIRST = "xgrammar"
# vLLM's backend options ("xgrammar:disable-any-whitespace"); baton's JSON is compact anyway,
# and its objects closed unless a request asks for open ones (baton's own "open-objects").
_BACKEND_FLAGS: dict[str, dict[str, Any]] = {
    "disable-any-whitespace": {"whitespace": "compact"},
    "no-fallback": {},
    "disable-additional-properties": {"disable_additional_properties": True},
    "open-objects": {"open_objects": True},
}


@dataclass(frozen=True)
class Constraint:
    """A request's constraint and the body field that carried it (named in 400s)."""

    param: str
    spec: StructuredOutputsParams


def _spec(param: str, **kwargs: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kwargs)
    except ValueError as exc:
        raise bad_request(f"{param}: {exc}", param) from None


def from_field(field: StructuredOutputsField, options: dict[str, Any]) -> StructuredOutputsParams:
    """baton's ``structured_outputs`` body field as ``StructuredOutputsParams`` (``options``:
    defaults its own keys override).

    Raises:
        APIError: 400 naming what is wrong (no or several constraints, bad options).
    """
    kwargs: dict[str, Any] = {
        **options,
        "json": field.json_schema,
        "json_object": bool(field.json_object),
        "regex": field.regex,
        "choice": field.choice,
        "grammar": field.grammar,
        "structural_tag": field.structural_tag,
    }
    for name in (
        "backend",
        "whitespace",
        "max_whitespace_cnt",
        "disable_additional_properties",
        "allow_unenforced",
        "open_objects",
    ):
        value = getattr(field, name)
        if value is not None:
            kwargs[name] = value
    # vLLM's spellings of the same options.
    if field.disable_any_whitespace is not None and field.whitespace is None:
        kwargs["whitespace"] = "compact" if field.disable_any_whitespace else "any"
    if field.whitespace_pattern is not None:
        kwargs["whitespace"] = _whitespace(
            field.whitespace_pattern, "structured_outputs.whitespace_pattern"
        )
    if field.disable_fallback and kwargs.get("backend") == "auto":
        kwargs["backend"] = AUTO_FIRST
    return _spec("structured_outputs", **kwargs)


def from_response_format(
    fmt: ResponseFormat, options: dict[str, Any]
) -> StructuredOutputsParams | None:
    """OpenAI's ``response_format`` as a constraint (None for ``{"type": "text"}``). A
    ``schema`` key beside ``json_object`` makes it that schema, not just any object;
    ``json_schema.strict: false`` makes it lenient (``allow_unenforced``).

    Raises:
        APIError: 400 for an unknown type, a json_schema format without a schema, or two
            different schemas in one format.
    """
    param = "response_format"
    if fmt.type == "text":
        if fmt.inline_schema is not None or fmt.json_schema is not None:
            raise bad_request("response_format of type text takes no schema", param)
        return None
    if fmt.type not in ("json_object", "json_schema"):
        raise bad_request(
            f"response_format.type {fmt.type!r} is not supported "
            "(use text, json_object or json_schema)",
            "response_format.type",
        )
    nested = fmt.json_schema.json_schema if fmt.json_schema is not None else None
    schema = nested if nested is not None else fmt.inline_schema
    if nested is not None and fmt.inline_schema is not None and nested != fmt.inline_schema:
        raise bad_request(
            "response_format has two different schemas (json_schema.schema and schema)", param
        )
    if schema is None:
        if fmt.type == "json_object":
            return _spec(param, json_object=True, **options)
        raise bad_request(
            "response_format of type json_schema needs json_schema.schema (a JSON schema)",
            "response_format.json_schema",
        )
    # strict false (OpenAI's best effort): keywords no backend enforces are dropped, and the
    # answer says which; strict true or absent: such a schema is a 400 naming them.
    if fmt.json_schema is not None and fmt.json_schema.strict is False:
        options = {**options, "allow_unenforced": True}
    return _spec(param, json=schema, **options)


def _whitespace(pattern: str, param: str) -> str:
    """The whitespace option for a vLLM whitespace pattern: "compact", the one baton can
    promise, whose output (no free whitespace) is in the language of any pattern that admits
    the empty string.

    Raises:
        APIError: 400 for a pattern that is not a regex or demands whitespace.
    """
    try:
        empty_ok = re.fullmatch(pattern, "") is not None
    except re.error as exc:
        message = f"{param}: the whitespace pattern is not a valid regex: {exc}"
        raise bad_request(message, param) from None
    if not empty_ok:
        raise bad_request(
            f"{param}: the whitespace pattern must admit the empty string (baton's JSON has "
            "no free whitespace between tokens)",
            param,
        )
    return "compact"


def _options(req: ChatCompletionRequest | CompletionRequest, backend: str) -> dict[str, Any]:
    """Backend and whitespace options from vLLM's guided_decoding_backend and
    guided_whitespace_pattern (or the top-level whitespace_pattern outlines' client sends)."""
    options: dict[str, Any] = {"backend": backend}
    if req.guided_decoding_backend:
        name, *flags = req.guided_decoding_backend.split(":")
        if name not in BACKENDS:
            raise bad_request(
                f"guided_decoding_backend {name!r} is not available "
                f"(choose one of {', '.join(BACKENDS)})",
                "guided_decoding_backend",
            )
        options["backend"] = name
        for flag in ",".join(flags).split(",") if flags else []:
            if flag not in _BACKEND_FLAGS:
                raise bad_request(
                    f"guided_decoding_backend option {flag!r} is not supported "
                    f"(known: {', '.join(_BACKEND_FLAGS)})",
                    "guided_decoding_backend",
                )
            options.update(_BACKEND_FLAGS[flag])
    patterns = {
        name: value
        for name in ("guided_whitespace_pattern", "whitespace_pattern")
        if (value := getattr(req, name)) is not None
    }
    if len(set(patterns.values())) > 1:
        raise bad_request(
            "guided_whitespace_pattern and whitespace_pattern ask for different whitespace; "
            "send one",
            "whitespace_pattern",
        )
    for name, value in patterns.items():
        options["whitespace"] = _whitespace(value, name)
    return options


def requested_backend(req: ChatCompletionRequest | CompletionRequest, default_backend: str) -> str:
    """The backend the request asks for (guided_decoding_backend), else ``default_backend``.

    Raises:
        APIError: 400 for an unknown backend or option.
    """
    return _options(req, default_backend)["backend"]


def request_constraint(
    req: ChatCompletionRequest | CompletionRequest, default_backend: str
) -> Constraint | None:
    """The constraint the request's fields ask for, or None.

    Raises:
        APIError: 400 naming the field: a bad spec, an unknown response_format type, bad
            guided options, or two fields asking for different constraints.
    """
    options = _options(req, default_backend)
    found: list[Constraint] = []
    if req.structured_outputs is not None:
        found.append(Constraint("structured_outputs", from_field(req.structured_outputs, options)))
    if req.response_format is not None:
        spec = from_response_format(req.response_format, options)
        if spec is not None:
            found.append(Constraint("response_format", spec))
    guided = {
        "guided_json": {"json": req.guided_json},
        "guided_regex": {"regex": req.guided_regex},
        "guided_choice": {"choice": req.guided_choice},
        "guided_grammar": {"grammar": req.guided_grammar},
    }
    for param, kwargs in guided.items():
        if next(iter(kwargs.values())) is not None:
            found.append(Constraint(param, _spec(param, **kwargs, **options)))
    if not found:
        return None
    first = found[0]
    for other in found[1:]:
        if _key(other.spec) != _key(first.spec):
            raise bad_request(
                f"{first.param} and {other.param} ask for different constraints; give one",
                other.param,
            )
    return first


def _key(spec: StructuredOutputsParams) -> tuple[Any, ...]:
    try:
        text = spec.spec_text
    except (ValueError, TypeError):
        text = repr(spec)
    return (spec.kind, text, spec.options_key, spec.backend)
