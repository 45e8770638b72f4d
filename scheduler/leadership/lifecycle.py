"""The outer life of a scheduler replica: open what it needs, retrying while
PostgreSQL is unreachable, report ready, run until ``stop``, and close everything
whatever happened.

Apart from the replica's term logic so its rules read on their own: a permanent
refusal at start (bad password, no such database) raises at once; a stop requested while the first
connections are still being retried returns without running; ``close`` runs after the
body however it ended (returned, raised, or was cancelled).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

from scheduler.startup import start_with_retry

__all__ = ["run_replica"]

#: What a replica runs once open: it is handed the task that finishes when stop is set.
Body = Callable[["asyncio.Task[Any]"], Awaitable[None]]


async def run_replica(
    *,
    node_id: str,
    stop: asyncio.Event,
    open_: Callable[[], Awaitable[None]],
    body: Body,
    close: Callable[[], Awaitable[None]],
    on_ready: Callable[[], None] | None = None,
) -> None:
    """``open_`` (retried until ``stop``), ``on_ready()``, ``body(stop_waiter)``, then
    ``close()``; every log line inside carries ``node_id``."""
    with structlog.contextvars.bound_contextvars(node_id=node_id):
        if not await start_with_retry(open_, stop, service="scheduler"):
            return
        stop_waiter = asyncio.create_task(stop.wait(), name="replica:stop")
        try:
            if on_ready is not None:
                on_ready()
            await body(stop_waiter)
        finally:
            stop_waiter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await stop_waiter
            await close()
