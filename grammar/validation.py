"""Submission-time checks of a ``StructuredOutputsParams``: cheap, before anything is scheduled.

``validate_spec`` rejects what no backend could compile (unparsable or meta-invalid schemas,
regex and EBNF syntax errors, empty choices, oversized or overly nested specs) with a
``ValueError`` naming the problem. ``check_enforceable`` turns the backends' own
``unsupported_reason`` answers into one error when none of the allowed backends can take a spec.

Regex syntax is the backends' own: xgrammar's regex parser and outlines-core's (Rust ``regex``)
differ (xgrammar rejects ``\\p{L}`` and ``(?i)``, Rust rejects lookarounds and ``\\b`` in DFAs),
so a regex is invalid only when every backend ``spec.backend`` allows rejects it. xgrammar parses
in microseconds; outlines is asked only when xgrammar is not allowed or rejected the regex, with
a one-byte-per-token vocabulary so that only the DFA is built.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from baton.grammar.schema.refs import resolves
from baton.grammar.spec import StructuredOutputsParams, allowed_backends
from baton.grammar.structural_tag import json_schema_formats, normalise_structural_tag

DEFAULT_MAX_SPEC_BYTES = 64 * 1024
"""Largest schema (canonical JSON bytes), regex, grammar or choice list accepted."""

DEFAULT_MAX_DEPTH = 64
"""Deepest nesting of objects and arrays accepted in a JSON schema."""

# Above this estimated DFA size the outlines syntax check is skipped (the backend itself refuses
# such regexes, with its own reason, through check_enforceable).
_OUTLINES_CHECK_MAX_STATES = 20_000

_XGRAMMAR_LOG_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


def _xgrammar_message(exc: BaseException) -> str:
    """xgrammar's error text without its timestamp and C++ source location."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _XGRAMMAR_LOG_PREFIX.sub("", text)


def _allowed(spec: StructuredOutputsParams) -> tuple[str, ...]:
    return allowed_backends(spec.backend)


def _check_size(what: str, text: str, max_bytes: int) -> None:
    size = len(text.encode("utf-8"))
    if size > max_bytes:
        raise ValueError(f"{what} is {size} bytes, over the limit of {max_bytes} bytes")


def _depth(value: Any) -> int:
    """Nesting depth of dicts and lists (iterative: a hostile schema cannot blow the stack)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        depth += 1
        deepest = max(deepest, depth)
        stack.extend((child, depth) for child in children)
    return deepest


def _check_schema(spec: StructuredOutputsParams, max_bytes: int, max_depth: int) -> None:
    raw = spec.json
    if isinstance(raw, str):
        _check_size("json schema", raw, max_bytes)
    try:
        schema = spec.schema
    except RecursionError:
        raise ValueError(f"json schema nests deeper than the limit of {max_depth}") from None
    check_schema_value(schema, max_bytes=max_bytes, max_depth=max_depth)


def check_schema_value(
    schema: Any,
    *,
    what: str = "json schema",
    max_bytes: int = DEFAULT_MAX_SPEC_BYTES,
    max_depth: int = DEFAULT_MAX_DEPTH,
) -> None:
    """Checks one JSON schema (a Python value) as ``validate_spec`` checks a ``json`` spec.

    Raises:
        ValueError: starting with ``what``: not an object or boolean, nested or sized over the
            limits, not serialisable, ``false``, or invalid against its metaschema (naming
            where).
    """
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"{what} must be a JSON object or boolean, got {type(schema).__name__}")
    depth = _depth(schema)
    if depth > max_depth:
        raise ValueError(f"{what} nests {depth} levels deep, over the limit of {max_depth}")
    try:
        canonical = json.dumps(schema, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what} is not JSON-serialisable: {exc}") from None
    _check_size(f"{what} (canonical JSON)", canonical, max_bytes)
    if schema is False:
        raise ValueError(f"{what} is false: no output can match it")
    from jsonschema.exceptions import SchemaError
    from jsonschema.validators import Draft202012Validator, validator_for

    validator = validator_for(schema, default=Draft202012Validator)
    try:
        validator.check_schema(schema)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        raise ValueError(f"{what} is invalid at {where}: {exc.message}") from None
    if isinstance(schema, dict):
        _check_local_refs(schema, what)


# Keywords whose values are data, not schemas: a "$ref" key inside them is not a reference.
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})


def _check_local_refs(schema: dict[str, Any], what: str) -> None:
    """Every local ``$ref`` ("#" or "#/...") must name a value in the schema (no backend can
    compile a reference to nothing). References below a nested ``$id`` have another base and
    are left alone, as are other references (the backends say whether they take them)."""
    stack: list[tuple[Any, str]] = [(schema, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, list):
            stack.extend((child, f"{path}/{i}") for i, child in enumerate(node))
            continue
        if not isinstance(node, dict) or (path and "$id" in node):
            continue
        ref = node.get("$ref")
        local = isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))
        if local and not resolves(schema, ref[1:]):
            where = path or "(root)"
            raise ValueError(f"{what} has a $ref that resolves to nothing: {ref!r} at {where}")
        for key, child in node.items():
            if key not in _DATA_KEYWORDS:
                stack.append((child, f"{path}/{key}"))


def _outlines_regex_error(regex: str) -> str | None:
    """outlines-core's complaint about ``regex`` (None when it builds), or None when too big to
    check cheaply."""
    import outlines_core

    from baton.grammar.schema.pattern_regex import estimate_dfa_states

    if regex.startswith("^"):
        regex = regex[1:]
    if regex.endswith("$") and (len(regex) - 1 - len(regex[:-1].rstrip("\\"))) % 2 == 0:
        regex = regex[:-1]
    if estimate_dfa_states(regex) > _OUTLINES_CHECK_MAX_STATES:
        return None
    vocabulary = outlines_core.Vocabulary(256, {bytes([b]): [b] for b in range(256)})
    try:
        outlines_core.Index(regex, vocabulary)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # PyO3 panics derive from BaseException
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if "incompatible with the regex" in message:
            return "the regex matches no text"
        try:
            re.compile(regex)
        except re.error as py_exc:
            return f"{message} ({py_exc})"
        return message
    return None


def _guidance_regex_error(regex: str) -> str | None:
    """llguidance's complaint about ``regex`` on one line, None when it takes it."""
    import llguidance

    return _llguidance_complaint(llguidance.LLMatcher.grammar_from_regex(regex))


def _llguidance_complaint(grammar: str) -> str | None:
    """llguidance's complaint about its own grammar text on one line, None when it is valid."""
    import llguidance

    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None)
    return " ".join(" ".join(messages).split())[:300] if failed else None


def _check_regex(spec: StructuredOutputsParams, regex: str) -> None:
    errors: dict[str, str] = {}
    for backend in _allowed(spec):
        if backend == "xgrammar":
            import xgrammar

            try:
                xgrammar.Grammar.from_regex(regex)
                return
            except Exception as exc:
                errors[backend] = _xgrammar_message(exc)
        elif backend == "guidance":
            error = _guidance_regex_error(regex)
            if error is None:
                return
            errors[backend] = error
        else:
            error = _outlines_regex_error(regex)
            if error is None:
                return
            errors[backend] = error
    detail = "; ".join(f"{name}: {message}" for name, message in errors.items())
    raise ValueError(f"regex {regex[:200]!r} is invalid ({detail})")


def ebnf_grammar_error(text: str) -> str | None:
    """xgrammar's complaint about ``text`` as EBNF (GBNF), None when it parses."""
    import xgrammar

    try:
        xgrammar.Grammar.from_ebnf(text)
    except Exception as exc:  # noqa: BLE001 - xgrammar raises several types
        return _xgrammar_message(exc)
    return None


def _guidance_grammar_error(text: str) -> str | None:
    """llguidance's complaint about ``text`` as Lark or GBNF, None when it takes it."""
    import llguidance
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        grammar = llguidance.LLMatcher.grammar_from_lark(any_to_lark(text))
    except Exception as exc:  # noqa: BLE001 - the converter raises several types
        return " ".join(str(exc).split())[:300] or type(exc).__name__
    return _llguidance_complaint(grammar)


def _check_grammar(spec: StructuredOutputsParams, text: str) -> None:
    # xgrammar reads EBNF (GBNF); llguidance reads Lark too (vLLM's guidance backend does).
    errors: dict[str, str] = {}
    for backend in _allowed(spec):
        if backend == "xgrammar":
            if (error := ebnf_grammar_error(text)) is None:
                return
            errors[backend] = f"not valid EBNF: {error}"
        elif backend == "guidance":
            if (error := _guidance_grammar_error(text)) is None:
                return
            errors[backend] = f"not valid Lark or EBNF: {error}"
    if errors:  # else no allowed backend takes grammars: check_enforceable says so
        detail = "; ".join(f"{name}: {message}" for name, message in errors.items())
        raise ValueError(f"grammar is invalid ({detail})")


def _check_structural_tag(spec: StructuredOutputsParams, max_bytes: int, max_depth: int) -> None:
    tag = spec.structural_tag
    text = tag if isinstance(tag, str) else json.dumps(tag)
    _check_size("structural_tag", text, max_bytes)
    normalised = normalise_structural_tag(text)
    for i, fmt in enumerate(json_schema_formats(normalised)):
        check_schema_value(
            fmt["json_schema"],
            what=f"structural_tag JSON schema {i}",
            max_bytes=max_bytes,
            max_depth=max_depth,
        )
    if "xgrammar" not in _allowed(spec):
        return  # only xgrammar reads structural tags; check_enforceable reports the backend
    import xgrammar

    try:
        xgrammar.Grammar.from_structural_tag(json.dumps(normalised))
    except Exception as exc:
        raise ValueError(f"structural_tag is invalid: {_xgrammar_message(exc)}") from None


def validate_spec(
    spec: StructuredOutputsParams,
    *,
    max_spec_bytes: int = DEFAULT_MAX_SPEC_BYTES,
    max_depth: int = DEFAULT_MAX_DEPTH,
) -> None:
    """Checks ``spec`` deeply enough that compiling it can fail only for backend reasons.

    Args:
        spec: the request's constraint.
        max_spec_bytes: limit on the schema (canonical JSON), regex, grammar, structural tag or
            choice list, in bytes.
        max_depth: limit on the nesting of a JSON schema.

    Raises:
        ValueError: naming the problem: schema text that is not JSON, a schema that is not an
            object or boolean or fails its metaschema, a regex no allowed backend can parse, an
            EBNF syntax error, an empty or oversized choice, or a limit exceeded.
    """
    kind = spec.kind
    if kind == "json":
        _check_schema(spec, max_spec_bytes, max_depth)
    elif kind == "regex":
        regex = spec.regex or ""
        _check_size("regex", regex, max_spec_bytes)
        _check_regex(spec, regex)
    elif kind == "choice":
        choices = spec.choice or ()
        if not choices:
            raise ValueError("choice must hold at least one string")
        for i, choice in enumerate(choices):
            if not choice:
                raise ValueError(f"choice {i} is the empty string")
        _check_size("choice list", json.dumps(list(choices)), max_spec_bytes)
    elif kind == "grammar":
        text = spec.grammar or ""
        _check_size("grammar", text, max_spec_bytes)
        _check_grammar(spec, text)
    elif kind == "structural_tag":
        _check_structural_tag(spec, max_spec_bytes, max_depth)


def check_enforceable(spec: StructuredOutputsParams, reasons: Mapping[str, str | None]) -> None:
    """Raises unless a backend that ``spec.backend`` allows can take ``spec``.

    Args:
        spec: the request's constraint.
        reasons: each available backend's ``unsupported_reason(spec)`` by backend name (None: it
            can take the spec); an allowed backend missing here counts as not available.

    Raises:
        ValueError: naming, for each allowed backend, why it cannot take the spec.
    """
    allowed = _allowed(spec)
    why: dict[str, str] = {}
    for name in allowed:
        if name not in reasons:
            why[name] = "backend not available"
            continue
        reason = reasons[name]
        if reason is None:
            return
        why[name] = reason
    detail = "; ".join(f"{name}: {reason}" for name, reason in why.items())
    raise ValueError(f"no structured-output backend can take this {spec.kind} spec ({detail})")
