"""Database fencing: the guarantee that a stale leader cannot act (DESIGN §1.3, §4).

A leader's lease in etcd tells *it* whether it may act; the fence makes PostgreSQL
enforce it. ``advance(epoch)`` raises ``leader_fence.epoch`` when a replica wins, and
``fenced_transaction(conn, epoch)`` opens a transaction that first locks the fence row
``FOR SHARE`` and checks it still holds this epoch. The share lock matters twice: a new
leader's ``advance`` waits for in-flight claims of the old one to finish, and once it
has committed, every later fenced transaction of the old leader raises ``Fenced``. So no
write of a zombie can commit after a newer leader fenced, however long it was paused.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import asyncpg

from scheduler.config import DEFAULT_DB_TIMEOUT
from scheduler.db import Conn
from scheduler.errors import Fenced
from scheduler.rows import FenceState
from scheduler.sql import load

Q = load("fence")


@asynccontextmanager
async def fenced_transaction(conn: Conn, epoch: int) -> AsyncIterator[None]:
    """A transaction that commits only while ``epoch`` is the newest fenced epoch."""
    async with conn.transaction():
        current = await conn.fetchval(Q["lock"])
        if current != epoch:
            raise Fenced(epoch, current)
        yield


class FenceStore:
    def __init__(
        self, pool: asyncpg.Pool, *, acquire_timeout: float = DEFAULT_DB_TIMEOUT
    ) -> None:
        """``acquire_timeout``: the longest wait for a connection from ``pool`` (a full
        pool raises ``TimeoutError`` instead of queueing forever); callers pass
        ``Settings.db_timeout``."""
        if not acquire_timeout > 0:
            raise ValueError(f"acquire_timeout must be > 0 (got {acquire_timeout!r})")
        self._pool = pool
        self._acquire_timeout = acquire_timeout

    async def advance(self, epoch: int, node_id: str, *, lock_timeout: float = 5.0) -> bool:
        """Raise the fence to ``epoch``. False when a newer epoch already holds it."""
        async with self._pool.acquire(timeout=self._acquire_timeout) as conn, conn.transaction():
            await conn.execute(f"SET LOCAL lock_timeout = '{int(lock_timeout * 1000)}ms'")
            got = await conn.fetchval(Q["advance"], epoch, node_id)
            return got is not None

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
