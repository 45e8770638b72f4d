"""Database fencing: the guarantee that a stale leader cannot act (DESIGN §1.3, §4).

It sits in the store layer because the duties below leadership open every fenced
write through it; the leadership layer only raises the fence (``FenceStore.advance``).

A leader's lease in etcd tells *it* whether it may act; the fence makes PostgreSQL
enforce it. ``advance(epoch)`` (``scheduler.store.fence.FenceStore``, where every fence
statement runs) raises ``leader_fence.epoch`` when a replica wins, and
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

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import asyncpg

from scheduler.errors import Fenced
from scheduler.store.conn import Conn
from scheduler.store.fence import fence_epoch, lock_fence

#: The commit-time trigger (and constraint name) that refuses a stale dispatch.
FENCE_CONSTRAINT = "jobs_dispatch_fenced"


@asynccontextmanager
async def fenced_transaction(conn: Conn, epoch: int) -> AsyncIterator[None]:
    """A transaction that commits only while ``epoch`` is the newest fenced epoch."""
    try:
        async with conn.transaction():
            current = await lock_fence(conn)
            if current != epoch:
                raise Fenced(epoch, current)
            yield
    except asyncpg.IntegrityConstraintViolationError as exc:
        if exc.constraint_name != FENCE_CONSTRAINT:
            raise
        raise Fenced(epoch, await fence_epoch(conn)) from exc
