"""FenceStore: the statements on ``duetime.leader_fence`` (``sql/fence.sql``).

What the fence guarantees, and how ``advance`` takes the row over from a frozen zombie,
is ``scheduler.store.fenced``'s docstring; ``lock_fence`` and ``fence_epoch`` are the two
statements its ``fenced_transaction`` runs on the caller's connection.
"""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg

from scheduler.errors import Fenced
from scheduler.log import get_logger
from scheduler.sql import load
from scheduler.store.conn import Conn, PooledStore
from scheduler.store.rows import FenceState, from_record

Q = load("fence")
log = get_logger("scheduler.store.fenced")

#: Shortest pause between two rounds of terminating blockers (a grace of 0 is allowed).
MIN_TAKEOVER_INTERVAL = 0.05


async def lock_fence(conn: Conn) -> int | None:
    """Lock the fence row FOR SHARE (until the transaction ends); its epoch."""
    value: int | None = await conn.fetchval(Q["lock"])
    return value


async def fence_epoch(conn: Conn) -> int | None:
    """The fence's epoch as it stands (None: no fence row)."""
    value: int | None = await conn.fetchval(Q["read"])
    return value


class FenceStore(PooledStore):
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
        terminated (``scheduler.store.fenced``'s docstring)."""
        async with self._db.acquire() as conn, conn.transaction():
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
                async with self._db.acquire() as conn:
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
        async with self._db.acquire() as conn:
            got = await conn.fetchval(Q["heartbeat"], epoch)
            if got is None:
                state = await conn.fetchrow(Q["read"])
                raise Fenced(epoch, state["epoch"] if state else None)

    async def read(self) -> FenceState:
        async with self._db.acquire() as conn:
            row = await conn.fetchrow(Q["read"])
        if row is None:
            return FenceState(0, None, None, None)
        return from_record(FenceState, row)
