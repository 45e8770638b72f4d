"""A PostgreSQL primary stopped and its standby promoted in the middle of a storm.

What Patroni does to a shard's database, done by hand on a private pair
(``tests/support/pgpair.py``: a primary and a *synchronous* standby on free loopback
ports), in two variants:

- ``crash``: the primary is stopped with ``-m immediate`` (a crash, as far as clients
  and the standby can tell), nothing accepts writes for 2 s (Patroni noticing), then
  the standby is promoted;
- ``planned``: ``-m fast`` (a ``patronictl switchover``: sessions get ``57P01``, the
  remaining WAL is shipped first), the standby promoted 0.5 s later.

The old primary stays down. One real ``duetime scheduler`` and one real ``duetime
worker`` are given the multi-host DSN
``postgresql://…@pg1,pg2/duetime?target_session_attrs=read-write`` and are never
restarted. ``chaos.check`` jobs (``tests/chaos/chaos_tasks.py``: each writes one effect
row through ``ctx.db``) come due over ``WINDOW`` seconds; the primary stops once a
quarter of them succeeded. Asserted:

- every job ``succeeded``: 0 lost, exactly one committed effect per job, no claim
  committed under an epoch other than the fence's (``tests/chaos/check.py``);
- the fence epoch never went backwards (the ``fence_audit`` trigger's rows, which
  moved to the new primary with the rest of the data);
- the scheduler and the worker reconnected by themselves: the same processes, each
  started once, running at the end, and no delivery took the worker's bug path
  (``delivery_failed``);
- the gap is bounded: the first claim and the first success committed on the new
  primary came within the promotion delay + ``GAP_BOUND`` seconds of the stop.

Printed (``pytest -s``): seconds from the stop to the promotion, to the fence renewed on
the new primary, to the first claim and the first success committed there, to every job
settled; the leader's epoch before and after; how often each recovery path was logged.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from scheduler.migrate import migrate
from tests.chaos.chaos_tasks import TASK
from tests.chaos.harness import ChaosCluster, Plan
from tests.support.pgpair import PgPair
from tests.support.wait import wait_for

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(120)]

SEED = int(os.environ.get("DUETIME_TEST_SEED") or random.SystemRandom().randrange(1, 2**31))
JOBS = 3000
WINDOW = 10.0  # seconds over which the jobs come due
KILL_SHARE = 0.25  # the primary dies once this share of the jobs succeeded
GAP_BOUND = 10.0  # after the promotion: the first claim and the first success within this
SETTLE = 40.0  # after the last job is due, for the backlog to drain


@pytest.fixture
async def pair() -> AsyncIterator[PgPair]:
    async with PgPair() as started:
        yield started


async def first_after(
    pool: asyncpg.Pool, sql: str, since: float, origin: float, *args: object
) -> float | None:
    """Seconds from ``origin`` to the earliest timestamp ``sql`` returns after ``since``
    (both epoch seconds; ``$1`` is ``since``, then ``args``), or None."""
    value = await pool.fetchval(sql, since, *args)
    return None if value is None else float(value) - origin


async def usable(pool: asyncpg.Pool) -> bool:
    """The observer's pool reaches a writable server again (its broken connections are
    replaced on acquire; the first statements on them fail)."""
    try:
        return bool(await pool.fetchval("SELECT NOT pg_is_in_recovery()", timeout=2))
    except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError):
        return False


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


def event_count(output: str, event: str) -> int:
    return output.count(f'"event": "{event}"') or output.count(f'"event":"{event}"')


@pytest.mark.parametrize(
    ("stop_mode", "promote_after"),
    [
        pytest.param("immediate", 2.0, id="crash"),
        pytest.param("fast", 0.5, id="planned"),
    ],
)
async def test_primary_stop_then_promotion_mid_storm_loses_nothing(
    stop_mode: str,
    promote_after: float,
    pair: PgPair,
    tmp_path: Path,
    test_env: dict[str, str],
    amqp_url: str,
    etcd_endpoints: str,
    unique: str,
) -> None:
    admin = await asyncpg.connect(pair.primary.dsn(), timeout=5)
    try:
        await admin.execute("CREATE DATABASE duetime")
    finally:
        await admin.close()
    await migrate(pair.primary.dsn("duetime"))
    print(f"\n[switchover] seed {SEED} (replay: DUETIME_TEST_SEED={SEED})")

    c = ChaosCluster(
        scenario="pg_switchover",
        seed=SEED,
        soak=False,
        tmp_path=tmp_path,
        base_env=test_env,
        dsn=pair.multi_host_dsn("duetime"),
        amqp_url=amqp_url,
        etcd_endpoint=etcd_endpoints.split(",")[0],
        prefix=f"duetime-test/{unique}",
        queue=f"chaos.pg_switchover.{unique}",
        rng=random.Random(f"{SEED}:pg_switchover"),
    )
    async with c:
        [replica] = c.spawn_replicas(1)
        [worker] = c.spawn_workers(1)
        _, epoch_before = await c.wait_ready()
        pids = (replica.proc.pid, worker.proc.pid)
        await c.insert_jobs(Plan(jobs=JOBS, window=WINDOW, burst=0.2, sleep_ms=(0.0, 10.0)))

        async def quarter_done() -> bool:
            done = await c.db.fetchval(
                "SELECT count(*) FROM duetime.jobs WHERE task = $1 AND status = 'succeeded'",
                TASK,
            )
            return int(done) >= JOBS * KILL_SHARE

        await wait_for(quarter_done, timeout=WINDOW + 20, message="a quarter of the jobs done")
        await pair.wait_sync()  # the standby is synchronous at the instant of the crash
        done_before = JOBS - await c.settled()

        killed_at = time.time()
        await asyncio.to_thread(pair.primary.stop, stop_mode)
        c.note(f"primary pg1 stopped -m {stop_mode} ({done_before} jobs settled)")
        await asyncio.sleep(promote_after)  # the outage being simulated, not a wait
        promoting_at = time.time()  # nothing commits on pg2 before this instant
        await asyncio.to_thread(pair.standby.promote)
        promoted_s = time.time() - killed_at
        c.note(f"standby pg2 promoted ({promoted_s:.2f}s after the crash)")

        await wait_for(lambda: usable(c.db), timeout=10, message="the observer reconnected")
        settled = await c.wait_settled(SETTLE + max(0.0, c.due_by - time.monotonic()))
        settled_s = time.time() - killed_at

        report = await c.report()
        print(report.summary())
        for fault in report.faults:
            print(f"[switchover]   {fault}")
        assert report.ok, "\n".join(report.problems) + "\n" + c.describe()
        assert settled

        claim_s = await first_after(
            c.db,
            "SELECT extract(epoch FROM min(at))::float8 FROM public.chaos_claims "
            "WHERE at > to_timestamp($1)",
            promoting_at,
            killed_at,
        )
        success_s = await first_after(
            c.db,
            "SELECT extract(epoch FROM min(finished_at))::float8 FROM duetime.jobs "
            "WHERE task = $2 AND status = 'succeeded' AND finished_at > to_timestamp($1)",
            promoting_at,
            killed_at,
            TASK,
        )
        audit = await c.db.fetch(
            "SELECT old_epoch, new_epoch, extract(epoch FROM at)::float8 AS at "
            "FROM public.fence_audit ORDER BY id"
        )
        epochs = [r["new_epoch"] for r in audit]
        assert all(r["new_epoch"] >= r["old_epoch"] for r in audit), audit
        assert epochs == sorted(epochs), f"fence epoch went backwards: {epochs}"
        renewed_after = [r["at"] - killed_at for r in audit if r["at"] > promoting_at]
        epoch_after = epochs[-1] if epochs else epoch_before

        # the same two processes, each started once, reconnected without help
        assert replica.proc.running() and worker.proc.running(), c.describe()
        assert (replica.proc.pid, worker.proc.pid) == pids
        assert event_count(replica.proc.output(), "replica_started") == 1, c.describe()
        assert event_count(worker.proc.output(), "worker_started") == 1, c.describe()
        # every failure met a handled path: none fell through to the consumer's bug path
        assert event_count(worker.proc.output(), "delivery_failed") == 0, c.describe()
        seen = {
            event: event_count(proc.output(), event)
            for proc, events in (
                (replica.proc, ("duty_failed", "listener_connect_failed", "stepping_down")),
                (worker.proc, ("delivery_requeued", "job_retry_scheduled", "attempt_rerun_alone")),
            )
            for event in events
        }

        renewed_s = renewed_after[0] if renewed_after else None
        print(
            f"[switchover] {JOBS} jobs, {done_before} settled before the stop; "
            f"stop -> promoted {promoted_s:.2f}s, -> fence renewed on the new primary "
            f"{seconds(renewed_s)}, -> first claim committed {seconds(claim_s)}, "
            f"-> first job succeeded {seconds(success_s)}, -> all settled {settled_s:.2f}s; "
            f"epoch {epoch_before} -> {epoch_after}; "
            + ", ".join(f"{event} {n}" for event, n in seen.items())
        )
        assert claim_s is not None and claim_s <= promote_after + GAP_BOUND, claim_s
        assert success_s is not None and success_s <= promote_after + GAP_BOUND, success_s
