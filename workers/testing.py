"""Test your handlers without a broker or a worker (documented as ``duetime.testing``).

``run_task`` calls a registered handler the way the worker would — same ``JobContext``,
same timeout — on a connection you provide, typically inside a transaction your test
rolls back::

    async with pool.acquire() as conn:
        tx = conn.transaction()
        await tx.start()
        try:
            await run_task("send_email", {"user_id": 7}, db=conn)
            assert await conn.fetchval("SELECT emailed_at FROM users WHERE id = 7")
        finally:
            await tx.rollback()

A plain ``def`` handler runs on a thread with the synchronous ``ctx``
(``SyncJobContext``) it gets in the worker, its ``ctx.db`` calls sent to ``db`` on the
test's event loop.

It does not exercise the ledger, retries or acks; it lets a task's own logic be tested
in milliseconds. ``drain`` (``workers.drain``) runs the due jobs of a test database end
to end through the worker's code path, ledger and retries included.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any, cast

from scheduler.clock import SYSTEM_CLOCK
from workers.context import JobContext
from workers.drain import DrainReport, drain, drain_async
from workers.lifecycle import WorkerState
from workers.registry import AsyncHandler, Registry, SyncHandler, default_registry
from workers.sync_db import Bridge, SyncJobContext

__all__ = ["DrainReport", "drain", "drain_async", "make_context", "run_task"]


async def _alive() -> bool:
    return True


def make_context(
    *,
    db: Any,
    job_id: int = 1,
    attempt: int = 1,
    max_attempts: int = 5,
    task: str = "test",
    queue: str = "default",
    due_at: datetime | None = None,
    idempotency_key: str | None = None,
    heartbeat: Callable[[], Awaitable[bool]] | None = None,
    state: WorkerState | None = None,
) -> JobContext:
    """A ``JobContext`` with test defaults; ``heartbeat()`` answers True unless given."""
    return JobContext(
        job_id=job_id,
        attempt=attempt,
        max_attempts=max_attempts,
        due_at=due_at or SYSTEM_CLOCK.now(),
        task=task,
        queue=queue,
        # the key the handler sees, as given: a test names ctx.idempotency_key directly
        # (the worker's is scheduler.messages.effective_key of the row)
        idempotency_key=idempotency_key or f"job:{job_id}",
        db=db,
        beat=heartbeat or _alive,
        state=state,
    )


async def run_task(
    name: str,
    payload: dict[str, Any] | None = None,
    *,
    db: Any,
    registry: Registry | None = None,
    **context: Any,
) -> Any:
    """Run registered task ``name`` once under its timeout; return what it returns.

    Exceptions (``Retry``, ``Fail``, ``TimeoutError``, anything) propagate to the test.
    ``ctx.state`` is the registry's worker state (what its startup hooks set, if the
    test ran them with ``await registry.lifecycle.start()``) unless ``state=`` is given.
    """
    source = registry if registry is not None else default_registry
    spec = source.get(name)
    if spec is None:
        raise LookupError(source.unknown_message(name))
    context.setdefault("state", source.lifecycle.state)
    ctx = make_context(db=db, task=name, **context)
    body = {} if payload is None else payload
    if not spec.sync:
        async with asyncio.timeout(spec.timeout):
            return await cast(AsyncHandler, spec.handler)(ctx, body)
    bridge = Bridge(asyncio.get_running_loop(), timeout=spec.timeout)
    try:
        async with asyncio.timeout(spec.timeout):
            return await asyncio.to_thread(
                cast(SyncHandler, spec.handler), SyncJobContext(ctx, bridge), body
            )
    finally:
        bridge.close()
