"""What the two duties that publish job messages share: the dispatcher and the reconciler.

Both claim rows in a fenced transaction and publish them with confirms before the
transaction commits, so both need the same things: a ``Publisher`` of their own (its
own AMQP connection, named after the duty so RabbitMQ's management view tells them
apart) unless one is injected — tests and benchmarks share one and close it themselves
— on top of what every fenced duty has (``scheduler.duty.LeaderDuty``: settings, pool,
the lease check before each claim).

Both also read rows the client may be unable to decode (a payload nested deeper than
Python's JSON parser goes); ``park_unreadable`` makes each such row dead with the
reason, so it cannot fail every batch it sorts into.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import asyncpg

from scheduler.clock import SYSTEM_CLOCK, Clock
from scheduler.config import Settings
from scheduler.duty import LeaderDuty
from scheduler.metrics import JOBS_PARKED
from scheduler.publisher import DEFAULT_PUBLISH_TIMEOUT, Publisher
from scheduler.store.conn import Conn
from scheduler.store.dispatch import DispatchStore
from scheduler.store.rows import UnreadableRow


class PublishingDuty(LeaderDuty):
    """Base of ``Dispatcher`` and ``Reconciler``: a publisher of their own, or a shared one."""

    fenced_write = "fenced claim"

    def __init__(
        self,
        settings: Settings,
        pool: asyncpg.Pool,
        *,
        publish_timeout: float = DEFAULT_PUBLISH_TIMEOUT,
        publisher: Publisher | None = None,
        clock: Clock = SYSTEM_CLOCK,
        is_leader: Callable[[], bool] | None = None,
    ) -> None:
        super().__init__(settings, pool, clock=clock, is_leader=is_leader)
        self.store = DispatchStore(pool, acquire_timeout=settings.db_timeout)
        self._owns_publisher = publisher is None
        self.publisher = publisher or Publisher.from_settings(
            settings, name=f"duetime-{self.name}", publish_timeout=publish_timeout
        )

    async def setup(self) -> None:
        await self.publisher.open()

    async def teardown(self) -> None:
        if self._owns_publisher:
            await self.publisher.close()

    async def park_unreadable(self, conn: Conn, rows: Sequence[UnreadableRow]) -> int:
        """Make each row dead with why, each under a savepoint: a park the database
        refuses (a row breaking an older NOT VALID CHECK) leaves that row as it is and the
        batch intact. Returns how many were parked."""
        parked_total = 0
        for row in rows:
            reason = f"the {self.name} cannot read this row ({row.error}); parked as dead"
            try:
                async with conn.transaction():  # a savepoint
                    parked = await self.store.park(conn, row.job_id, reason)
            except asyncpg.PostgresError as exc:
                parked = False
                reason = f"{reason}; the park was refused: {type(exc).__name__}: {exc}"
            parked_total += parked
            JOBS_PARKED.labels("unreadable").inc(parked)
            self.log.error(
                "job_unreadable",
                job_id=row.job_id,
                error=reason,
                outcome="dead" if parked else "left as it is",
            )
        return parked_total

