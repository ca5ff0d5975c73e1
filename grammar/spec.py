"""What a request asks to be constrained to: ``StructuredOutputsParams``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from baton.grammar.schema.normalise import close_every_object

Kind = Literal["json", "json_object", "regex", "choice", "grammar", "structural_tag"]
BackendName = Literal["auto", "xgrammar", "outlines", "guidance"]
KINDS: tuple[Kind, ...] = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
BACKENDS: tuple[BackendName, ...] = ("auto", "xgrammar", "outlines", "guidance")
AUTO_ORDER: tuple[str, ...] = ("xgrammar", "outlines", "guidance")
"""The backends ``backend="auto"`` tries, in this order (the one place that holds it): per spec,
the first that takes it whole under the request's object policy (closed objects by default,
``open_objects`` on request) compiles it; one that refuses it or fails to compile it passes it
to the next. Every backend reads the policy the same way, so the choice changes how fast a
spec compiles and is masked, never which outputs it allows."""


def allowed_backends(backend: str) -> tuple[str, ...]:
    """The backends a spec's ``backend`` field allows, in the order they are tried."""
    return AUTO_ORDER if backend == "auto" else (backend,)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint, plus options; validated for shape at construction.

    Attributes:
        json: a JSON schema (dict, JSON text, or a pydantic model class); a dict is copied
            at construction, so changing it afterwards changes no spec already made (one JSON
            cannot hold is kept as given and refused at submission).
        json_object: any JSON object.
        regex: a regular expression the whole output must match.
        choice: the output is exactly one of these strings.
        grammar: an EBNF (GBNF) grammar.
        structural_tag: xgrammar's structural tag (dict or JSON text).
        backend: "auto" (the backends of ``AUTO_ORDER`` in turn: xgrammar, then outlines-core,
            then llguidance), "xgrammar", "outlines" or "guidance".
        whitespace: "compact" (no free whitespace between JSON tokens: a small
            model cannot loop on newlines) or "any" (free whitespace, at most
            ``max_whitespace_cnt`` characters in a row).
        max_whitespace_cnt: cap on a whitespace run with whitespace="any".
        disable_additional_properties: vLLM's option: every object schema that does not say
            ``additionalProperties`` is read as ``additionalProperties: false``, those that
            declare no property names too (the default closes only objects that declare
            some: ``{"type": "object"}`` stays any object).
        open_objects: read an object schema without ``additionalProperties`` as JSON Schema
            does (any other property, with any value) instead of closed. A backend that
            cannot write such objects exactly refuses the spec (``auto`` then takes one that
            can); none closes them silently.
        allow_unenforced: accept a schema using keywords the chosen backend
            does not enforce (they are then ignored).
        writes_reasoning: the constraint covers the model's thoughts too (a harmony tool
            call's analysis channel), so an engine with a reasoning parser holds it from the
            first token instead of after the thoughts.

    Raises:
        ValueError: zero or several constraints, an option out of range, or
            ``open_objects`` together with ``disable_additional_properties``.
        Deeper checks (schema meta-validation, regex and EBNF syntax) happen in
        ``baton.grammar.validation.validate_spec`` when the request is submitted.
    """

    json: dict[str, Any] | str | type | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    structural_tag: dict[str, Any] | str | None = None
    backend: BackendName = "auto"
    whitespace: Literal["compact", "any"] = "compact"
    max_whitespace_cnt: int = 4
    disable_additional_properties: bool = False
    allow_unenforced: bool = False
    open_objects: bool = False
    writes_reasoning: bool = False

    def __post_init__(self) -> None:
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice):
                raise ValueError("choice must be a list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))
            if not self.choice:
                raise ValueError("choice must hold at least one string")
        given = [k for k in KINDS if self._given(k)]
        if len(given) != 1:
            raise ValueError(
                "StructuredOutputsParams takes exactly one of "
                f"{', '.join(KINDS)}; got {len(given)}"
                + (f" ({', '.join(given)})" if given else "")
            )
        for name in ("json_object", "writes_reasoning"):
            if self._raw(name) is not False and self._raw(name) is not True:
                raise ValueError(f"{name} must be a bool")
        if not isinstance(self.open_objects, bool):
            raise ValueError(f"open_objects must be a bool, got {self.open_objects!r}")
        if self.open_objects and self.disable_additional_properties:
            raise ValueError(
                "open_objects and disable_additional_properties contradict each other "
                "(open objects vs. closed ones); set at most one"
            )
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.whitespace not in ("compact", "any"):
            raise ValueError(f"whitespace must be 'compact' or 'any', got {self.whitespace!r}")
        if not isinstance(self.max_whitespace_cnt, int) or not 1 <= self.max_whitespace_cnt <= 64:
            raise ValueError(
                f"max_whitespace_cnt must be an int in [1, 64], got {self.max_whitespace_cnt!r}"
            )
        for name in ("regex", "grammar"):
            v = self._raw(name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"{name} must be a non-empty string")
        if (
            self.json is not None
            and not isinstance(self.json, (dict, str, bool))
            and not hasattr(self.json, "model_json_schema")
        ):
            raise ValueError("json must be a schema dict, JSON text, or a pydantic model class")
        if isinstance(self.json, dict):
            self._own_schema(self.json)

    def _own_schema(self, schema: dict[str, Any]) -> None:
        """Keeps a copy of ``schema`` and its canonical text: the spec is frozen, so a caller
        changing the dict afterwards changes neither a spec already submitted nor its cached
        text (which is the compiled grammar's cache key). A schema that cannot be serialised
        is kept as given, uncached: submission refuses it (``validate_spec``) as before."""
        try:
            text = json.dumps(schema, separators=(",", ":"))
            copy = json.loads(text)
        except (RecursionError, TypeError, ValueError):
            return
        object.__setattr__(self, "json", copy)
        object.__setattr__(self, "_spec_text", text)

    def _raw(self, name: str) -> Any:
        return object.__getattribute__(self, name)

    def _given(self, kind: str) -> bool:
        # json=False is the valid schema that accepts nothing; json_object=False is "not asked".
        value = self._raw(kind)
        return value is True if kind == "json_object" else value is not None

    @property
    def kind(self) -> Kind:
        """Which constraint this is."""
        return next(k for k in KINDS if self._given(k))

    @property
    def schema(self) -> dict[str, Any] | bool | None:
        """The JSON schema as a Python value (None unless kind == "json").

        Raises:
            ValueError: the schema text is not JSON.
        """
        if not self.disable_additional_properties:
            return self._given_schema()
        # vLLM's option closes every object, those that declare no names too: one copy, kept
        # (admission reads the schema several times).
        closed = self.__dict__.get("_closed_schema")
        if closed is None:
            schema = self._given_schema()
            closed = None if schema is None else close_every_object(schema)
            object.__setattr__(self, "_closed_schema", closed)
        return closed

    def _given_schema(self) -> dict[str, Any] | bool | None:
        s = self.json
        if s is None:
            return None
        if isinstance(s, str):
            try:
                return json.loads(s)
            except json.JSONDecodeError as exc:
                raise ValueError(f"json schema is not valid JSON: {exc}") from None
        if isinstance(s, (dict, bool)):
            return s
        return s.model_json_schema()

    @property
    def spec_text(self) -> str:
        """The constraint as canonical text: the cache key's spec part.

        Computed once per instance (a large schema's serialisation took ~55 us, and admission
        asks for it about five times: validation, candidates, room, compile key). A schema
        dict's text comes from the copy made at construction; a structural tag given as a dict
        (mutable, and not copied) is serialised on every call."""
        cached = self.__dict__.get("_spec_text")
        if cached is not None:
            return cached
        text = self._canonical_text()
        if not isinstance(self._raw("json"), dict) and not isinstance(
            self._raw("structural_tag"), dict
        ):
            object.__setattr__(self, "_spec_text", text)
        return text

    def _canonical_text(self) -> str:
        kind = self.kind
        if kind == "json":
            # Key order is kept: backends emit properties in schema order.
            return json.dumps(self.schema, separators=(",", ":"))
        if kind == "json_object":
            return "{}"
        if kind == "choice":
            return json.dumps(list(self.choice or ()))
        if kind == "structural_tag":
            st = self.structural_tag
            return st if isinstance(st, str) else json.dumps(st, sort_keys=True)
        return str(self._raw(kind))

    @property
    def options_key(self) -> tuple[Any, ...]:
        """Options that change the compiled grammar (part of the cache key):
        (whitespace, max_whitespace_cnt or None, open_objects). ``disable_additional_properties``
        is not one: it is written into ``schema`` (and so into ``spec_text``)."""
        return (
            self.whitespace,
            self.max_whitespace_cnt if self.whitespace == "any" else None,
            self.open_objects,
        )
