"""What a handler returns becomes the job's ``result`` (DESIGN §12; migration 0019).

The value is encoded here, before the attempt commits, so that what cannot be stored
fails the attempt that produced it (a retry may return something else) instead of the
batched statement it would have joined: a value PostgreSQL's jsonb refuses (a NUL
character, a lone surrogate) or one larger than ``result_max_bytes`` would otherwise
fail every neighbour in its batch and requeue them all.

``None`` stores nothing: a handler that returns nothing costs nothing (the result array
of the batched completion holds a NULL, no statement and no round trip is added).
"""

from __future__ import annotations

import json
from typing import Any

__all__ = [
    "DEFAULT_RESULT_MAX_BYTES",
    "MAX_RESULT_BYTES",
    "ResultRejected",
    "encode_result",
    "validate_max_bytes",
]

#: The default cap on an encoded result (``Settings.result_max_bytes``).
DEFAULT_RESULT_MAX_BYTES = 1024 * 1024
#: The table's own bound (CHECK jobs_result_too_large): no setting may exceed it.
MAX_RESULT_BYTES = 64 * 1024 * 1024


class ResultRejected(Exception):
    """The handler's return value cannot be stored: the attempt fails with this error."""


def encode_result(value: Any, max_bytes: int = DEFAULT_RESULT_MAX_BYTES) -> str | None:
    """``value`` as compact JSON text, or None for ``None``; ``ResultRejected`` when it
    is not JSON-serialisable, holds what jsonb refuses, or encodes to more than
    ``max_bytes`` bytes of UTF-8."""
    if value is None:
        return None
    try:
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise ResultRejected(
            f"the handler returned a value that is not JSON-serialisable "
            f"({type(value).__name__}): {exc}"
        ) from None
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise ResultRejected("the handler's result holds a lone surrogate character") from None
    if "\\u0000" in text:
        raise ResultRejected("the handler's result holds a NUL character (jsonb refuses it)")
    if size > max_bytes:
        raise ResultRejected(
            f"the handler's result is {size} bytes of JSON, over result_max_bytes "
            f"({max_bytes}); store large outputs elsewhere and return a reference"
        )
    return text


def validate_max_bytes(value: int) -> int:
    """``result_max_bytes`` checked: a whole number of bytes in 1..``MAX_RESULT_BYTES``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_RESULT_BYTES:
        raise ValueError(
            f"result_max_bytes must be a whole number of bytes in 1..{MAX_RESULT_BYTES}, "
            f"not {value!r}"
        )
    return value
