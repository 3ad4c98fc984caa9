"""Reading a request body within limits: size (``ROLLBUS_MAX_BODY_BYTES``), UTF-8,
JSON, nesting depth, finite numbers, no lone surrogates. Every failure is a
:class:`BadRequest` naming the field (``body`` for the document as a whole).

JSON is parsed by Python's ``json`` on purpose: it reads ``NaN`` / ``Infinity`` as
Python writes them, so such a value is refused naming its field rather than as
"malformed JSON". An object that names a key twice is refused naming it
(:mod:`shared.jsonkeys`): which of the two counts is undefined (RFC 8259 §4).
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

from starlette.requests import Request

from services.api.schema import MAX_JSON_DEPTH
from shared import jsonkeys


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, code: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


async def read_body(request: Request, limit: int, idle_s: float = 10.0) -> bytes:
    """The raw body, refused once it passes ``limit`` bytes (never buffered past it), or
    when nothing of it arrives for ``idle_s`` (a Content-Length larger than what is sent,
    a stalled upload: ``ROLLBUS_BODY_TIMEOUT_S``) instead of holding the request forever."""
    too_big = f"body is larger than {limit} bytes (ROLLBUS_MAX_BODY_BYTES)"
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BadRequest(too_big, "body")
    chunks: list[bytes] = []
    size = 0
    stream = request.stream()
    while True:
        try:
            async with asyncio.timeout(idle_s):
                chunk = await anext(stream)
        except StopAsyncIteration:
            break
        except TimeoutError:
            expected = f" of {declared}" if declared.isdigit() else ""
            raise BadRequest(
                f"body incomplete: {size}{expected} bytes arrived, then nothing for {idle_s:g} s"
                " (ROLLBUS_BODY_TIMEOUT_S)",
                "body",
            ) from None
        size += len(chunk)
        if size > limit:
            raise BadRequest(too_big, "body")
        chunks.append(chunk)
    return b"".join(chunks)


def parse_json(raw: bytes, *, empty: Any = None) -> Any:
    """``raw`` as JSON (``empty`` when blank), checked by :func:`check_tree`."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(f"body is not valid UTF-8 (byte {e.start})", "body") from None
    # RFC 8259 §8.1 lets a parser ignore a leading byte order mark; vLLM's (json.loads of
    # the bytes) does, and some Windows clients send one
    text = text.removeprefix("\ufeff")
    if not text.strip():
        return empty
    try:
        doc = json.loads(text, object_pairs_hook=jsonkeys.pairs)
    except RecursionError:
        raise BadRequest(f"body nests deeper than {MAX_JSON_DEPTH} levels", "body") from None
    except ValueError as e:
        raise BadRequest(f"body is not valid JSON: {e}", "body") from None
    check_tree(doc)
    return doc


_name = jsonkeys.name


def check_tree(doc: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Depth, finite numbers, valid unicode and no key given twice in an object, everywhere
    in a parsed JSON document."""
    todo: list[tuple[Any, str, int]] = [(doc, "", 1)]
    while todo:
        node, path, depth = todo.pop()
        if isinstance(node, float):
            if not math.isfinite(node):
                raise BadRequest(f"'{path or 'body'}' must be a finite number", path or "body")
        elif isinstance(node, str):
            _check_unicode(node, path)
        elif isinstance(node, dict | list):
            if depth > max_depth:
                raise BadRequest(f"body nests deeper than {max_depth} levels", "body")
            if isinstance(node, jsonkeys.Duplicated):
                where = _name(path, node.key)[:256]  # the client's to choose
                raise BadRequest(
                    f"'{where}' is given more than once in one JSON object (duplicate key)",
                    where,
                )
            if isinstance(node, list) and all(type(v) is int for v in node):
                continue  # token ids: nothing to look at, and often long
            items = node.items() if isinstance(node, dict) else enumerate(node)
            for key, value in items:
                if isinstance(key, str):
                    _check_unicode(key, path)
                todo.append((value, _name(path, key), depth + 1))


def _check_unicode(text: str, path: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        where = path or "body"
        raise BadRequest(f"'{where}' is not valid unicode (lone surrogate)", where) from None
