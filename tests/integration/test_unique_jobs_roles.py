"""Unique jobs as the least-privilege roles (scheduler/sql/roles.sql): the producer claims
keys with plain SQL and through JobStore with no privilege on duetime.unique_keys (the
SECURITY DEFINER triggers do it), two producers' equal keys are two keys, a producer
cannot read or call the machinery, and the worker role's settlement releases the key.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import timedelta

import asyncpg
import pytest

from scheduler.config import Settings
from scheduler.errors import UniqueKeyTaken
from scheduler.store import JobStore
from tests.fixtures_tasks.jobs import FENCE_EPOCH
from tests.integration.test_roles import World, _setup

pytestmark = pytest.mark.timeout(90)
DENIED = asyncpg.InsufficientPrivilegeError


@pytest.fixture
async def world(migrated_dsn: str, unique: str, settings: Settings) -> AsyncIterator[World]:
    async for w in _setup(migrated_dsn, f"du{unique}", settings):
        yield w


async def test_producer_role_claims_keys_in_its_own_scope(world: World) -> None:
    p, p2 = world.producer, world.producer2
    first = await p.fetchval(
        "INSERT INTO duetime.jobs (task, unique_key) VALUES ('p.u', 'acct:1') RETURNING id"
    )
    assert first is not None
    async with p.acquire() as conn, conn.transaction():
        dup = await conn.fetch(
            "INSERT INTO duetime.jobs (task, unique_key) VALUES ('p.u', 'acct:1') RETURNING id"
        )
        assert dup == []
        holder = await conn.fetchval("SELECT current_setting('duetime.unique_holder', true)")
        assert holder == str(first)
    # another producer's equal key is another key: neither blocks nor reveals the other
    other = await p2.fetchval(
        "INSERT INTO duetime.jobs (task, unique_key) VALUES ('p.u', 'acct:1') RETURNING id"
    )
    assert other is not None and other != first

    store = JobStore(p)
    assert (await store.enqueue("p.u", unique_key="acct:1")).id == first
    replaced = await store.enqueue(
        "p.u", {"v": 2}, unique_key="acct:1", on_conflict="replace", delay=timedelta(hours=1)
    )
    assert replaced.id == first and replaced.payload == {"v": 2}
    with pytest.raises(UniqueKeyTaken) as caught:
        await store.enqueue("p.u", unique_key="acct:1", on_conflict="error")
    assert caught.value.holder_id == first
    windowed = await JobStore(p2).enqueue(
        "p.w", unique_key="win:1", unique_for=timedelta(minutes=5)
    )
    assert windowed.unique_key == "win:1"


async def test_producer_role_cannot_touch_the_key_table(world: World) -> None:
    await world.producer.execute(
        "INSERT INTO duetime.jobs (task, unique_key) VALUES ('p.u', 'acct:2')"
    )
    for sql in (
        "SELECT * FROM duetime.unique_keys",
        "DELETE FROM duetime.unique_keys",
        "INSERT INTO duetime.unique_keys VALUES ('default', 'x', 'k', 1, now(), NULL, false)",
        "SELECT duetime.unique_key_held(NULL::duetime.unique_keys)",
    ):
        with pytest.raises(DENIED):
            await world.producer.execute(sql)


async def test_worker_settlement_releases_the_key(world: World) -> None:
    store = JobStore(world.producer)
    job = await store.enqueue("p.u", unique_key="acct:3")
    await world.owner.execute(
        "UPDATE duetime.jobs SET status = 'dispatched', dispatched_at = now(), "
        f"dispatch_epoch = {FENCE_EPOCH} WHERE id = $1",
        job.id,
    )
    assert (await store.enqueue("p.u", unique_key="acct:3")).id == job.id
    settled = await world.worker.fetchval(
        "SELECT duetime.worker_complete($1::bigint[], $2::timestamptz[], $3::int[], 'w')",
        [job.id],
        [job.due_at],
        [1],
    )
    assert settled == [job.id]
    fresh = await store.enqueue("p.u", unique_key="acct:3")
    assert fresh.id != job.id and fresh.status == "pending"
