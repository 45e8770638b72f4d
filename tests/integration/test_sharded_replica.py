"""``Replica`` in-process against real PostgreSQL and etcd: what happens to one
shard when leading it fails, while the other shard carries on.

Two shard databases of this module's own, a unique etcd prefix per test, TTL 2 s. The
duties are a fence heartbeat (so each term writes under its shard's fence) and, where
a test needs one, a duty that fails on purpose.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence

import asyncpg
import pytest

from scheduler.config import Settings, load_settings
from scheduler.duties.base import Duty, DutyLoop
from scheduler.duties.context import DutyContext
from scheduler.duties.fence_heartbeat import FenceHeartbeat
from scheduler.leadership.replica import Replica
from tests.conftest import own_database
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(60)

SHARDS = ("a", "b")


@pytest.fixture(scope="module")
async def shard_urls(server_dsn: str) -> AsyncIterator[dict[str, str]]:
    async with contextlib.AsyncExitStack() as stack:
        urls = {}
        for name in SHARDS:
            urls[name] = await stack.enter_async_context(own_database(server_dsn, f"sr_{name}"))
        yield urls


@pytest.fixture
async def shard_settings(settings: Settings, shard_urls: dict[str, str]) -> Settings:
    for url in shard_urls.values():
        conn = await asyncpg.connect(url, timeout=5)
        try:
            await conn.execute("UPDATE duetime.leader_fence SET epoch = 0 WHERE shard = 0")
        finally:
            await conn.close()
    return load_settings(
        env={},
        overrides={
            "database_url": shard_urls["a"],
            "amqp_url": settings.amqp_url,
            "etcd_endpoints": ",".join(settings.etcd_endpoints),
            "etcd_prefix": settings.etcd_prefix,
            "node_id": settings.node_id,
            "lease_ttl": 2.0,
            "log_format": "console",
            "shards": ",".join(f"{n}={u}" for n, u in shard_urls.items()),
        },
    )


class Crash:
    """A duty whose pass raises outside the retry loop's reach: its task ends."""

    name = "crash"

    def __init__(self) -> None:
        self.loop = DutyLoop(self)

    async def run_once(self) -> float:
        await asyncio.sleep(0.1)
        raise asyncio.CancelledError  # not retried: ends the duty's task


def heartbeat_only(ctx: DutyContext) -> Sequence[Duty]:
    return [FenceHeartbeat(ctx)]


@contextlib.asynccontextmanager
async def running(replica: Replica) -> AsyncIterator[asyncio.Event]:
    stop = asyncio.Event()
    task = asyncio.create_task(replica.run_until_stopped(stop))
    try:
        yield stop
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)


def events(replica: Replica, shard: str) -> list[tuple[str, str | None, float]]:
    return [(t.event, t.reason, t.at) for t in replica.transitions if t.shard == shard]


async def test_leads_both_shards_and_stops_cleanly(shard_settings: Settings) -> None:
    replica = Replica(shard_settings, heartbeat_only)
    async with running(replica):
        await wait_for(lambda: set(replica.leading()) == set(SHARDS), timeout=10)
        assert replica.is_leader
        leading = replica.leading()
        for name, url in shard_settings.shard_urls.items():
            conn = await asyncpg.connect(url, timeout=5)
            try:
                row = await conn.fetchrow(
                    "SELECT epoch, leader_node FROM duetime.leader_fence WHERE shard = 0"
                )
            finally:
                await conn.close()
            assert row is not None
            assert (row["epoch"], row["leader_node"]) == (leading[name], shard_settings.node_id)
    assert not replica.is_leader
    for name in SHARDS:
        assert [e for e, _, _ in events(replica, name)][-2:] == ["stepping_down", "released"]


async def test_fence_ahead_hands_the_shard_over_and_holds_off(
    shard_settings: Settings, shard_urls: dict[str, str]
) -> None:
    conn = await asyncpg.connect(shard_urls["b"], timeout=5)
    try:
        await conn.execute("UPDATE duetime.leader_fence SET epoch = 1000000000000 WHERE shard = 0")
        replica = Replica(shard_settings, heartbeat_only)
        async with running(replica):
            await wait_for(lambda: "a" in replica.leading(), timeout=10)

            def two_fenced_terms() -> bool:
                return sum(1 for e, r, _ in events(replica, "b") if e == "handed_over") >= 2

            await wait_for(two_fenced_terms, timeout=20)
            assert "b" not in replica.leading()
            assert "a" in replica.leading()  # the other shard carries on
            b = events(replica, "b")
            handed = [(r, at) for e, r, at in b if e == "handed_over"]
            elected = [at for e, _, at in b if e == "elected"]
            assert [r for r, _ in handed][:2] == ["fenced", "fenced"]
            # held off: the second campaign came at least TTL/8 after the first handover
            assert elected[1] - handed[0][1] >= shard_settings.lease_ttl / 8 - 0.01
            assert not any(e == "stepping_down" for e, _, _ in events(replica, "a"))
    finally:
        await conn.execute("UPDATE duetime.leader_fence SET epoch = 0 WHERE shard = 0")
        await conn.close()


async def test_a_duty_that_ends_hands_only_its_shard_over(shard_settings: Settings) -> None:
    def factory(ctx: DutyContext) -> Sequence[Duty]:
        duties: list[Duty] = [FenceHeartbeat(ctx)]
        if ctx.shard == "b":
            duties.append(Crash())
        return duties

    replica = Replica(shard_settings, factory)
    async with running(replica):
        await wait_for(lambda: "a" in replica.leading(), timeout=10)
        await wait_for(
            lambda: any(e == "handed_over" for e, _, _ in events(replica, "b")), timeout=10
        )
        reasons = [r for e, r, _ in events(replica, "b") if e == "handed_over"]
        assert reasons[0] == "duty_exited"
        assert "a" in replica.leading()
        assert not any(e == "stepping_down" for e, _, _ in events(replica, "a"))
