"""What every duty is built from: one ``DutyContext``, and what a duty derives from it.

A duty's constructor has one shape, ``Duty(ctx, *, config=None, ...)``: the context
first, then keyword-only collaborators that default to what the context implies (a
config from its settings, a publisher of the duty's own). So the replica builds every
duty alike (``DutyFactory``), and a test or benchmark builds one from
``DutyContext.standalone(settings, pool)``. The context is defined here, not in the
replica, so that duties never import the replica.

What the duties derive from their context, each defined here once:

- ``FencedWrites``: the lease check before a write (fail closed: ``LeadershipLost``
  once the lease can no longer be proven alive, before a doomed round trip, although
  the fence would refuse a stale commit anyway) and the pooled fenced transaction;
- ``duty_listener``: the kept LISTEN connection that wakes a duty.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import asyncpg

from scheduler.clock import SYSTEM_CLOCK, Clock
from scheduler.config.shards import DEFAULT_SHARD
from scheduler.errors import LeadershipLost
from scheduler.store.fence import FenceStore
from scheduler.store.fenced import fenced_transaction
from scheduler.store.listener import KeptListener

if TYPE_CHECKING:
    from scheduler.config import Settings
    from scheduler.duties.base import Duty
    from scheduler.store.conn import Conn

__all__ = ["DutyContext", "DutyFactory", "FencedWrites", "duty_listener"]


@dataclass(frozen=True)
class DutyContext:
    """What a duty may use: built once per replica, shared by every duty it runs."""

    settings: Settings
    pool: asyncpg.Pool
    fence: FenceStore
    clock: Clock
    node_id: str
    is_leader: Callable[[], bool]
    """True only inside the lease's trust window; check right before acting (fail closed)."""
    shard: str = DEFAULT_SHARD
    """The shard whose database ``pool`` is: the messages a duty publishes name it."""

    @classmethod
    def standalone(
        cls,
        settings: Settings,
        pool: asyncpg.Pool,
        *,
        clock: Clock = SYSTEM_CLOCK,
        shard: str = DEFAULT_SHARD,
    ) -> DutyContext:
        """A context without a replica (tests, benchmarks): there is no lease to ask
        about, so every write is tried and the fence alone refuses a stale one."""
        return cls(
            settings=settings,
            pool=pool,
            fence=FenceStore(pool, acquire_timeout=settings.db_timeout),
            clock=clock,
            node_id=settings.node_id,
            is_leader=_no_lease,
            shard=shard,
        )


def _no_lease() -> bool:
    return True


#: How a duty is built: every duty's class is one.
DutyFactory = Callable[[DutyContext], "Duty"]


class FencedWrites:
    """A duty's writes under the fence: the lease check, then a pooled fenced transaction.

    ``write`` names the write in the ``LeadershipLost`` raised when the lease can no
    longer be proven alive.
    """

    def __init__(self, ctx: DutyContext, *, write: str) -> None:
        self.pool = ctx.pool
        self.acquire_timeout = ctx.settings.db_timeout
        self.write = write
        self._is_leader = ctx.is_leader

    def check_lease(self) -> None:
        if not self._is_leader():
            raise LeadershipLost(f"lease not provably alive before a {self.write}")

    @asynccontextmanager
    async def transaction(self, epoch: int) -> AsyncIterator[Conn]:
        """A pooled connection in a fenced transaction of ``epoch``, after the lease check."""
        self.check_lease()
        async with (
            self.pool.acquire(timeout=self.acquire_timeout) as conn,
            fenced_transaction(conn, epoch),
        ):
            yield conn


def duty_listener(
    ctx: DutyContext,
    channel: str,
    wake: Callable[[], None],
    *,
    role: str,
    check_interval: float,
    log: Callable[[], Any],
    on_payload: Callable[[str], None] | None = None,
) -> KeptListener:
    """The LISTEN connection that wakes a duty, named ``duetime:<node>:<role>``
    (``on_payload``: told each notification's payload just before ``wake``)."""
    settings = ctx.settings
    return KeptListener(
        settings.database_url,
        channel,
        wake,
        timeout=settings.db_timeout,
        application_name=f"duetime:{settings.node_id}:{role}",
        check_interval=check_interval,
        log=log,
        clock=ctx.clock,
        on_payload=on_payload,
    )
