"""Workflows across kill -9 (issue 28, chaos target): 100 concurrent 5-step chains of
``chaos.check`` jobs (plain SQL ``depends_on``), three ``duetime scheduler`` replicas and
two ``duetime worker``s; the leader is killed -9 once some steps finished, then a worker.

Judged: the chaos checker's usual verdict (every job succeeded, its effect applied once:
nothing lost, nothing doubled), and for every step after the first, no delivery before
its dependency's *committed* effect (``chaos_effects`` keeps only committed rows; its
``at`` is taken inside the attempt, before the commit): none released early, each in
order.
"""

from __future__ import annotations

import json

import pytest

from tests.chaos.chaos_tasks import TASK
from tests.chaos.conftest import MakeCluster
from tests.support.wait import wait_for

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(300)]

WORKFLOWS = 100
STEPS = 5


async def test_kill9_leader_and_worker_mid_way_through_100_five_step_workflows(
    chaos: MakeCluster,
) -> None:
    c = chaos("workflows_kill9", seed=0, soak=False)
    async with c:
        c.spawn_replicas(3)
        c.spawn_workers(2)
        await c.wait_ready(timeout=90)
        previous: list[int] | None = None
        for _ in range(STEPS):  # one statement per step of all 100 chains
            payloads = [json.dumps({"sleep_ms": c.rng.uniform(30, 120)}) for _ in range(WORKFLOWS)]
            rows = await c.db.fetch(
                "INSERT INTO duetime.jobs (task, queue, payload, depends_on, workflow_id) "
                "SELECT $1, $2, p::jsonb, CASE WHEN d IS NULL THEN NULL ELSE ARRAY[d] END, n "
                "  FROM unnest($3::text[], $4::bigint[]) WITH ORDINALITY AS t(p, d, n) "
                " ORDER BY n RETURNING id",
                TASK,
                c.queue,
                payloads,
                previous or [None] * WORKFLOWS,
            )
            previous = sorted(r["id"] for r in rows)

        async def some_done() -> bool:
            return await c.settled() <= WORKFLOWS * STEPS * 3 // 4

        await wait_for(some_done, timeout=120, message="a quarter of the steps finished")
        await c.kill_leader()
        await c.kill_worker()
        assert await c.wait_settled(180), c.describe()
        report = await c.report()
        print(report.summary())
        assert report.ok, "\n".join(report.problems) + "\n" + c.describe()
        early = await c.db.fetch(
            "SELECT j.id, j.depends_on[1] AS dep"
            "  FROM duetime.jobs j"
            " WHERE j.task = $1 AND j.depends_on IS NOT NULL"
            "   AND (SELECT min(d.at) FROM public.chaos_deliveries d WHERE d.job_id = j.id)"
            "       <= (SELECT max(e.at) FROM public.chaos_effects e"
            "            WHERE e.job_id = j.depends_on[1])",
            TASK,
        )
        statuses = await c.db.fetch(
            "SELECT status, count(*) FROM duetime.jobs WHERE task = $1 GROUP BY 1", TASK
        )
    assert not early, f"released before the dependency's effect committed: {early[:5]}"
    assert {r["status"]: r["count"] for r in statuses} == {"succeeded": WORKFLOWS * STEPS}
