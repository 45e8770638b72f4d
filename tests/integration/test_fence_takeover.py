"""A new leader takes the fence from sessions that hold it (``FenceStore.advance`` with
``takeover_grace``), and only from duetime's own.

The holder here is a session that locked the fence row FOR SHARE in an open transaction
and went quiet, with no server timeout to end it — what a frozen leader blocked sending
a claim result looks like to the new leader (tests/chaos/test_zombie_fence.py has the
real thing). Runs in a database of its own so its epochs meet no other test's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import asyncpg
import pytest
from structlog.testing import capture_logs

from scheduler import db
from scheduler.store.fence import FenceStore
from tests.conftest import own_database

pytestmark = pytest.mark.timeout(60)
GRACE = 0.3


@pytest.fixture(scope="module")
async def takeover_dsn(server_dsn: str) -> AsyncIterator[str]:
    async with own_database(server_dsn, "takeover") as url:
        yield url


@pytest.fixture
async def fence(takeover_dsn: str) -> AsyncIterator[FenceStore]:
    pool = await db.create_pool(takeover_dsn, min_size=1, max_size=4)
    await pool.execute("UPDATE duetime.leader_fence SET epoch = 1 WHERE shard = 0")
    try:
        yield FenceStore(pool)
    finally:
        await pool.close()


async def holder(dsn: str, application_name: str) -> asyncpg.Connection:
    """A session holding the fence row FOR SHARE in an open transaction."""
    conn = await db.connect(dsn, application_name=application_name)
    await conn.execute("BEGIN")
    await conn.fetchval("SELECT epoch FROM duetime.leader_fence WHERE shard = 0 FOR SHARE")
    return conn


async def alive(fence: FenceStore, pid: int) -> bool:
    read = await fence._db.pool.fetchval(
        "SELECT count(*) FROM pg_stat_activity WHERE pid = $1", pid
    )
    return bool(read)


async def test_advance_terminates_a_duetime_session_holding_the_fence(
    fence: FenceStore, takeover_dsn: str
) -> None:
    zombie = await holder(takeover_dsn, "duetime:old-leader")
    pid = zombie.get_server_pid()
    try:
        started = time.monotonic()
        with capture_logs() as logs:
            assert await fence.advance(2, "new-leader", lock_timeout=10, takeover_grace=GRACE)
        took = time.monotonic() - started
        assert GRACE <= took < GRACE + 1.0, took  # waited the grace, not the lock timeout
        assert not await alive(fence, pid)
        assert (await fence.read()).epoch == 2
        (event,) = [e for e in logs if e["event"] == "fence_blockers_terminated"]
        assert [(s["pid"], s["application_name"]) for s in event["sessions"]] == [
            (pid, "duetime:old-leader")
        ]
        with pytest.raises((asyncpg.InterfaceError, asyncpg.ConnectionDoesNotExistError)):
            await zombie.fetchval("SELECT 1")  # its session is gone
    finally:
        zombie.terminate()


async def test_advance_leaves_other_sessions_alone_and_times_out(
    fence: FenceStore, takeover_dsn: str
) -> None:
    operator = await holder(takeover_dsn, "psql")
    pid = operator.get_server_pid()
    try:
        with capture_logs() as logs, pytest.raises(asyncpg.LockNotAvailableError):
            await fence.advance(3, "new-leader", lock_timeout=1.0, takeover_grace=GRACE)
        assert await alive(fence, pid)
        assert not [e for e in logs if e["event"] == "fence_blockers_terminated"]
        assert await operator.fetchval("SELECT 1") == 1  # untouched
    finally:
        operator.terminate()


async def test_advance_leaves_a_migration_alone(fence: FenceStore, takeover_dsn: str) -> None:
    """A duetime-named session holding more than row locks (DDL) is not a claim."""
    migration = await db.connect(takeover_dsn, application_name="duetime:migrate")
    await migration.execute("BEGIN")
    await migration.execute("LOCK TABLE duetime.leader_fence IN SHARE ROW EXCLUSIVE MODE")
    await migration.fetchval("SELECT epoch FROM duetime.leader_fence WHERE shard = 0 FOR SHARE")
    try:
        with pytest.raises(asyncpg.LockNotAvailableError):
            await fence.advance(6, "new-leader", lock_timeout=1.0, takeover_grace=GRACE)
        assert await alive(fence, migration.get_server_pid())
    finally:
        migration.terminate()


async def test_advance_without_takeover_only_waits(fence: FenceStore, takeover_dsn: str) -> None:
    zombie = await holder(takeover_dsn, "duetime:old-leader")
    try:
        with pytest.raises(asyncpg.LockNotAvailableError):
            await fence.advance(4, "new-leader", lock_timeout=0.5)
        assert await alive(fence, zombie.get_server_pid())
    finally:
        zombie.terminate()


async def test_advance_outwaits_the_session_statement_timeout(
    fence: FenceStore, takeover_dsn: str
) -> None:
    """Scheduler sessions carry a statement_timeout of one TTL; the fence update must
    still wait its own ``lock_timeout``, which is longer."""
    pool = await db.create_pool(
        takeover_dsn, min_size=1, max_size=2, server_settings={"statement_timeout": "200ms"}
    )
    zombie = await holder(takeover_dsn, "psql")
    try:
        store = FenceStore(pool)
        update = asyncio.ensure_future(store.advance(5, "new-leader", lock_timeout=2.0))
        done, _ = await asyncio.wait({update}, timeout=0.6)
        assert not done  # still waiting past the 200 ms session statement_timeout
        await zombie.execute("ROLLBACK")
        assert await asyncio.wait_for(update, 3)
    finally:
        zombie.terminate()
        await pool.close()
