"""A concurrency limit across a real kill -9 of the leader (issue 23, target 1).

Three ``duetime scheduler`` replicas and two ``duetime worker``s (concurrency 16 each,
so only the limit keeps them to 3), 300 ``chaos.check`` jobs due at once, each sleeping
150-250 ms in its handler, ``task:chaos.check --max-running 3`` set before any replica
starts. The leader is killed -9 once a third of the jobs finished. The new leader has no
memory of its predecessor: it must rebuild the running count from the rows (the jobs
still ``dispatched``) and never start a fourth.

Concurrency is measured from the handlers' own records: each job's handler runs at
least from its recorded delivery (``chaos_deliveries.at``, clock_timestamp() as the
handler starts) for its ``sleep_ms`` (it sleeps that long after recording); that
interval lies inside the time the job counts against the limit (dispatch to outcome
commit), so more than 3 of them overlapping would be a breach. (``finished_at`` cannot
end the interval: it is the outcome transaction's now(), taken before the handler ran.)
Then the chaos checker judges the run as usual: every job succeeded once (0 lost, 0
double). Throughput is printed against the limit's ideal (3 jobs per
mean handler time).
"""

from __future__ import annotations

import pytest

from tests.chaos.chaos_tasks import TASK
from tests.chaos.conftest import MakeCluster
from tests.chaos.harness import TTL, Plan
from tests.support.wait import wait_for

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(240)]

LIMIT = 3
JOBS = 300


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    """The most intervals open at one instant (an end before a start at a tie)."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    now = most = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


async def test_max_running_holds_across_a_kill_9_of_the_leader(chaos: MakeCluster) -> None:
    c = chaos("limit_kill9", seed=0, soak=False)
    async with c:
        await c.db.execute(
            "INSERT INTO duetime.limits (target, max_running) VALUES ($1, $2)",
            f"task:{TASK}",
            LIMIT,
        )
        c.spawn_replicas(3)
        c.spawn_workers(2)
        await c.wait_ready(timeout=90)  # five processes starting on a shared 2-core box
        await c.insert_jobs(Plan(jobs=JOBS, window=0.0, burst=1.0, sleep_ms=(150, 250),
                                 fail_share=0.0))  # fmt: skip

        async def a_third_done() -> bool:
            return await c.settled() <= JOBS - JOBS // 3

        await wait_for(a_third_done, timeout=90, message="a third of the jobs finished")
        running_at_kill = await c.db.fetchval(
            "SELECT count(*) FROM duetime.jobs WHERE status = 'dispatched'"
        )
        took = await c.kill_leader()
        assert await c.wait_settled(120), c.describe()
        report = await c.report()
        print(report.summary())
        assert report.ok, "\n".join(report.problems) + "\n" + c.describe()
        rows = await c.db.fetch(
            "SELECT extract(epoch FROM min(d.at))::float8 AS started,"
            "       extract(epoch FROM min(d.at))::float8"
            "           + (j.payload->>'sleep_ms')::float8 / 1000 AS finished,"
            "       j.dispatch_epoch"
            "  FROM duetime.jobs AS j JOIN public.chaos_deliveries AS d ON d.job_id = j.id"
            " WHERE j.task = $1 GROUP BY j.id, j.payload, j.dispatch_epoch",
            TASK,
        )
        sleeps = await c.db.fetchval(
            "SELECT avg((payload->>'sleep_ms')::float8) / 1000 FROM duetime.jobs WHERE task = $1",
            TASK,
        )
    intervals = [(r["started"], r["finished"]) for r in rows]
    epochs = {r["dispatch_epoch"] for r in rows}
    peak = max_overlap(intervals)
    span = max(e for _, e in intervals) - min(s for s, _ in intervals)
    ideal = LIMIT / sleeps  # jobs per second if 3 handlers were busy all the time
    print(
        f"\n[limits] kill -9 of the leader with {running_at_kill} dispatched: failover "
        f"{took:.3f} s (TTL {TTL:g} s); peak concurrency {peak} (limit {LIMIT}); "
        f"{JOBS} jobs in {span:.1f} s = {JOBS / span:.1f}/s, ideal {ideal:.1f}/s "
        f"({JOBS / span / ideal:.2f}x, the failover included); epochs {sorted(epochs)}"
    )
    assert len(rows) == JOBS
    assert len(epochs) >= 2  # both leaders dispatched some
    assert peak == LIMIT  # reached, never passed, across the kill -9
