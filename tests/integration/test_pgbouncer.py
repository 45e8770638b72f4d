"""duetime behind PgBouncer in transaction mode (docs/operations.md, "Behind PgBouncer").

A private PgBouncer 1.18 (Debian's: no protocol-level prepared statements) with a server
pool of 3 per database stands in front of the shared PostgreSQL. The worker (concurrency
8, so clients outnumber server sessions) and the producers go through it with
``database_pooler = transaction``; the scheduler connects directly, as it must (LISTEN
wake-ups, the fence), and refuses to start through a transaction pooler.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from scheduler import db
from scheduler.store import JobStore
from tests.conftest import own_database
from tests.fixtures_tasks.basic import EFFECTS_DDL, EFFECTS_TABLE
from tests.support.helpers import declare_queues
from tests.support.pgbouncer import PGBOUNCER, PrivatePgBouncer
from tests.support.procs import Processes, duetime_argv
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(150)

JOBS = 120


@pytest.fixture
def pgbouncer(server_dsn: str) -> Iterator[PrivatePgBouncer]:
    if shutil.which(PGBOUNCER) is None:
        pytest.fail("pgbouncer is not installed (Debian package pgbouncer; .ci/run installs it)")
    parts = urlsplit(server_dsn)
    with PrivatePgBouncer(parts.hostname or "127.0.0.1", parts.port or 5432, pool_size=3) as pgb:
        yield pgb


async def test_workers_and_producers_run_through_a_transaction_pooler(
    server_dsn: str,
    pgbouncer: PrivatePgBouncer,
    test_env: dict[str, str],
    procs: Processes,
    unique: str,
) -> None:
    async with own_database(server_dsn, f"pgb_{unique}") as direct_url:
        database = urlsplit(direct_url).path.lstrip("/")
        pooled_url = pgbouncer.url("postgres", database)
        queue = f"pgb-{unique}"
        env = {**test_env, "DUETIME_DATABASE_URL": direct_url}
        pooled_env = {
            **env,
            "DUETIME_DATABASE_URL": pooled_url,
            "DUETIME_DATABASE_POOLER": "transaction",
        }
        direct = await db.connect(direct_url)
        try:
            await direct.execute(EFFECTS_DDL)
            await declare_queues(direct, queue)
            refused = procs.spawn(duetime_argv("scheduler"), name="refused", env=pooled_env)
            assert await refused.wait(30) != 0
            said = refused.output() + refused.errors()
            assert "the scheduler needs sessions of its own" in said
            assert "Traceback" not in said

            procs.spawn(
                duetime_argv("scheduler"), name="scheduler", env={**env, "DUETIME_NODE_ID": unique}
            )
            worker = procs.spawn(
                duetime_argv(
                    "worker", "--import", "tests.fixtures_tasks.basic",
                    "--queue", queue, "--concurrency", "8",
                ),
                name="worker",
                env={**pooled_env, "DUETIME_NODE_ID": f"w-{unique}"},
            )  # fmt: skip
            pool = await db.create_pool(pooled_url, max_size=4, pooler="transaction")
            try:
                store = JobStore(pool)
                for i in range(JOBS - 1):
                    await store.enqueue("fixtures.record", {"tag": str(i)}, queue=queue)
                await pool.execute(  # plain SQL through the pooler too
                    "INSERT INTO duetime.jobs (task, queue) VALUES ('fixtures.record', $1)", queue
                )
            finally:
                await pool.close()

            async def all_succeeded() -> bool:
                done = await direct.fetchval(
                    "SELECT count(*) FROM duetime.jobs WHERE status = 'succeeded'"
                )
                return done == JOBS

            await wait_for(all_succeeded, timeout=90, message="not every job succeeded")
            effects = await direct.fetchval(
                f"SELECT count(*) FROM (SELECT DISTINCT job_id FROM {EFFECTS_TABLE}) e"
            )
            rows = await direct.fetchval(f"SELECT count(*) FROM {EFFECTS_TABLE}")
            assert effects == rows == JOBS  # every effect once
            assert "prepared statement" not in worker.output() + worker.errors()
        finally:
            await direct.close()
            await procs.stop_all()
