"""What the worker's parts raise to each other when an outcome cannot be recorded.

Its own module because the executor, the transaction groups and the consumer all need
it, and the groups sit below the executor: defined in either, it would make them import
each other.

``CONNECTION_ERRORS`` is what turns into ``DatabaseUnavailable`` when a statement on a
connection the worker holds fails: ``scheduler.db.DB_UNAVAILABLE`` plus asyncpg's
``InterfaceError`` (the connection was closed under the statement) and
``InternalClientError``: a fast shutdown of the primary (a planned switchover) sends
``FATAL 57P01`` to idle connections too, and a statement sent while asyncpg is still
consuming that error fails with "cannot switch to state …; another operation is in
progress" before the close is noticed. The outcome is unknown either way, which the
executor already handles by requeueing.
"""

from __future__ import annotations

import asyncpg

from scheduler.db import DB_UNAVAILABLE

__all__ = ["CONNECTION_ERRORS", "AttemptRunningElsewhere", "DatabaseUnavailable"]

CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    *DB_UNAVAILABLE,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
)


class DatabaseUnavailable(Exception):
    """No outcome could be recorded (PostgreSQL unreachable, or a bug): requeue."""


class AttemptRunningElsewhere(Exception):
    """A redelivered copy of an attempt another worker process is running: requeue it
    for later (``workers.executor.Executor._running_elsewhere`` says why)."""
