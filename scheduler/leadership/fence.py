"""Database fencing: the guarantee that a stale leader cannot act (DESIGN §1.3, §4).

A leader's lease in etcd tells *it* whether it may act; the fence makes PostgreSQL
enforce it. ``advance(epoch)`` raises ``leader_fence.epoch`` when a replica wins, and
``fenced_transaction(conn, epoch)`` opens a transaction that first locks the fence row
``FOR SHARE`` and checks it still holds this epoch. The share lock matters twice: a new
leader's ``advance`` waits for in-flight claims of the old one to finish, and once it
has committed, every later fenced transaction of the old leader raises ``Fenced``. So no
write of a zombie can commit after a newer leader fenced, however long it was paused.

That check only makes a zombie give up early; the database enforces the fence itself.
The claim's writes carry the epoch predicate (dispatch.sql), and the commit-time trigger
``jobs_dispatch_fenced`` (migration 0006) refuses any transaction that leaves a job
newly dispatched under an epoch other than the fence's, whatever path wrote it; its
refusal, raised at COMMIT, surfaces here as ``Fenced`` too.

A zombie can also *hold* the fence: frozen while its backend blocks sending a claim's
result, its transaction keeps the share lock and no server timeout ends it (see
``scheduler.leadership.policy.session_settings``). So ``advance`` does not only wait: when its
update has not got the row after ``takeover_grace``, it terminates the sessions that
``pg_blocking_pids`` names as holding it *and* look like fenced transactions (named
``duetime:<node id>``, only row-level locks on the fence: never a migration's DDL or an
operator's session), again every ``takeover_grace`` until it gets it. Those are
transactions of an older epoch by construction (the new leader won etcd after the old
lease expired); ending one rolls it back, which leaves its claimed rows ``pending``
(nothing is lost).
Terminating another role's session needs that role's privileges or
``pg_signal_backend``; without them the takeover is logged and the update waits.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import asyncpg

from scheduler.config import DEFAULT_DB_TIMEOUT
from scheduler.db import Conn, checked_acquire_timeout
from scheduler.errors import Fenced
from scheduler.log import get_logger
from scheduler.rows import FenceState
from scheduler.sql import load

Q = load("fence")
log = get_logger(__name__)

#: Shortest pause between two rounds of terminating blockers (a grace of 0 is allowed).
MIN_TAKEOVER_INTERVAL = 0.05


#: The commit-time trigger (and constraint name) that refuses a stale dispatch.
FENCE_CONSTRAINT = "jobs_dispatch_fenced"


@asynccontextmanager
async def fenced_transaction(conn: Conn, epoch: int) -> AsyncIterator[None]:
    """A transaction that commits only while ``epoch`` is the newest fenced epoch."""
    try:
        async with conn.transaction():
            current = await conn.fetchval(Q["lock"])
            if current != epoch:
                raise Fenced(epoch, current)
            yield
    except asyncpg.IntegrityConstraintViolationError as exc:
        if exc.constraint_name != FENCE_CONSTRAINT:
            raise
        raise Fenced(epoch, await conn.fetchval(Q["read"])) from exc


class FenceStore:
    def __init__(
        self, pool: asyncpg.Pool, *, acquire_timeout: float = DEFAULT_DB_TIMEOUT
    ) -> None:
        """``acquire_timeout``: see ``scheduler.db.checked_acquire_timeout``."""
        self._pool = pool
        self._acquire_timeout = checked_acquire_timeout(acquire_timeout)

    async def advance(
        self,
        epoch: int,
        node_id: str,
        *,
        lock_timeout: float = 5.0,
        takeover_grace: float | None = None,
    ) -> bool:
        """Raise the fence to ``epoch``. False when a newer epoch already holds it.

        Waits at most ``lock_timeout`` for the row (``LockNotAvailableError`` then);
        with ``takeover_grace``, sessions still holding it after that long are
        terminated (module docstring)."""
        async with self._pool.acquire(timeout=self._acquire_timeout) as conn, conn.transaction():
            # the session's statement_timeout (one TTL) must not cut this wait short
            await conn.execute(Q["advance_limits"], f"{int(lock_timeout * 1000)}ms",
                               f"{int(lock_timeout * 1000) + 1000}ms")  # fmt: skip
            update = asyncio.ensure_future(conn.fetchval(Q["advance"], epoch, node_id))
            try:
                if takeover_grace is not None:
                    await self._take_over(update, conn.get_server_pid(), takeover_grace)
                got = await update
            finally:
                if not update.done():
                    update.cancel()
                    await asyncio.gather(update, return_exceptions=True)
            return got is not None

    async def _take_over(self, update: asyncio.Future[Any], pid: int, grace: float) -> None:
        """Until ``update`` is done: every ``grace`` seconds, terminate what blocks ``pid``."""
        interval = max(grace, MIN_TAKEOVER_INTERVAL)
        while not update.done():
            await asyncio.wait({update}, timeout=interval)
            if update.done():
                return
            try:
                async with self._pool.acquire(timeout=self._acquire_timeout) as conn:
                    ended = await conn.fetch(Q["terminate_blockers"], pid)
            except asyncpg.InsufficientPrivilegeError as exc:
                log.error(
                    "fence_takeover_refused",
                    error=str(exc),
                    hint="grant pg_signal_backend to the scheduler role, or run every "
                    "replica as the same PostgreSQL user",
                )
                return
            if ended:
                log.warning(
                    "fence_blockers_terminated",
                    sessions=[
                        {"pid": r["pid"], "application_name": r["application_name"],
                         "state": r["state"], "wait_event": r["wait_event"]}
                        for r in ended
                    ],
                )  # fmt: skip

    async def heartbeat(self, epoch: int) -> None:
        """Record that the leader of ``epoch`` is alive; raises ``Fenced`` if superseded."""
        async with self._pool.acquire(timeout=self._acquire_timeout) as conn:
            got = await conn.fetchval(Q["heartbeat"], epoch)
            if got is None:
                state = await conn.fetchrow(Q["read"])
                raise Fenced(epoch, state["epoch"] if state else None)

    async def read(self) -> FenceState:
        async with self._pool.acquire(timeout=self._acquire_timeout) as conn:
            row = await conn.fetchrow(Q["read"])
        if row is None:
            return FenceState(0, None, None, None)
        return FenceState(row["epoch"], row["leader_node"], row["elected_at"], row["renewed_at"])
