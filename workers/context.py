"""``JobContext``: what a handler knows about the job it runs, and how it writes.

``ctx.db`` is the attempt's transaction (``workers.lazydb.LazyTransaction``, opened at
its first statement): what a handler writes through it commits together with the ledger
row and the job's ``succeeded`` status, or not at all (exception, timeout, crash), which
is what makes effects exactly-once. Use ``async with ctx.db.transaction():`` for a
savepoint; never commit or roll back the outer transaction yourself. For effects outside
this database pass ``ctx.idempotency_key`` on (it is stable across every delivery of the
job).
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, NoReturn

from scheduler.log import get_logger
from scheduler.store.conn import Conn
from workers.lazydb import LazyTransaction
from workers.lifecycle import WorkerState
from workers.progress import check_fraction
from workers.snooze import Snooze


@dataclass(frozen=True, slots=True)
class Dependency:
    """The outcome of a job this one depends on (``ctx.dependencies``; migration 0025).

    ``status`` is ``succeeded`` for every dependency unless the job was inserted with
    ``on_dependency_failure='run'``: then a dependency may be ``dead`` or ``cancelled``,
    with ``error`` saying why. ``result`` is what its handler returned (None: nothing).
    """

    id: int
    task: str
    status: str
    result: Any = None
    error: str | None = None

    @property
    def succeeded(self) -> bool:
        return self.status == "succeeded"


def dependencies_from(rows: Sequence[dict[str, Any]] | None) -> tuple[Dependency, ...]:
    """``Dependency`` values from the JSON array the begin statement read (ordered by id)."""
    if not rows:
        return ()
    return tuple(
        Dependency(
            id=int(r["id"]),
            task=str(r["task"]),
            status=str(r["status"]),
            result=r.get("result"),
            error=r.get("error"),
        )
        for r in rows
    )


class JobContext:
    """Read-only facts about the running job, ``db``, ``log`` and ``heartbeat()``.

    ``db`` is the attempt's transaction on a pooled connection, opened on first use
    (ledger row, your writes and the job's outcome commit together). Connections are not
    reset between jobs (one round trip saved per delivery), so keep session state
    transaction-scoped: ``SET LOCAL`` rather than ``SET``, ``pg_advisory_xact_lock`` rather than
    ``pg_advisory_lock``, no ``LISTEN``.
    """

    __slots__ = (
        "_beat",
        "_log",
        "_progress",
        "attempt",
        "cancelled",
        "db",
        "dependencies",
        "due_at",
        "idempotency_key",
        "job_id",
        "max_attempts",
        "queue",
        "state",
        "task",
    )

    def __init__(
        self,
        *,
        job_id: int,
        attempt: int,
        max_attempts: int,
        due_at: datetime,
        task: str,
        queue: str,
        idempotency_key: str,
        db: LazyTransaction | Conn,
        beat: Callable[[], Awaitable[bool]],
        cancelled: threading.Event | None = None,
        progress: Callable[[float, str | None], Awaitable[None]] | None = None,
        state: WorkerState | None = None,
        dependencies: tuple[Dependency, ...] = (),
    ) -> None:
        self.job_id = job_id
        self.attempt = attempt
        self.max_attempts = max_attempts
        self.due_at = due_at
        self.task = task
        self.queue = queue
        self.idempotency_key = idempotency_key
        self.db = db
        self._beat = beat
        self._log: Any = None
        self.state = state if state is not None else WorkerState()
        """What this worker's startup hooks opened for handlers (``workers.lifecycle``)."""
        #: set when the job is cancelled while this handler runs (``workers.cancel``):
        #: an ``async`` handler also gets ``asyncio.CancelledError`` at its next
        #: ``await``; code that computes without awaiting checks ``cancelled.is_set()``
        #: (a ``threading.Event``, so a thread may read it too) and returns early
        self.cancelled = cancelled if cancelled is not None else threading.Event()
        self._progress = progress
        #: the outcomes of the jobs this one depends on (``depends_on``, workflows), in id
        #: order, read with the row when the attempt began (no query per dependency); ()
        #: for a job without dependencies
        self.dependencies = dependencies

    @property
    def log(self) -> Any:
        """A structlog logger bound with job_id, attempt and task (created on first use)."""
        if self._log is None:
            self._log = get_logger(
                "duetime.task", job_id=self.job_id, attempt=self.attempt, task=self.task
            )
        return self._log

    @property
    def is_last_attempt(self) -> bool:
        """True when a failure now makes the job ``dead`` instead of retrying."""
        return self.attempt >= self.max_attempts

    async def heartbeat(self) -> bool:
        """Record a sign of life now (``heartbeat_at``), on a separate connection.

        The worker also beats automatically every visibility_timeout/3 while a handler
        runs; call this from long loops to be explicit. Returns False if the job is no
        longer this attempt's (the handler may stop early: its outcome will not count).
        """
        return await self._beat()

    async def progress(self, fraction: float, note: str | None = None) -> None:
        """Report how far the job got (0..1) with a short note (cut at 200 characters),
        shown by ``duetime jobs show``/``list`` and the dashboard. Written outside the
        attempt's transaction (it stays if the handler then fails), at most a few times
        a second: call it as often as you like (``workers.progress``)."""
        check_fraction(fraction)
        if self._progress is not None:
            await self._progress(fraction, note)

    def snooze(self, in_: float | timedelta, reason: str | None = None) -> NoReturn:
        """End this attempt and run the job again ``in_`` seconds from now without using
        an attempt (``workers.snooze``); raises ``Snooze``, so ``ctx.db`` work is
        rolled back. Bounded by the job's ``max_snoozes``."""
        raise Snooze(in_, reason)

    def __repr__(self) -> str:
        return (
            f"JobContext(job_id={self.job_id}, attempt={self.attempt}, task={self.task!r}, "
            f"queue={self.queue!r})"
        )
