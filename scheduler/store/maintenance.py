"""MaintenanceStore: the maintainer's statements (``sql/maintenance.sql``, functions of
migration 0003).

Reads (which buckets are missing, expired, left over) use the pool and take no lock
stronger than ACCESS SHARE. Writes take ``conn`` inside the caller's fenced transaction;
``set_limits`` must come first in it, so the DDL that follows waits at most
``lock_timeout`` for its locks instead of queueing every later claim behind it.
"""

from __future__ import annotations

from datetime import date

from scheduler.sql import load
from scheduler.store.conn import Conn, PooledStore
from scheduler.store.rows import ExpiredBucket

Q = load("maintenance")


def _ms(seconds: float) -> str:
    return f"{max(1, round(seconds * 1000))}ms"


class MaintenanceStore(PooledStore):
    # -- reads (pool) ----------------------------------------------------------------

    async def missing_days(self, days_ahead: int) -> list[date]:
        """Days from today (UTC, database clock) to today + ``days_ahead`` without a bucket."""
        async with self._db.acquire() as conn:
            return [r["day"] for r in await conn.fetch(Q["missing_days"], days_ahead)]

    async def expired_buckets(self, retention: float) -> list[ExpiredBucket]:
        """Attached buckets whose range ended more than ``retention`` seconds ago."""
        async with self._db.acquire() as conn:
            rows = await conn.fetch(Q["expired_buckets"], float(retention))
        return [ExpiredBucket(r["day"], r["live"]) for r in rows]

    async def detached_leftovers(self) -> list[str]:
        async with self._db.acquire() as conn:
            return [r["name"] for r in await conn.fetch(Q["detached_leftovers"])]

    # -- writes (inside the caller's fenced transaction) ------------------------------

    async def set_limits(
        self, conn: Conn, *, lock_timeout: float, statement_timeout: float
    ) -> None:
        """``SET LOCAL`` lock_timeout and statement_timeout for this transaction."""
        await conn.fetchrow(Q["limits"], _ms(lock_timeout), _ms(statement_timeout))

    async def create_bucket(self, conn: Conn, day: date) -> bool:
        """Create (and attach) the bucket of ``day``; False if it exists."""
        return bool(await conn.fetchval(Q["create_bucket"], day))

    async def detach_bucket(self, conn: Conn, day: date) -> str:
        """``'detached'``, ``'live'`` (kept: a non-terminal row) or ``'missing'``."""
        return str(await conn.fetchval(Q["detach_bucket"], day))

    async def drop_detached(self, conn: Conn, name: str) -> bool:
        return bool(await conn.fetchval(Q["drop_detached"], name))

    async def prune_ledger(self, conn: Conn, retention: float, limit: int) -> int:
        return int(await conn.fetchval(Q["prune_ledger"], float(retention), limit))

    async def prune_fires(self, conn: Conn, retention: float, limit: int) -> int:
        return int(await conn.fetchval(Q["prune_fires"], float(retention), limit))

    async def prune_default(self, conn: Conn, retention: float, limit: int) -> int:
        return int(await conn.fetchval(Q["prune_default"], float(retention), limit))

    async def prune_limit_starts(self, conn: Conn, limit: int) -> int:
        """Delete at most ``limit`` logged starts that left their rate's window."""
        return int(await conn.fetchval(Q["prune_limit_starts"], limit))
