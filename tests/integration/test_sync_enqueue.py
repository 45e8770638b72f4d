"""``duetime.enqueue`` / ``bulk_enqueue`` from synchronous drivers
(scheduler/store/sync_jobs.py), each against a migrated PostgreSQL database of its own:
the job and its wake-up NOTIFY commit with the caller's own write, a rollback leaves
neither, and the validation and answers are ``JobStore.enqueue``'s. Django's case runs
a real Django project with Django's test runner (tests/django_project)."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import asyncpg
import psycopg
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

import duetime
from scheduler import db
from scheduler.errors import InvalidInput, UniqueKeyTaken
from scheduler.jobspec import JobSpec
from scheduler.store.jobs import JobStore
from tests.support.procs import REPO_ROOT

pytestmark = pytest.mark.timeout(120)


class Driver:
    """One way a synchronous application holds a connection: ``handle`` is what it
    passes to ``duetime.enqueue``; ``write`` is its own INSERT."""

    def __init__(
        self,
        handle: Any,
        write: Callable[[int], None],
        commit: Callable[[], None],
        rollback: Callable[[], None],
    ) -> None:
        self.handle, self.write, self.commit, self.rollback = handle, write, commit, rollback


@contextmanager
def psycopg_connection(url: str) -> Iterator[Driver]:
    with psycopg.connect(url) as conn:
        yield Driver(
            conn,
            lambda i: conn.execute("INSERT INTO orders (id) VALUES (%s)", (i,)) and None,
            conn.commit,
            conn.rollback,
        )


@contextmanager
def psycopg_cursor(url: str) -> Iterator[Driver]:
    with psycopg.connect(url) as conn, conn.cursor() as cur:
        yield Driver(
            cur,
            lambda i: cur.execute("INSERT INTO orders (id) VALUES (%s)", (i,)) and None,
            conn.commit,
            conn.rollback,
        )


def _engine(url: str) -> Any:
    return create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1), pool_size=1)


@contextmanager
def sqlalchemy_connection(url: str) -> Iterator[Driver]:
    engine = _engine(url)
    try:
        with engine.connect() as conn:
            yield Driver(
                conn,
                lambda i: (
                    conn.execute(text("INSERT INTO orders (id) VALUES (:i)"), {"i": i}) and None
                ),
                conn.commit,
                conn.rollback,
            )
    finally:
        engine.dispose()


@contextmanager
def sqlalchemy_session(url: str) -> Iterator[Driver]:
    engine = _engine(url)
    try:
        with Session(engine) as session:
            yield Driver(
                session,
                lambda i: (
                    session.execute(text("INSERT INTO orders (id) VALUES (:i)"), {"i": i}) and None
                ),
                session.commit,
                session.rollback,
            )
    finally:
        engine.dispose()


DRIVERS = {
    "psycopg-connection": psycopg_connection,
    "psycopg-cursor": psycopg_cursor,
    "sqlalchemy-connection": sqlalchemy_connection,
    "sqlalchemy-session": sqlalchemy_session,
}


async def _count(conn: asyncpg.Connection, sql: str, *args: Any) -> int:
    return int(await conn.fetchval(sql, *args))


@pytest.mark.parametrize("driver", sorted(DRIVERS))
async def test_the_job_and_its_wakeup_commit_or_roll_back_with_the_callers_write(
    driver: str, migrated_dsn: str
) -> None:
    watcher = await db.connect(migrated_dsn)
    wakeups: asyncio.Queue[str] = asyncio.Queue()
    await watcher.add_listener("duetime_jobs", lambda *a: wakeups.put_nowait(a[3]))
    await watcher.execute("CREATE TABLE orders (id bigint PRIMARY KEY)")
    jobs = "SELECT count(*) FROM duetime.jobs WHERE task = $1"
    try:

        def committed_then_rolled_back() -> tuple[Any, int, int]:
            with DRIVERS[driver](migrated_dsn) as d:
                d.write(1)
                job = duetime.enqueue(d.handle, "send_receipt", {"order_id": 1}, priority=5)
                unseen = asyncio.run_coroutine_threadsafe(
                    _count(watcher, jobs, "send_receipt"), loop
                ).result(10)
                d.commit()
                d.write(2)
                duetime.enqueue(d.handle, "rolled_back", {"order_id": 2})
                bulk = duetime.bulk_enqueue(
                    d.handle, [JobSpec("rolled_back_bulk", {"i": i}) for i in range(3)]
                )
                d.rollback()
                return job, unseen, bulk

        loop = asyncio.get_running_loop()
        job, unseen, bulk = await asyncio.to_thread(committed_then_rolled_back)
        assert unseen == 0  # not visible to another session before COMMIT
        assert bulk == 3
        row = await watcher.fetchrow("SELECT * FROM duetime.jobs WHERE id = $1", job.id)
        assert (row["status"], row["payload"], row["priority"]) == (
            "pending",
            {"order_id": 1},
            5,
        )
        assert (job.status, job.payload, job.priority) == ("pending", {"order_id": 1}, 5)
        assert await asyncio.wait_for(wakeups.get(), 5) == ""  # NOTIFY, at the commit
        assert await _count(watcher, "SELECT count(*) FROM orders WHERE id = 2") == 0
        assert await _count(watcher, jobs, "rolled_back") == 0
        assert await _count(watcher, jobs, "rolled_back_bulk") == 0
        await asyncio.sleep(0.2)
        assert wakeups.empty()  # the rolled-back enqueues woke nobody

        def bulk_committed() -> int:
            with DRIVERS[driver](migrated_dsn) as d:
                n = duetime.bulk_enqueue(d.handle, [JobSpec("bulk", {"i": i}) for i in range(4)])
                d.commit()
                return n

        assert await asyncio.to_thread(bulk_committed) == 4
        assert await _count(watcher, jobs, "bulk") == 4
        assert await asyncio.wait_for(wakeups.get(), 5) == ""
    finally:
        await watcher.close()


@pytest.mark.parametrize("driver", ["psycopg-connection", "sqlalchemy-session"])
async def test_same_validation_and_answers_as_job_store(driver: str, migrated_dsn: str) -> None:
    """The same refusals with the same messages, and the unique-key answers."""
    pool = await db.create_pool(migrated_dsn, max_size=1)
    store = JobStore(pool)
    bad: list[dict[str, Any]] = [
        {"queue": "no spaces"},
        {"max_attempts": 0},
        {"on_conflict": "replace"},
        {"unique_key": "k", "on_conflict": "maybe"},
        {"limit_key": ""},
    ]
    try:
        expected = []
        for options in bad:
            with pytest.raises(InvalidInput) as refused:
                await store.enqueue("t", {}, **options)
            expected.append(str(refused.value))

        def sync_side() -> tuple[list[str], Any, Any]:
            got = []
            with DRIVERS[driver](migrated_dsn) as d:
                for options in bad:
                    with pytest.raises(InvalidInput) as refused:
                        duetime.enqueue(d.handle, "t", {}, **options)
                    got.append(str(refused.value))
                first = duetime.enqueue(d.handle, "t", {"n": 1}, unique_key="k")
                again = duetime.enqueue(d.handle, "t", {"n": 2}, unique_key="k")
                with pytest.raises(UniqueKeyTaken, match=f"held by job {first.id}"):
                    duetime.enqueue(d.handle, "t", {}, unique_key="k", on_conflict="error")
                d.commit()
            return got, first, again

        got, first, again = await asyncio.to_thread(sync_side)
        assert got == expected
        assert again.id == first.id and again.payload == {"n": 1}  # "skip": the holder
    finally:
        await pool.close()


async def test_an_asyncpg_or_unknown_connection_is_refused_with_a_clear_error(dsn: str) -> None:
    conn = await db.connect(dsn)
    try:
        with pytest.raises(InvalidInput, match="enqueue_async"):
            duetime.enqueue(conn, "t", {})
    finally:
        await conn.close()
    with pytest.raises(InvalidInput, match=r"unsupported connection builtins\.object"):
        duetime.enqueue(object(), "t", {})


async def test_enqueue_async_joins_an_asyncpg_transaction(migrated_dsn: str) -> None:
    conn = await db.connect(migrated_dsn)
    try:
        tx = conn.transaction()
        await tx.start()
        job = await duetime.enqueue_async(conn, "t.async", {"a": 1}, idempotency_key="k1")
        await tx.rollback()
        assert job.idempotency_key == "k1"
        assert await _count(conn, "SELECT count(*) FROM duetime.jobs") == 0
        async with conn.transaction():
            await duetime.enqueue_async(conn, "t.async", {"a": 1})
        assert await _count(conn, "SELECT count(*) FROM duetime.jobs") == 1
    finally:
        await conn.close()


async def test_django_projects_own_tests_pass_with_djangos_runner(
    server_dsn: str, unique: str
) -> None:
    """tests/django_project: ``manage.py test`` (Django's runner creates and drops its
    own test database) with enqueue inside ``transaction.atomic()``: commit, rollback,
    validation, bulk, a drained job's receipt, the stored trace context."""
    base = server_dsn.rsplit("/", 1)[0]
    env = {
        **os.environ,
        "DUETIME_DJANGO_DATABASE_URL": f"{base}/duetime_dj_{unique}",
        "PYTHONPATH": str(REPO_ROOT),
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "django",
        "test",
        "tests.django_project.shop",
        "--settings=tests.django_project.settings",
        "--noinput",
        cwd=REPO_ROOT,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout=100)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    text_out = out.decode(errors="replace")
    assert proc.returncode == 0, text_out
    assert "Ran 5 tests" in text_out and "OK" in text_out, text_out


@pytest.mark.parametrize("driver", sorted(DRIVERS))
async def test_get_reads_a_job_back_the_same_through_every_driver(
    driver: str, migrated_dsn: str
) -> None:
    """``sync_jobs.get`` (the Django Tasks backend's ``get_result``): the job as
    ``JobStore.get`` reads it, a stored result that is a JSON string told apart from one
    that is an object (the jsonb columns are read as text, whatever the driver decodes),
    None for no such job."""
    from scheduler.store import sync_jobs

    store_pool = await db.create_pool(migrated_dsn, max_size=1)
    try:
        store = JobStore(store_pool)
        text_job = await store.enqueue("t", {"k": ["v", 1]})
        object_job = await store.enqueue("t", {})
        for job, stored in ((text_job, '"done"'), (object_job, '{"sum": 5}')):
            await store_pool.execute(
                "UPDATE duetime.jobs SET status = 'succeeded', finished_at = now(),"
                " result = ($2::text)::jsonb WHERE id = $1",
                job.id,
                stored,
            )

        def read() -> list[Any]:
            with DRIVERS[driver](migrated_dsn) as d:
                return [sync_jobs.get(d.handle, i) for i in (text_job.id, object_job.id, 10**12, 0)]

        first, second, missing, nonsense = await asyncio.to_thread(read)
        assert first == await store.get(text_job.id)
        assert (first.payload, first.result, first.status) == ({"k": ["v", 1]}, "done", "succeeded")
        assert second.result == {"sum": 5}
        assert missing is None and nonsense is None
    finally:
        await store_pool.close()


@pytest.mark.parametrize("driver", sorted(DRIVERS))
async def test_a_workflow_commits_or_rolls_back_with_the_callers_write(
    driver: str, migrated_dsn: str
) -> None:
    """``duetime.enqueue_workflow`` through each driver (migration 0025): every step in the
    caller's transaction, the dependents ``waiting`` on the real ids."""
    import duetime
    from duetime.workflow import chord, step

    setup = await db.connect(migrated_dsn)
    try:
        await setup.execute("CREATE TABLE orders (id bigint PRIMARY KEY)")

        def run() -> list[int]:
            wf = chord([step("wf.member", {"i": i}) for i in range(3)], step("wf.callback"))
            with DRIVERS[driver](migrated_dsn) as d:
                d.write(1)
                duetime.enqueue_workflow(d.handle, wf)
                d.rollback()
                d.write(2)
                kept = duetime.enqueue_workflow(d.handle, wf)
                d.commit()
            assert [j.status for j in kept.jobs] == ["pending"] * 3 + ["waiting"]
            assert kept.jobs[-1].depends_on == kept.ids[:3]
            return kept.ids

        ids = await asyncio.to_thread(run)
        rows = await setup.fetch("SELECT id, status FROM duetime.jobs ORDER BY id")
        assert [r["id"] for r in rows] == ids
        assert await setup.fetchval("SELECT array_agg(id) FROM orders") == [2]
    finally:
        await setup.close()
