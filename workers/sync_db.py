"""The ``ctx`` of a plain ``def`` handler: ``ctx.db`` and ``ctx.heartbeat()`` callable
from its thread, in the attempt's own transaction.

``ctx.db.execute(...)`` (and ``executemany``, ``fetch``, ``fetchrow``, ``fetchval``,
with asyncpg's ``$1`` parameters) sends the call to the event loop
(``asyncio.run_coroutine_threadsafe``) where the attempt's ``LazyTransaction`` runs it,
and waits for the answer at most the task's timeout. So a thread's writes are in the
same transaction as the ledger row and the job's ``succeeded`` status, committed by the
same executor code as an async handler's: effects stay exactly-once.

Once the attempt is over (the handler returned, timed out or was cancelled) the
``Bridge`` is closed, on the loop, before the transaction is rolled back or committed:
a call from a thread still running after that raises ``AttemptAbandoned`` (a call in
flight is cancelled), so a late statement can never open a new transaction
(``workers.threads`` says what happens to such a thread).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from datetime import datetime, timedelta
from typing import Any, NoReturn

from workers.context import JobContext

__all__ = ["AttemptAbandoned", "Bridge", "SyncDB", "SyncJobContext"]


class AttemptAbandoned(RuntimeError):
    """This handler's attempt is over (it timed out, or the worker stopped it): its
    transaction was rolled back and nothing more can be done through ``ctx``."""


class Bridge:
    """Runs coroutines of one attempt on the event loop for its handler thread, until
    ``close()`` (on the loop)."""

    __slots__ = ("_closed", "_lock", "_loop", "_pending", "_timeout")

    def __init__(self, loop: asyncio.AbstractEventLoop, *, timeout: float | None) -> None:
        self._loop = loop
        self._timeout = timeout
        self._closed = False
        self._lock = threading.Lock()
        self._pending: set[concurrent.futures.Future[Any]] = set()

    @property
    def closed(self) -> bool:
        return self._closed

    def call(self, what: str, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run ``coro`` on the loop and wait for its result from this thread."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            coro.close()
            raise RuntimeError(
                f"{what}: the synchronous ctx is for plain 'def' handlers; "
                "an 'async def' handler awaits ctx.db instead"
            )
        with self._lock:
            if self._closed:
                coro.close()
                raise AttemptAbandoned(f"{what}: this attempt is over (timed out or stopped)")
            try:
                future = asyncio.run_coroutine_threadsafe(self._guarded(what, coro), self._loop)
            except RuntimeError:  # the loop is closed
                coro.close()
                raise AttemptAbandoned(f"{what}: the worker has stopped") from None
            self._pending.add(future)
        try:
            return future.result(self._timeout)
        except concurrent.futures.CancelledError:
            raise AttemptAbandoned(f"{what}: this attempt is over (timed out or stopped)") from None
        except TimeoutError:
            if future.done():  # the call itself raised TimeoutError (a statement timeout)
                raise
            future.cancel()
            raise TimeoutError(f"{what}: no answer within {self._timeout:g}s") from None
        finally:
            with self._lock:
                self._pending.discard(future)

    async def _guarded(self, what: str, coro: Coroutine[Any, Any, Any]) -> Any:
        if self._closed:  # read on the loop, where close() writes it
            coro.close()
            raise AttemptAbandoned(f"{what}: this attempt is over (timed out or stopped)")
        return await coro

    def close(self) -> None:
        """End the attempt's bridge (on the loop): later calls fail, calls in flight are
        cancelled."""
        with self._lock:
            self._closed = True
            pending, self._pending = list(self._pending), set()
        for future in pending:
            future.cancel()


class SyncDB:
    """``ctx.db`` for a plain ``def`` handler: the attempt's transaction, synchronously
    (module docstring). Savepoints and the raw connection are for ``async def``
    handlers."""

    __slots__ = ("_bridge", "_db")

    def __init__(self, db: Any, bridge: Bridge) -> None:
        self._db = db
        self._bridge = bridge

    def execute(self, query: str, *args: Any, timeout: float | None = None) -> str:
        return str(
            self._bridge.call("ctx.db.execute", self._db.execute(query, *args, timeout=timeout))
        )

    def executemany(self, command: str, args: Any, *, timeout: float | None = None) -> None:
        self._bridge.call(
            "ctx.db.executemany", self._db.executemany(command, args, timeout=timeout)
        )

    def fetch(self, query: str, *args: Any, **kwargs: Any) -> list[Any]:
        return list(self._bridge.call("ctx.db.fetch", self._db.fetch(query, *args, **kwargs)))

    def fetchrow(self, query: str, *args: Any, **kwargs: Any) -> Any:
        return self._bridge.call("ctx.db.fetchrow", self._db.fetchrow(query, *args, **kwargs))

    def fetchval(self, query: str, *args: Any, **kwargs: Any) -> Any:
        return self._bridge.call("ctx.db.fetchval", self._db.fetchval(query, *args, **kwargs))


class SyncJobContext:
    """What a plain ``def`` handler gets as ``ctx``: the facts of ``JobContext``, a
    synchronous ``db`` (``SyncDB``) and ``heartbeat()``."""

    __slots__ = ("_bridge", "_ctx", "db")

    def __init__(self, ctx: JobContext, bridge: Bridge) -> None:
        self._ctx = ctx
        self._bridge = bridge
        self.db = SyncDB(ctx.db, bridge)

    job_id = property(lambda self: self._ctx.job_id, doc="the job's id")
    attempt = property(lambda self: self._ctx.attempt, doc="this attempt's number, from 1")
    max_attempts = property(lambda self: self._ctx.max_attempts, doc="the attempt budget")
    task = property(lambda self: self._ctx.task, doc="the task's name")
    queue = property(lambda self: self._ctx.queue, doc="the job's queue")
    idempotency_key = property(
        lambda self: self._ctx.idempotency_key, doc="stable across every delivery of the job"
    )

    @property
    def due_at(self) -> datetime:
        return self._ctx.due_at

    @property
    def dependencies(self) -> tuple[Any, ...]:
        """``JobContext.dependencies``: the outcomes of the jobs this one depends on."""
        return self._ctx.dependencies

    @property
    def state(self) -> Any:
        """What the worker's startup hooks opened for handlers (``workers.lifecycle``);
        share only thread-safe things with plain ``def`` handlers."""
        return self._ctx.state

    @property
    def log(self) -> Any:
        """A structlog logger bound with job_id, attempt and task."""
        return self._ctx.log

    @property
    def is_last_attempt(self) -> bool:
        return self._ctx.is_last_attempt

    @property
    def abandoned(self) -> bool:
        """True once the attempt is over: a long loop may check it and stop early."""
        return self._bridge.closed

    @property
    def cancelled(self) -> threading.Event:
        """Set when the job is cancelled while this handler runs: check it in long loops
        and return early (the thread cannot be interrupted; its ``ctx.db`` calls fail
        with ``AttemptAbandoned`` once the attempt is over)."""
        return self._ctx.cancelled

    def progress(self, fraction: float, note: str | None = None) -> None:
        """``JobContext.progress`` from the thread (throttled, outside the transaction)."""
        self._bridge.call("ctx.progress", self._ctx.progress(fraction, note))

    def snooze(self, in_: float | timedelta, reason: str | None = None) -> NoReturn:
        """``JobContext.snooze``: raises ``Snooze``."""
        self._ctx.snooze(in_, reason)

    def heartbeat(self) -> bool:
        """``JobContext.heartbeat`` from the thread: False if the job is no longer this
        attempt's; raises ``AttemptAbandoned`` once the attempt is over."""
        return bool(self._bridge.call("ctx.heartbeat", self._ctx.heartbeat()))

    def __repr__(self) -> str:
        return (
            f"SyncJobContext(job_id={self.job_id}, attempt={self.attempt}, "
            f"task={self.task!r}, queue={self.queue!r})"
        )
