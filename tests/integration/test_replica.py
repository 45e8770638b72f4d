"""The replica against the real etcd and PostgreSQL, in-process (several ``Replica``
objects on one event loop). Process-level failover (kill -9, SIGSTOP, SIGTERM, etcd
partitions) lives in ``tests/chaos/test_failover.py``.

Each test gets its own migrated database (the fence row's epochs come from one etcd)
and its own etcd key prefix.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import asyncpg
import pytest

from scheduler import db
from scheduler.config import Settings
from scheduler.config.shards import DEFAULT_SHARD
from scheduler.duties import FenceHeartbeat, default_duties
from scheduler.duties.base import Duty, DutyLoop, LeaderTerm
from scheduler.duties.context import DutyContext
from scheduler.duties.fence_heartbeat import FenceHeartbeatConfig
from scheduler.errors import Fenced
from scheduler.leadership.policy import session_settings
from scheduler.leadership.replica import Replica
from scheduler.metrics import DUTY_FAILURES, LEADER_TRANSITIONS
from scheduler.store.fence import FenceStore
from scheduler.store.fenced import fenced_transaction
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(90)

TTL = 2.0


@pytest.fixture
def base_settings(settings: Settings, migrated_dsn: str) -> Settings:
    return dataclasses.replace(settings, database_url=migrated_dsn, lease_ttl=TTL)


@pytest.fixture
async def fence_pool(migrated_dsn: str) -> AsyncIterator[asyncpg.Pool]:
    pool = await db.create_pool(migrated_dsn, max_size=4)
    yield pool
    await pool.close()


class Running:
    """Replicas running as owned tasks; ``stop`` and cleanup are bounded."""

    def __init__(self) -> None:
        self.items: dict[str, tuple[Replica, asyncio.Event, asyncio.Task[None]]] = {}

    def start(
        self,
        settings: Settings,
        name: str,
        factory: Callable[[DutyContext], Sequence[Duty]] = default_duties,
    ) -> Replica:
        replica = Replica(dataclasses.replace(settings, node_id=name), factory)
        stop = asyncio.Event()
        task = asyncio.create_task(replica.run_until_stopped(stop), name=f"replica:{name}")
        self.items[name] = (replica, stop, task)
        return replica

    async def stop(self, name: str, timeout: float = 10.0) -> None:
        _, stop, task = self.items[name]
        stop.set()
        await asyncio.wait_for(task, timeout)

    async def close(self) -> None:
        for _, stop, _ in self.items.values():
            stop.set()
        tasks = [task for _, _, task in self.items.values()]
        _, pending = await asyncio.wait(tasks, timeout=10) if tasks else (set(), set())
        for task in pending:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@pytest.fixture
async def running() -> AsyncIterator[Running]:
    group = Running()
    try:
        yield group
    finally:
        await group.close()


def leaders(group: Running) -> list[Replica]:
    return [r for r, _, _ in group.items.values() if r.is_leader]


def events(replica: Replica, event: str) -> list[tuple[int, str | None]]:
    return [(t.epoch, t.reason) for t in replica.transitions if t.event == event]


def counter(metric: Any, *labels: str) -> float:
    return float(metric.labels(*labels)._value.get())


async def test_two_replicas_one_leader_and_handover_on_stop(
    base_settings: Settings, running: Running, fence_pool: asyncpg.Pool, unique: str
) -> None:
    a = running.start(base_settings, f"a-{unique}")
    await wait_for(lambda: a.is_leader, timeout=10, message="a leads")
    b = running.start(base_settings, f"b-{unique}")
    await wait_for(lambda: b.elector is not None, timeout=5, message="b started")

    # b stays a standby while a holds the lease (sampled over more than one TTL)
    loop = asyncio.get_running_loop()
    until = loop.time() + TTL * 1.5
    while loop.time() < until:
        assert [r.node_id for r in leaders(running)] == [a.node_id]
        await asyncio.sleep(0.05)
    assert a.term is not None
    fence = await FenceStore(fence_pool).read()
    assert (fence.epoch, fence.leader_node) == (a.term.epoch, a.node_id)
    first_renewal = fence.renewed_at

    async def heartbeat_advanced() -> bool:
        state = await FenceStore(fence_pool).read()
        return (
            state.renewed_at is not None
            and first_renewal is not None
            and (state.renewed_at > first_renewal)
        )

    await wait_for(heartbeat_advanced, timeout=TTL, message="fence heartbeat renewed_at")

    old_epoch = a.term.epoch
    started = loop.time()
    await running.stop(a.node_id)
    await wait_for(lambda: b.is_leader, timeout=2, message="b leads after a resigned")
    handover = loop.time() - started
    assert handover < 1.0, f"handover took {handover:.3f}s"
    assert b.term is not None and b.term.epoch > old_epoch
    assert events(a, "stepping_down") == [(old_epoch, "stopped")]
    assert events(a, "resigned") == [(old_epoch, "stopped")]
    fence = await FenceStore(fence_pool).read()
    assert (fence.epoch, fence.leader_node) == (b.term.epoch, b.node_id)
    print(f"in-process handover after stop: {handover * 1000:.0f} ms")


class FlakyDuty:
    """Fails its first ``failures`` passes, then succeeds forever."""

    name = "flaky"

    def __init__(self, failures: int) -> None:
        self.loop = DutyLoop(self)
        self.to_fail = failures
        self.passes = 0
        self.successes = 0

    async def run_once(self) -> float:
        self.passes += 1
        if self.passes <= self.to_fail:
            raise RuntimeError(f"boom {self.passes}")
        self.successes += 1
        return 0.05


async def test_crashing_duty_is_logged_and_restarted_with_backoff(
    base_settings: Settings,
    running: Running,
    caplog: pytest.LogCaptureFixture,
    unique: str,
) -> None:
    flaky = FlakyDuty(failures=3)

    def factory(ctx: DutyContext) -> list[Duty]:
        return [FenceHeartbeat(ctx), flaky]

    before = counter(DUTY_FAILURES, "main", "flaky")
    caplog.set_level(logging.ERROR)
    loop = asyncio.get_running_loop()
    replica = running.start(base_settings, f"flaky-{unique}", factory)
    await wait_for(lambda: replica.is_leader, timeout=10, message="leads")
    led_at = loop.time()
    await wait_for(lambda: flaky.successes >= 1, timeout=10, message="flaky duty recovered")
    recovered_after = loop.time() - led_at

    assert counter(DUTY_FAILURES, "main", "flaky") - before == 3
    # back-off: 3 failures wait at least 0.1 + 0.2 + 0.4 (half of each ceiling)
    assert recovered_after >= 0.7, recovered_after
    failed = [
        r for r in caplog.records if isinstance(r.msg, dict) and r.msg.get("event") == "duty_failed"
    ]
    assert len(failed) == 3
    assert all(r.exc_info is not None or "exception" in r.msg for r in failed)
    # the replica never stepped down meanwhile
    assert events(replica, "stepping_down") == []
    assert replica.is_leader


async def test_fenced_duty_makes_the_replica_step_down_and_campaign_again(
    base_settings: Settings, running: Running, fence_pool: asyncpg.Pool, unique: str
) -> None:
    replica = running.start(base_settings, f"fenced-{unique}")
    await wait_for(lambda: replica.is_leader, timeout=10, message="leads")
    assert replica.term is not None
    old = replica.term.epoch

    # A newer leader fences (as after a partition): its epoch is above ours. etcd
    # revisions only grow, so the replica's next term still wins the fence.
    fenced_before = counter(LEADER_TRANSITIONS, "fenced")
    fence = FenceStore(fence_pool)
    assert await fence.advance(old + 1, "someone-newer")

    # the stale epoch cannot write any more: the next fenced transaction raises
    async with fence_pool.acquire() as conn:
        with pytest.raises(Fenced):
            async with fenced_transaction(conn, old):
                pytest.fail("a fenced transaction of a stale epoch ran its body")
    stale = FenceHeartbeat(
        dataclasses.replace(DutyContext.standalone(base_settings, fence_pool), fence=fence),
        config=FenceHeartbeatConfig(interval=1.0),
    )
    stale.loop.bind(LeaderTerm(old, replica.node_id))
    with pytest.raises(Fenced):
        await stale.run_once()

    await wait_for(
        lambda: (old, "fenced") in events(replica, "resigned"),
        timeout=TTL,
        message="replica stepped down after its heartbeat was fenced",
    )
    assert (old, "fenced") in events(replica, "stepping_down")
    assert counter(LEADER_TRANSITIONS, "fenced") - fenced_before == 1
    await wait_for(
        lambda: replica.is_leader and replica.term is not None and replica.term.epoch > old + 1,
        timeout=10,
        message="replica leads again with a newer epoch",
    )
    state = await fence.read()
    assert replica.term is not None
    assert (state.epoch, state.leader_node) == (replica.term.epoch, replica.node_id)


async def test_replica_sessions_end_idle_transactions_after_about_one_ttl(
    base_settings: Settings, running: Running, fence_pool: asyncpg.Pool, unique: str
) -> None:
    """A paused leader's open fenced transaction cannot block the next fence update."""
    replica = running.start(base_settings, f"idle-{unique}")
    await wait_for(lambda: replica.is_leader, timeout=10, message="leads")
    pool = replica.pools.get(DEFAULT_SHARD)
    assert replica.term is not None and pool is not None
    epoch = replica.term.epoch
    async with pool.acquire() as conn:
        assert await conn.fetchval("SHOW idle_in_transaction_session_timeout") == "2s"

    # the "zombie": a session configured like the replica's, holding the fence row
    # FOR SHARE in an open transaction, then going quiet
    zombie = await db.connect(
        base_settings.database_url, server_settings=session_settings(base_settings)
    )
    zombie_pid = zombie.get_server_pid()
    try:
        tx = zombie.transaction()
        await tx.start()
        await zombie.fetchval("SELECT epoch FROM duetime.leader_fence WHERE shard = 0 FOR SHARE")
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert await FenceStore(fence_pool).advance(epoch + 1, "next-leader", lock_timeout=10)
        waited = loop.time() - started

        # PostgreSQL ended the zombie's session (its backend is gone)
        async def backend_gone() -> bool:
            return bool(
                await fence_pool.fetchval(
                    "SELECT count(*) = 0 FROM pg_stat_activity WHERE pid = $1", zombie_pid
                )
            )

        await wait_for(backend_gone, timeout=2, message="zombie session ended by PostgreSQL")
    finally:
        zombie.terminate()
    assert 1.0 <= waited <= TTL + 1.5, f"fence update waited {waited:.2f}s"
