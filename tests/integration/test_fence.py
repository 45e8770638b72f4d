"""The database fence (DESIGN §1.3, §4): the newest epoch wins, an older one is refused,
and a zombie leader's fenced transaction either commits before the new leader's advance
(which waits for it) or raises ``Fenced`` after it, never in between.

Runs in a database of its own so the epochs here cannot meet an election test's.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import asyncpg
import pytest

from scheduler import db
from scheduler.errors import DuetimeError, Fenced
from scheduler.fence import FenceStore, fenced_transaction
from tests.conftest import own_database
from tests.support.wait import wait_for


@pytest.fixture(scope="module")
async def fence_dsn(server_dsn: str) -> AsyncIterator[str]:
    async with own_database(server_dsn, "fence") as url:
        yield url


@pytest.fixture(scope="module")
async def pool(fence_dsn: str) -> AsyncIterator[asyncpg.Pool]:
    p = await db.create_pool(fence_dsn, min_size=1, max_size=4)
    yield p
    await p.close()


@pytest.fixture
async def fence(pool: asyncpg.Pool) -> FenceStore:
    await pool.execute(
        "UPDATE duetime.leader_fence SET epoch = 0, leader_node = NULL, elected_at = NULL, "
        "renewed_at = NULL WHERE shard = 0"
    )
    await pool.execute("DELETE FROM duetime.jobs")
    return FenceStore(pool)


@pytest.fixture
async def zombie(fence_dsn: str) -> AsyncIterator[asyncpg.Connection]:
    """The old leader's own connection."""
    conn = await db.connect(fence_dsn)
    try:
        yield conn
    finally:
        await conn.close()


async def _waiting_on_fence(observer: asyncpg.Pool) -> bool:
    """True while some session waits for a lock in a statement on leader_fence."""
    return bool(
        await observer.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock' AND query ILIKE '%leader_fence%'"
        )
    )


async def test_initial_fence(fence: FenceStore) -> None:
    state = await fence.read()
    assert (state.epoch, state.leader_node, state.elected_at) == (0, None, None)


async def test_newer_epoch_wins_older_is_refused(fence: FenceStore) -> None:
    assert await fence.advance(5, "node-a") is True
    state = await fence.read()
    assert (state.epoch, state.leader_node) == (5, "node-a")
    assert state.elected_at is not None and state.renewed_at == state.elected_at

    assert await fence.advance(3, "node-old") is False
    assert (await fence.read()).leader_node == "node-a"  # untouched

    assert await fence.advance(5, "node-a") is True  # re-asserting one's own epoch is fine
    assert await fence.advance(9, "node-b") is True
    state = await fence.read()
    assert (state.epoch, state.leader_node) == (9, "node-b")


async def test_fenced_transaction_commits_for_the_current_epoch(
    fence: FenceStore, zombie: asyncpg.Connection, pool: asyncpg.Pool
) -> None:
    await fence.advance(4, "me")
    async with fenced_transaction(zombie, 4):
        await zombie.execute("INSERT INTO duetime.jobs (task) VALUES ('fenced-ok')")
    assert await pool.fetchval("SELECT count(*) FROM duetime.jobs WHERE task = 'fenced-ok'") == 1


async def test_fenced_transaction_refuses_a_stale_epoch(
    fence: FenceStore, zombie: asyncpg.Connection, pool: asyncpg.Pool
) -> None:
    await fence.advance(8, "new")
    ran = False
    with pytest.raises(Fenced) as info:
        async with fenced_transaction(zombie, 7):
            ran = True
    assert not ran, "the body of a fenced transaction must not run for a stale epoch"
    assert (info.value.epoch, info.value.fence_epoch) == (7, 8)
    assert str(info.value) == "epoch 7 is fenced (fence holds epoch 8)"
    assert info.value.exit_code == 1
    # Fail closed: an epoch the fence has not reached yet may not act either.
    with pytest.raises(Fenced):
        async with fenced_transaction(zombie, 9):
            pass
    assert not zombie.is_in_transaction()


async def test_zombie_in_flight_transaction_blocks_advance_until_it_ends(
    fence: FenceStore, zombie: asyncpg.Connection, pool: asyncpg.Pool
) -> None:
    await fence.advance(1, "old")
    advancing: asyncio.Task[bool] | None = None
    try:
        async with fenced_transaction(zombie, 1):
            await zombie.execute("INSERT INTO duetime.jobs (task) VALUES ('zombie-in-flight')")
            advancing = asyncio.create_task(fence.advance(2, "new", lock_timeout=10))
            await wait_for(
                lambda: _waiting_on_fence(pool),
                timeout=5,
                message="the new leader's advance to wait on the zombie's share lock",
            )
            assert not advancing.done()
            assert (await fence.read()).epoch == 1
        # The zombie committed; only now can the fence move.
        assert await asyncio.wait_for(advancing, timeout=5) is True
    finally:
        if advancing is not None and not advancing.done():
            advancing.cancel()
    assert (await fence.read()).epoch == 2
    # The write that passed the check before the fence moved committed ...
    assert (
        await pool.fetchval("SELECT count(*) FROM duetime.jobs WHERE task = 'zombie-in-flight'")
        == 1
    )
    # ... and every later fenced transaction of the zombie is refused before it writes.
    with pytest.raises(Fenced) as info:
        async with fenced_transaction(zombie, 1):
            await zombie.execute("INSERT INTO duetime.jobs (task) VALUES ('zombie-late')")
    assert info.value.fence_epoch == 2
    assert await pool.fetchval("SELECT count(*) FROM duetime.jobs WHERE task = 'zombie-late'") == 0


async def test_advance_waits_at_most_its_lock_timeout(
    fence: FenceStore, zombie: asyncpg.Connection
) -> None:
    await fence.advance(1, "old")
    async with fenced_transaction(zombie, 1):
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises((asyncpg.LockNotAvailableError, DuetimeError)):
            await asyncio.wait_for(fence.advance(2, "new", lock_timeout=0.3), timeout=5)
        assert loop.time() - started < 3
    assert (await fence.read()).epoch == 1  # the timed-out advance changed nothing


async def test_heartbeat(fence: FenceStore) -> None:
    await fence.advance(3, "me")
    first = (await fence.read()).renewed_at
    await fence.heartbeat(3)
    state = await fence.read()
    assert state.renewed_at is not None and first is not None and state.renewed_at >= first
    await fence.advance(4, "other")
    with pytest.raises(Fenced) as info:
        await fence.heartbeat(3)
    assert (info.value.epoch, info.value.fence_epoch) == (3, 4)
