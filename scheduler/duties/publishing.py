"""What the two duties that publish job messages share: the dispatcher and the reconciler.

Both claim rows in a fenced transaction and publish them with confirms before the
transaction commits, so both need the same things: a ``Publisher`` of their own (its
own AMQP connection, named after the duty so RabbitMQ's management view tells them
apart) unless one is injected — tests and benchmarks share one and close it themselves
— and a lease check right before every fenced claim (fail closed: a leader that can no
longer prove its lease alive must not claim, even though the fence would stop a stale
commit anyway).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import asyncpg

from scheduler.clock import SYSTEM_CLOCK, Clock
from scheduler.config import Settings
from scheduler.duty import LoopDuty
from scheduler.errors import LeadershipLost
from scheduler.publisher import DEFAULT_PUBLISH_TIMEOUT, Publisher
from scheduler.store.dispatch import DispatchStore

if TYPE_CHECKING:
    from typing import Self

    from scheduler.replica import ReplicaContext


class PublishingDuty(LoopDuty):
    """Base of ``Dispatcher`` and ``Reconciler``: publisher ownership and the lease check."""

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
        super().__init__(clock=clock)
        self._is_leader = is_leader
        self.settings = settings
        self.pool = pool
        self.store = DispatchStore(pool)
        self._owns_publisher = publisher is None
        self.publisher = publisher or Publisher.from_settings(
            settings, name=f"duetime-{self.name}", publish_timeout=publish_timeout
        )

    @classmethod
    def from_context(cls, ctx: ReplicaContext) -> Self:
        """The duty a replica runs: its pool, clock and lease check."""
        return cls(ctx.settings, ctx.pool, clock=ctx.clock, is_leader=ctx.is_leader)

    def _check_leader(self) -> None:
        """Fail closed: no claim once the lease can no longer be proven alive."""
        if self._is_leader is not None and not self._is_leader():
            raise LeadershipLost("lease not provably alive before a fenced claim")

    async def setup(self) -> None:
        await self.publisher.open()

    async def teardown(self) -> None:
        if self._owns_publisher:
            await self.publisher.close()
