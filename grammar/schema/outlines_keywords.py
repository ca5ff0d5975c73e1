"""The JSON-schema keywords outlines-core enforces (after ``outlines_prepare``'s rewriting),
the ones it ignores, and the exceptions, as data. Each entry is backed by a test in
``tests/test_grammar_outlines.py``."""

from __future__ import annotations

OUTLINES_ENFORCED_KEYWORDS: frozenset[str] = frozenset(
    {
        "type",
        "enum",
        "const",
        "properties",
        "required",
        "additionalProperties",
        "unevaluatedProperties",
        "items",
        "prefixItems",
        "unevaluatedItems",
        "minItems",
        "maxItems",
        "minLength",
        "maxLength",
        "pattern",
        "anyOf",
        "oneOf",
        "allOf",
        "$ref",
    }
)
"""Keywords outlines enforces (after this module's rewriting), except as described in
``OUTLINES_CONDITIONAL_KEYWORDS``. An allOf that cannot be merged into one schema makes the
schema unsupported rather than unenforced."""

OUTLINES_UNENFORCED_KEYWORDS: frozenset[str] = frozenset(
    {
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "multipleOf",
        "not",
        "if",
        "then",
        "else",
        "uniqueItems",
        "contains",
        "minContains",
        "maxContains",
        "dependentRequired",
        "dependentSchemas",
        "dependencies",
        "propertyNames",
        "patternProperties",
        "minProperties",
        "maxProperties",
        "$dynamicRef",
        "$recursiveRef",
    }
)
"""Keywords outlines ignores, reported wherever they constrain the values outlines may write
(never for a keyword that cannot matter, e.g. minimum in a string schema), except as described
in ``OUTLINES_CONDITIONAL_KEYWORDS``."""

OUTLINES_CONDITIONAL_KEYWORDS: dict[str, str] = {
    "pattern": "reported in a string schema that also has minLength or maxLength (the length "
    "bound wins)",
    "oneOf": "enforced as anyOf: reported unless its branches are provably disjoint (by type, "
    "by value, or by a required property's const/enum)",
    "minItems": "beside prefixItems (outlines writes the whole tuple): reported when above the "
    "tuple's length",
    "maxItems": "beside prefixItems: reported when below the tuple's length",
    "minProperties": "enforced when no larger than the number of required properties, or 1 on "
    "an object without listed properties",
    "maxProperties": "enforced when no smaller than the number of listed properties, or 0",
    "patternProperties": "enforced where outlines writes only listed properties and none of "
    "their names matches a pattern",
}
"""Exceptions to the two tables above."""


__all__ = [
    "OUTLINES_CONDITIONAL_KEYWORDS",
    "OUTLINES_ENFORCED_KEYWORDS",
    "OUTLINES_UNENFORCED_KEYWORDS",
]
