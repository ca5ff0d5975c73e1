"""Local ``$ref`` resolution: one JSON-pointer reader for validation and every backend.

A local reference is ``"#"`` or ``"#/..."``: a URI fragment holding a JSON pointer (RFC 6901).
The fragment is percent-decoded first (RFC 3986: ``%25`` is ``%``, ``%2F`` is ``/``), then
split at ``/``, and each token unescaped (``~1`` is ``/``, then ``~0`` is ``~``).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote


class PointerNotFound(LookupError):
    """A JSON pointer that names no value of the document."""


def is_local_ref(ref: Any) -> bool:
    """Whether ``ref`` is a local reference: ``"#"`` or ``"#/..."``."""
    return isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))


def pointer_tokens(pointer: str) -> list[str]:
    """The reference tokens of ``pointer`` (a fragment without its ``#``: "" or "/a/b"),
    percent-decoded and unescaped."""
    decoded = unquote(pointer)
    if not decoded:
        return []
    return [t.replace("~1", "/").replace("~0", "~") for t in decoded.split("/")[1:]]


def resolve_pointer(root: Any, pointer: str) -> Any:
    """The value of ``root`` that ``pointer`` ("" or "/a/b", the part of a ref after "#") names.

    Raises:
        PointerNotFound: a token names no member or index.
    """
    node = root
    for token in pointer_tokens(pointer):
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            raise PointerNotFound(f"#{pointer}")
    return node


def resolves(root: Any, pointer: str) -> bool:
    """Whether ``pointer`` names a value of ``root``."""
    try:
        resolve_pointer(root, pointer)
    except PointerNotFound:
        return False
    return True


def resolve_local_ref(root: Any, ref: str) -> Any:
    """The target of the local reference ``ref`` ("#" or "#/..."), or None when it names
    nothing (a walk that only inspects schemas treats that as "no schema here")."""
    try:
        return resolve_pointer(root, ref[1:])
    except PointerNotFound:
        return None


def ref_target_paths(schema: Any) -> set[tuple[str, ...]]:
    """The reference tokens of every local ``$ref`` target in ``schema`` (a rewrite that moves
    what lies below one of them would break the reference)."""
    found: set[tuple[str, ...]] = set()
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if is_local_ref(ref):
                found.add(tuple(pointer_tokens(ref[1:])))
            stack.extend(v for k, v in node.items() if k not in ("enum", "const", "default"))
        elif isinstance(node, list):
            stack.extend(node)
    return found


def inside_a_target(path: tuple[str, ...], targets: set[tuple[str, ...]]) -> bool:
    """Whether some ``targets`` path lies strictly below ``path``."""
    return any(len(t) > len(path) and t[: len(path)] == path for t in targets)


__all__ = [
    "PointerNotFound",
    "inside_a_target",
    "is_local_ref",
    "pointer_tokens",
    "ref_target_paths",
    "resolve_local_ref",
    "resolve_pointer",
    "resolves",
]
