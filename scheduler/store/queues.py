"""QueueStore: the queues an operator declared (``sql/queues.sql``, migration 0008).

Only jobs of a declared queue are dispatched, so only declared names ever become broker
queues: a producer writing a new ``queue`` value cannot make RabbitMQ create anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from scheduler import db
from scheduler.jobspec import validate_queue
from scheduler.sql import load
from scheduler.store.conn import PooledStore

Q = load("queues")

#: Rows ``list`` returns at most (undeclared names come last: a producer may write many).
LIST_LIMIT = 1000


@dataclass(frozen=True, slots=True)
class QueueRow:
    name: str
    declared: bool
    created_at: datetime | None
    paused: bool
    pending: int
    dispatched: int
    held: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "declared": self.declared,
            "created_at": self.created_at.isoformat() if self.created_at else None,
            "paused": self.paused,
            "pending": self.pending,
            "dispatched": self.dispatched,
            "held": self.held,
        }


async def declare_queues(url: str, names: Sequence[str], *, timeout: float) -> int:
    """Declare ``names`` in the database at ``url`` (``duetime migrate`` with the
    ``queues`` setting, as the schema owner); returns how many were new."""
    for name in names:
        validate_queue(name)
    conn = await db.connect(url, timeout=timeout, application_name="duetime:migrate")
    try:
        added = await conn.fetch(Q["add_many"], list(names))
        if added:
            await conn.execute(Q["wake"])
    finally:
        await conn.close()
    return len(added)


class QueueStore(PooledStore):
    async def add(self, name: str) -> bool:
        """Declare ``name``; False when it already was. Wakes the dispatcher, so jobs
        held for it are dispatched at once."""
        validate_queue(name)
        async with self._db.acquire() as conn:
            added = await conn.fetchval(Q["add"], name) is not None
            await conn.execute(Q["wake"])
        return added

    async def remove(self, name: str) -> tuple[bool, int, int]:
        """Undeclare ``name``: (whether it was declared, its pending jobs, now held, and
        its dispatched jobs, which workers still finish)."""
        validate_queue(name)
        async with self._db.acquire() as conn, conn.transaction():
            removed = await conn.fetchval(Q["remove"], name) is not None
            live = await conn.fetchrow(Q["live_jobs"], name)
        assert live is not None  # an aggregate returns one row
        return removed, int(live["pending"]), int(live["dispatched"])

    async def set_paused(self, name: str, paused: bool) -> bool:
        """Pause (nothing new of the queue is dispatched; running jobs finish) or resume
        it; False when it is not declared. Resuming wakes the dispatcher. The flag is a
        row of the database, so it holds for every leader, before and after a failover."""
        validate_queue(name)
        async with self._db.acquire() as conn:
            found = await conn.fetchval(Q["set_paused"], name, paused) is not None
            if found and not paused:
                await conn.execute(Q["wake"])
        return found

    async def declared(self, name: str) -> bool:
        """Whether ``name`` is declared."""
        async with self._db.acquire() as conn:
            return bool(await conn.fetchval(Q["is_declared"], name))

    async def list(self, limit: int = LIST_LIMIT) -> list[QueueRow]:
        async with self._db.acquire() as conn:
            records = await conn.fetch(Q["list"], limit)
        return [
            QueueRow(
                name=r["name"],
                declared=r["declared"],
                created_at=r["created_at"],
                paused=r["paused"],
                pending=int(r["pending"]),
                dispatched=int(r["dispatched"]),
                held=int(r["held"]),
            )
            for r in records
        ]
