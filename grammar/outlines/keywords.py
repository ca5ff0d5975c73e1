"""The JSON-schema keywords outlines-core's converter enforces as written, the ones it ignores,
and the exceptions, as data (``faithful`` applies them). Each entry is backed by a test
in ``tests/grammar/test_grammar_outlines.py``."""

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
        "format",
        "anyOf",
        "oneOf",
        "allOf",
        "$ref",
        "minProperties",
        "maxProperties",
        "patternProperties",
    }
)
"""Keywords outlines enforces where it reads them, except as described in
``OUTLINES_CONDITIONAL_KEYWORDS``. outlines reads one of properties, allOf, anyOf, oneOf,
prefixItems, enum, const, $ref, type per subschema (the first present); every other assertion
beside it is reported as not enforced, wherever it could reject what outlines writes."""

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
        "$dynamicRef",
        "$recursiveRef",
    }
)
"""Keywords outlines ignores, reported wherever they constrain the values outlines may write
(never for a keyword that cannot matter, e.g. minimum in a string schema)."""

OUTLINES_CONDITIONAL_KEYWORDS: dict[str, str] = {
    "allOf": "one subschema (after dropping any-value members); several are refused: outlines "
    "concatenates their regexes",
    "oneOf": "written as anyOf: reported unless its branches are provably disjoint",
    "required": "names listed in properties; reported for other names, and for a property "
    "outlines leaves out at its $ref recursion limit (four nested $ref)",
    "pattern": "ECMA-262 constructs that mean the same in Rust regex and can only match text "
    "JSON writes unescaped (\\d, \\w and . as ECMA reads them); reported beside minLength or "
    "maxLength (outlines reads the length) and for lookaround, \\s, \\b, \\p, backreferences",
    "format": "uuid only (outlines' date, date-time, time, email and uri regexes admit invalid "
    "strings or break the JSON); reported beside minLength, maxLength or pattern",
    "minItems": "beside prefixItems (outlines writes the whole tuple): reported when above the "
    "tuple's length",
    "maxItems": "beside prefixItems: reported when below the tuple's length",
    "minProperties": "enforced when no larger than the number of required properties, or 1 on "
    "an object without listed properties (outlines may write a key twice)",
    "maxProperties": "enforced when no smaller than the number of listed properties, or 0 on "
    "an object without listed properties (outlines reads no other bound there)",
    "patternProperties": "enforced where outlines writes only listed properties and none of "
    "their names matches a pattern",
    "unevaluatedItems": "enforced beside items or prefixItems (it then sees no item)",
    "unevaluatedProperties": "enforced beside properties or additionalProperties (it then sees "
    "no property)",
}
"""Exceptions to the two tables above."""


__all__ = [
    "OUTLINES_CONDITIONAL_KEYWORDS",
    "OUTLINES_ENFORCED_KEYWORDS",
    "OUTLINES_UNENFORCED_KEYWORDS",
]
