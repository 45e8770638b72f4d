"""Bounded polling for tests.

Tests wait for events where the code offers one; when the only observable is a state
(a row, a key, a process having exited) they poll it here, never with a bare sleep, so
every wait has a deadline and a message that says what did not happen.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, overload

T = TypeVar("T")


@overload
async def wait_for(
    predicate: Callable[[], Awaitable[T]],
    timeout: float,
    interval: float = ...,
    message: str = ...,
) -> T: ...
@overload
async def wait_for(
    predicate: Callable[[], T],
    timeout: float,
    interval: float = ...,
    message: str = ...,
) -> T: ...
async def wait_for(
    predicate: Callable[[], Any],
    timeout: float,
    interval: float = 0.05,
    message: str = "",
) -> Any:
    """Call ``predicate`` (sync or async) until it returns a truthy value; return it.

    Raises ``AssertionError`` naming ``message``, the timeout and the last value seen
    when ``timeout`` seconds pass first. Exceptions raised by the predicate propagate:
    a condition that cannot be evaluated is a test failure, not "not yet".
    """
    if timeout <= 0:
        raise ValueError("timeout must be positive")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    attempts = 0
    while True:
        attempts += 1
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        remaining = deadline - loop.time()
        if remaining <= 0:
            what = message or getattr(predicate, "__name__", repr(predicate))
            raise AssertionError(
                f"timed out after {timeout:.2f}s waiting for {what} "
                f"(last value {result!r}, {attempts} attempts)"
            )
        await asyncio.sleep(min(interval, remaining))
