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
from scheduler.store.dispatch import DispatchStore
from scheduler.store.fence import FenceStore
from scheduler.store.fenced import fenced_transaction
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


# -- the fence is the database's (migration 0006, trigger jobs_dispatch_fenced) ---------


async def _pending_job(pool: asyncpg.Pool) -> tuple[int, object]:
    row = await pool.fetchrow(
        "INSERT INTO duetime.jobs (task) VALUES ('fenced') RETURNING id, due_at"
    )
    return row["id"], row["due_at"]


async def test_a_stale_dispatch_bypassing_fenced_transaction_fails_at_commit(
    fence: FenceStore, zombie: asyncpg.Connection, pool: asyncpg.Pool
) -> None:
    """A write path that never locks the fence: the statement goes through, the COMMIT
    is refused, and the row stays pending."""
    await fence.advance(2, "new")
    job_id, due_at = await _pending_job(pool)
    tx = zombie.transaction()
    await tx.start()
    updated = await zombie.execute(
        "UPDATE duetime.jobs SET status = 'dispatched', dispatched_at = now(), "
        "dispatch_epoch = 1 WHERE id = $1 AND due_at = $2",
        job_id,
        due_at,
    )
    assert updated == "UPDATE 1"
    with pytest.raises(asyncpg.IntegrityConstraintViolationError) as info:
        await tx.commit()
    assert info.value.constraint_name == "jobs_dispatch_fenced"
    assert "fence holds epoch 2" in str(info.value)
    assert await pool.fetchval("SELECT status FROM duetime.jobs WHERE id = $1", job_id) == (
        "pending"
    )
    # a NULL epoch is no epoch: refused too, and so is a row inserted as dispatched
    for statement, args in (
        ("UPDATE duetime.jobs SET status = 'dispatched' WHERE id = $1", (job_id,)),
        ("INSERT INTO duetime.jobs (task, status, dispatch_epoch) VALUES ('x', 'dispatched', 1)",
         ()),
    ):  # fmt: skip
        with pytest.raises(asyncpg.IntegrityConstraintViolationError, match="fence holds"):
            await zombie.execute(statement, *args)
    # the leader of the fence's epoch dispatches, through any path
    await zombie.execute(
        "UPDATE duetime.jobs SET status = 'dispatched', dispatch_epoch = 2 WHERE id = $1", job_id
    )


async def test_a_dispatch_valid_when_written_is_refused_if_the_fence_moves_before_commit(
    fence: FenceStore, zombie: asyncpg.Connection, pool: asyncpg.Pool
) -> None:
    """The check runs at COMMIT, not at the statement: a zombie that wrote under the
    right epoch but did not hold the fence row cannot commit after a newer leader."""
    await fence.advance(1, "old")
    job_id, due_at = await _pending_job(pool)
    tx = zombie.transaction()
    await tx.start()
    await zombie.execute(
        "UPDATE duetime.jobs SET status = 'dispatched', dispatched_at = now(), "
        "dispatch_epoch = 1 WHERE id = $1 AND due_at = $2",
        job_id,
        due_at,
    )
    assert await fence.advance(2, "new")  # nothing holds the fence row: no wait
    with pytest.raises(asyncpg.IntegrityConstraintViolationError, match="fence holds epoch 2"):
        await tx.commit()
    assert await pool.fetchval("SELECT status FROM duetime.jobs WHERE id = $1", job_id) == (
        "pending"
    )


async def test_a_wrong_epoch_inside_a_fenced_transaction_raises_fenced(
    fence: FenceStore, zombie: asyncpg.Connection, pool: asyncpg.Pool
) -> None:
    """Whatever the code inside writes, a commit-time refusal surfaces as ``Fenced``."""
    await fence.advance(3, "me")
    job_id, _ = await _pending_job(pool)
    with pytest.raises(Fenced) as info:
        async with fenced_transaction(zombie, 3):
            await zombie.execute(
                "UPDATE duetime.jobs SET status = 'dispatched', dispatch_epoch = 2 WHERE id = $1",
                job_id,
            )
    assert (info.value.epoch, info.value.fence_epoch) == (3, 3)
    assert await pool.fetchval("SELECT status FROM duetime.jobs WHERE id = $1", job_id) == (
        "pending"
    )


async def test_mark_dispatched_under_a_stale_epoch_marks_nothing(
    fence: FenceStore, zombie: asyncpg.Connection, pool: asyncpg.Pool
) -> None:
    """The claim's write carries the epoch predicate itself (dispatch.sql)."""
    await fence.advance(2, "new")
    await _pending_job(pool)
    store = DispatchStore(pool)
    async with zombie.transaction():
        jobs = await store.claim(zombie, 10)
        assert len(jobs) == 1
        assert await store.mark_dispatched(zombie, jobs, 1) == {}
        assert len(await store.mark_dispatched(zombie, jobs, 2)) == 1
    assert await pool.fetchval("SELECT dispatch_epoch FROM duetime.jobs") == 2
