"""Deterministic fuzzed JSON schemas with instances, from the shared data's feature families:
strings with patterns, formats and length bounds, bounded numbers, enums and consts with odd
characters and unicode, nested objects with optional and additional properties, bounded arrays,
anyOf/oneOf, and schemas that refer to themselves (``{"$ref": "#"}``)."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import jsonschema

Schema = dict[str, Any]

# Texts with quotes, escapes, control characters, non-ASCII letters and emoji (tokens that
# hold part of a character's UTF-8 bytes).
ODD = ['a"b', "back\\slash", "tab\there", "nl\nx", "nul\u0000x", "é", "naïve café"]
ODD += ["中文字符", "emoji 😀 ok", "🎉🎉", "\u00a0nbsp", "<tag>", "a/b", "{}[]", ":,", " lead", ""]
WORDS = ["alpha", "hello", "world", "x", "planDate", "foo", "bar", "value", "id", "children"]
WORDS += ["@jdt.path", "$ref", "a b", "key_1", "Ωμέγα"]
PATTERNS: dict[str, Callable[[random.Random], str]] = {
    "^[a-z]{2,5}$": lambda r: "".join(r.choice("abcxyz") for _ in range(r.randint(2, 5))),
    "^\\d{3}-\\d{4}$": lambda r: f"{r.randint(0, 999):03d}-{r.randint(0, 9999):04d}",
    "^(foo|bar|baz)+$": lambda r: "".join(r.choice(["foo", "bar", "baz"]) for _ in range(2)),
    "^é+ü?$": lambda r: "é" * r.randint(1, 3) + r.choice(["", "ü"]),
}
FORMATS = {
    "date": ["2024-01-31", "1999-12-01"],
    "date-time": ["2024-01-31T12:34:56Z", "2020-02-29T00:00:00+01:00"],
    "email": ["a@b.co", "first.last@example.org"],
    "uuid": ["123e4567-e89b-12d3-a456-426614174000"],
    "ipv4": ["192.168.0.1"],
}
_LEAVES = ("string", "bounded", "pattern", "format", "integer", "number", "enum", "const", "bool")


def _text(r: random.Random) -> str:
    return r.choice(WORDS) if r.random() < 0.45 else r.choice(ODD)


def _leaf(r: random.Random, kind: str) -> Schema:
    if kind == "string":
        return {"type": "string"}
    if kind == "bounded":
        low = r.randint(0, 3)
        return {"type": "string", "minLength": low, "maxLength": low + r.randint(0, 8)}
    if kind == "pattern":
        return {"type": "string", "pattern": r.choice(sorted(PATTERNS))}
    if kind == "format":
        return {"type": "string", "format": r.choice(sorted(FORMATS))}
    if kind == "integer":
        low = r.randint(-50, 10)
        return {"type": "integer", "minimum": low, "maximum": low + r.randint(0, 2000)}
    if kind == "number":
        return {"type": "number", "minimum": round(r.uniform(-10, 0), 2)}
    if kind == "enum":
        return {"enum": list(dict.fromkeys([_text(r) for _ in range(r.randint(1, 4))] + [7]))}
    if kind == "const":
        return {"const": r.choice([_text(r), _text(r), 42, None])}
    return {"type": "boolean"}


def schema(r: random.Random, depth: int = 0) -> Schema:
    """A random schema; containers (objects, arrays, anyOf/oneOf) down to ``depth`` 2."""
    containers = ("object", "object", "array", "anyOf", "oneOf") if depth < 2 else ()
    kind = r.choice(_LEAVES + containers)
    if kind in _LEAVES:
        return _leaf(r, kind)
    if kind == "object":
        names = list(dict.fromkeys(r.choice(WORDS + ODD[:8]) for _ in range(r.randint(1, 4))))
        out: Schema = {"type": "object", "properties": {n: schema(r, depth + 1) for n in names}}
        if required := [n for n in names if r.random() < 0.5]:
            out["required"] = required
        if r.random() < 0.5:
            out["additionalProperties"] = False
        return out
    if kind == "array":
        low = r.randint(0, 2)
        return {"type": "array", "items": schema(r, depth + 1), "minItems": low,
                "maxItems": low + r.randint(0, 3)}  # fmt: skip
    # Branches of distinct types, so a oneOf stays exclusive.
    branches = [{"type": t} for t in r.sample(["integer", "boolean", "null"], 2)]
    return {kind: [*branches, {"type": "string", "maxLength": 6}]}


def top_schema(r: random.Random) -> Schema:
    """A random schema in an object (most often), at times one that refers to itself."""
    out = schema(r)
    if out.get("type") != "object" and r.random() < 0.7:
        out = {"type": "object", "properties": {"v": out}, "required": ["v"]}
    if r.random() < 0.3:
        kids = {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}
        extra = r.choice([False, {"$ref": "#"}])
        properties = {"v": out, "kids": kids}
        out = {"type": "object", "properties": properties, "additionalProperties": extra}
    return out


def value(r: random.Random, s: Schema, root: Schema, depth: int = 0) -> Any:
    """A value meant to be valid under ``s`` (``root`` is what ``$ref: #`` names)."""
    if s.get("$ref") == "#":
        return {} if depth > 2 else value(r, root, root, depth + 1)
    if "const" in s:
        return s["const"]
    if "enum" in s:
        return r.choice(s["enum"])
    for key in ("anyOf", "oneOf"):
        if key in s:
            return value(r, r.choice(s[key]), root, depth)
    kind = s.get("type")
    if kind == "string":
        if "pattern" in s:
            return PATTERNS[s["pattern"]](r)
        if "format" in s:
            return r.choice(FORMATS[s["format"]])
        if "maxLength" in s:
            n = r.randint(s.get("minLength", 0), s["maxLength"])
            return "".join(r.choice("aé中😀 x") for _ in range(n))
        return _text(r)
    if kind == "integer":
        return r.randint(s.get("minimum", -100), s.get("maximum", 10**6))
    if kind == "number":
        return round(r.uniform(s["minimum"], 1e4), r.randint(0, 4))
    if kind == "boolean":
        return r.random() < 0.5
    if kind == "object":
        required = set(s.get("required", ()))
        out = {
            name: value(r, sub, root, depth)
            for name, sub in s.get("properties", {}).items()
            if name in required or r.random() < 0.6
        }
        if isinstance(s.get("additionalProperties"), dict) and r.random() < 0.6:
            out["zz"] = value(r, s["additionalProperties"], root, depth)
        return out
    if kind == "array":
        low = s.get("minItems", 0)
        count = r.randint(low, s.get("maxItems", low + 2))
        return [value(r, s["items"], root, depth) for _ in range(count)]
    return None


def mutant(r: random.Random, v: Any) -> Any:
    """A neighbour of ``v`` that is often invalid (a walk then stops part way)."""
    if isinstance(v, dict) and v and r.random() < 0.6:
        key = r.choice(list(v))
        return {**v, key: mutant(r, v[key])}
    if isinstance(v, list) and v and r.random() < 0.6:
        return [*v[:-1], mutant(r, v[-1])]
    if isinstance(v, str):
        return r.choice([v + "😀", v[:-1], v.upper(), 5])
    return r.choice(["x", 3.5, None, [], {"q": 1}, -7])


def cases(seed: int, count: int) -> Iterator[tuple[Schema, list[tuple[Any, bool]]]]:
    """``count`` schemas from ``seed``, each with instances and their validity as
    ``jsonschema`` (draft 2020-12, formats checked) sees it."""
    for i in range(count):
        r = random.Random(f"{seed}:{i}")
        s = top_schema(r)
        validator = jsonschema.Draft202012Validator(s, format_checker=jsonschema.FormatChecker())
        instances = []
        for _ in range(2):
            v = value(r, s, s)
            for candidate in (v, mutant(r, v)):
                instances.append((candidate, validator.is_valid(candidate)))
        yield s, instances
