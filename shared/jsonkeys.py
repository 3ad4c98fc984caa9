"""JSON objects that name a key twice. Pure.

RFC 8259 (§4) leaves what a duplicated name means to the parser; Python's ``json`` and
msgspec keep the last value, silently. ``{"mode": "abort", "mode": "keep"}`` is then a
pause that keeps, while a proxy or log reader that keeps the first saw one that aborts:
rollbus refuses such a body instead (400 naming the key), over HTTP and over raw NATS,
for control calls and generation requests alike (README "Limits").
"""

from __future__ import annotations

import json
from typing import Any


class Duplicated(dict[str, Any]):
    """A parsed JSON object that named ``key`` more than once (its last value kept)."""

    key: str = ""


def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``' ``object_pairs_hook``: the object, as a :class:`Duplicated` when a
    key repeats (found later by :func:`duplicate`, which knows its path)."""
    obj = dict(items)
    if len(obj) == len(items):
        return obj
    dup = Duplicated(obj)
    seen: set[str] = set()
    for key, _ in items:
        if key in seen:
            dup.key = key
            break
        seen.add(key)
    return dup


def loads(data: str | bytes) -> Any:
    """``json.loads`` whose objects with a repeated key are :class:`Duplicated`."""
    return json.loads(data, object_pairs_hook=pairs)


def name(path: str, key: object) -> str:
    """The path of ``key`` (a list index or an object key) under ``path``:
    ``messages[0].role``, ``logit_bias.7``."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else str(key)


def duplicate(doc: Any) -> str | None:
    """The path of a key that an object of ``doc`` (parsed by :func:`loads`) names twice,
    or None."""
    todo: list[tuple[Any, str]] = [(doc, "")]
    while todo:
        node, path = todo.pop()
        if isinstance(node, Duplicated):
            return name(path, node.key)
        if isinstance(node, dict):
            todo += [(v, name(path, k)) for k, v in node.items() if isinstance(v, dict | list)]
        elif isinstance(node, list):
            todo += [(v, name(path, i)) for i, v in enumerate(node) if isinstance(v, dict | list)]
    return None


def duplicate_in(data: bytes) -> str | None:
    """The path of a key that the JSON document ``data`` names twice; None when none does,
    or when ``data`` is not JSON that Python reads (its decoder says what is wrong)."""
    if data.count(b":") < 2:  # fewer than two keys in all: nothing can repeat
        return None
    found: list[Duplicated] = []

    def hook(items: list[tuple[str, Any]]) -> dict[str, Any]:
        obj = pairs(items)
        if type(obj) is Duplicated:
            found.append(obj)
        return obj

    try:
        doc = json.loads(data, object_pairs_hook=hook)
    except (ValueError, RecursionError):
        return None
    # its path only when there is one: walking every list (100k token ids) to find none
    # took more than the parse (a raw NATS client's gen request: the engine's event loop)
    return duplicate(doc) if found else None
