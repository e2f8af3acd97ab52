"""A request body decoded as a JSON object, with checks cheap enough to run before decoding and bounded holds on the GIL."""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
from pydantic_core import from_json


class JSONBodyError(ValueError):
    """The body is not a JSON object of text (the message says why)."""


# Work on a big body goes in slices this long: the event loop's thread gets the GIL back between them.
SCAN_SLICE = 1 << 20


def count_json_items(raw: bytes) -> int:
    """Commas and colons in `raw`: a bound on the values it decodes into (json.loads holds the GIL throughout, and
    takes about 40 ms per 1M values), so that a body of many tiny values is refused before it is decoded."""
    return _count(raw, b",:")


def _count(raw: bytes, chars: bytes) -> int:
    """How many bytes of `raw` are one of `chars`: numpy's comparisons, a slice at a time, release the GIL (and take
    half the time of bytes.count)."""
    data = np.frombuffer(raw, np.uint8)
    total = 0
    for start in range(0, len(data), 4 * SCAN_SLICE):
        piece = data[start:start + 4 * SCAN_SLICE]
        total += sum(int(np.count_nonzero(piece == char)) for char in chars)
    return total


def _decode_json(raw: bytes) -> Any:
    """json.loads; a plain-ASCII body with few escapes (base64 audio, English text) goes through pydantic's Rust
    decoder first, which holds the GIL a third as long on a big body. Its refusals are json.loads' to word."""
    if len(raw) >= SCAN_SLICE and raw.isascii() and 64 * _count(raw, b"\\") < len(raw):
        try:
            return from_json(raw)
        except ValueError:
            pass
    return json.loads(raw)


_SURROGATE = re.compile("[\ud800-\udfff]")


def _holds_lone_surrogate(value: Any) -> bool:
    """Does a decoded JSON value hold a string with a lone surrogate? JSON's escapes (and Python's decoder, on raw
    bytes) let them through, and no text encoder takes them. Escaped pairs are decoded into one character already.
    (A walk with its own stack: as deep as the decoder went.)"""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if not item.isascii() and _has_surrogate(item):  # (isascii reads a flag: base64 audio is free)
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def _has_surrogate(text: str) -> bool:
    """A lone surrogate in `text`, searched a slice at a time (see SCAN_SLICE)."""
    return any(_SURROGATE.search(text, start, start + SCAN_SLICE) is not None for start in range(0, len(text), SCAN_SLICE))


def decode_json_object(raw: bytes) -> dict[str, Any]:
    """`raw` decoded; JSONBodyError when it is not JSON, nests too deeply, is not an object or holds a lone surrogate."""
    try:
        body = _decode_json(raw)
    except ValueError as exc:  # includes UnicodeDecodeError and JSONDecodeError
        raise JSONBodyError(f"request body is not valid JSON: {exc}") from exc
    except RecursionError:
        raise JSONBodyError("request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise JSONBodyError("request body must be a JSON object")
    if _holds_lone_surrogate(body):
        raise JSONBodyError("request body holds a lone UTF-16 surrogate (\\ud800-\\udfff without its pair): not text")
    return body
