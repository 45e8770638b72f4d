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
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import asyncpg

from scheduler.db import Conn
from scheduler.errors import Fenced
from scheduler.rows import FenceState
from scheduler.sql import load

Q = load("fence")


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
    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def advance(self, epoch: int, node_id: str, *, lock_timeout: float = 5.0) -> bool:
        """Raise the fence to ``epoch``. False when a newer epoch already holds it."""
        async with self._pool.acquire() as conn, conn.transaction():
            await conn.execute(f"SET LOCAL lock_timeout = '{int(lock_timeout * 1000)}ms'")
            got = await conn.fetchval(Q["advance"], epoch, node_id)
            return got is not None

    async def heartbeat(self, epoch: int) -> None:
        """Record that the leader of ``epoch`` is alive; raises ``Fenced`` if superseded."""
        async with self._pool.acquire() as conn:
            got = await conn.fetchval(Q["heartbeat"], epoch)
            if got is None:
                state = await conn.fetchrow(Q["read"])
                raise Fenced(epoch, state["epoch"] if state else None)

    async def read(self) -> FenceState:
        async with self._pool.acquire() as conn:
            row = await conn.fetchrow(Q["read"])
        if row is None:
            return FenceState(0, None, None, None)
        return FenceState(row["epoch"], row["leader_node"], row["elected_at"], row["renewed_at"])
