"""Recurring schedules across a leader crash: kill -9 the leader while 500
schedules firing every second are being planned → over a 20-second window every fire
time of every schedule became exactly one job: none missed (``fire_all``), none doubled.

Real ``duetime scheduler`` replica processes (the planner is one of their duties), TTL
2 s, a database and etcd prefix of their own. The planner horizon
is 1 s (the minimum), so the jobs planned ahead cover only ~0.5-1 s and the failover
(~TTL + 1 s) really leaves fire times unplanned: the new leader must find them late and
catch each one up (``fire_all``), while ``schedule_fires`` keeps it from repeating one
the dead leader already committed. Checking the jobs rows is enough: no worker runs.
"""

from __future__ import annotations

import asyncio
import math
import time
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from tests.chaos.cluster import Node, SchedulerCluster
from tests.chaos.harness import TTL
from tests.support.etcd import free_port
from tests.support.procs import duetime_argv
from tests.support.wait import wait_for

pytestmark = pytest.mark.chaos

SCHEDULES = 500
WINDOW = 20  # seconds of fire times checked
KILL_AFTER = 5  # seconds into the window
START_TIMEOUT = 30.0


def spawn_replica(cluster: SchedulerCluster, name: str) -> Node:
    port = free_port()
    proc = cluster.procs.spawn(
        duetime_argv("scheduler"),
        name=name,
        env={
            **cluster.env,
            "DUETIME_NODE_ID": name,
            "DUETIME_METRICS_PORT": str(port),
            "DUETIME_PLANNER_HORIZON": "1",
        },
    )
    node = Node(name, proc, port)
    cluster.nodes[name] = node
    return node


@pytest.mark.timeout(150)
async def test_kill9_leader_while_planning_no_fire_time_missed_or_doubled(
    cluster: SchedulerCluster, migrated_dsn: str, unique: str
) -> None:
    db = await asyncpg.connect(migrated_dsn, timeout=10)
    try:
        await db.execute(
            "INSERT INTO duetime.schedules (name, task, queue, cron, misfire_policy, misfire_cap)"
            " SELECT 'every-second-' || i, 'tick', $1, '* * * * * *', 'fire_all', 1000"
            "   FROM generate_series(1, $2) AS i",
            f"q{unique}",
            SCHEDULES,
        )
        nodes = [spawn_replica(cluster, f"{unique}-p{i}") for i in (1, 2)]
        leader, epoch = await cluster.wait_leader(START_TIMEOUT)

        async def all_planned() -> bool:
            n = await db.fetchval(
                "SELECT count(*) FROM duetime.schedules WHERE next_fire_at IS NOT NULL"
            )
            return bool(n == SCHEDULES)

        await wait_for(all_planned, timeout=START_TIMEOUT, message="all schedules planned")
        start = datetime.fromtimestamp(math.ceil(time.time()) + 2, UTC)
        end = start + timedelta(seconds=WINDOW)

        # the window is defined by wall-clock time: wait for the kill instant
        await asyncio.sleep(start.timestamp() + KILL_AFTER - time.time())
        killed_at = time.monotonic()
        leader.proc.kill9()
        new_leader, new_epoch = await cluster.wait_leader(
            TTL + 5, exclude=[leader.name], message="a new leader after kill -9"
        )
        failover = time.monotonic() - killed_at
        assert new_epoch > epoch and new_leader is not leader

        expected = SCHEDULES * (WINDOW + 1)  # fire times start, start+1 s, ..., end

        async def window_materialized() -> int:
            n = await db.fetchval(
                "SELECT count(*) FROM duetime.jobs WHERE schedule_id IS NOT NULL "
                "AND due_at BETWEEN $1 AND $2",
                start,
                end,
            )
            return int(n) if n >= expected else 0

        remaining = end.timestamp() - time.time()
        await wait_for(
            window_materialized,
            timeout=remaining + 20,
            interval=0.25,
            message=f"{expected} jobs in the window\n{cluster.describe()}",
        )

        # exactly once: every (schedule, second) of the window, one job each
        rows = await db.fetch(
            "SELECT schedule_id, due_at, count(*) AS n, min(idempotency_key) AS key "
            "FROM duetime.jobs WHERE schedule_id IS NOT NULL AND due_at BETWEEN $1 AND $2 "
            "GROUP BY schedule_id, due_at",
            start,
            end,
        )
        doubled = [dict(r) for r in rows if r["n"] != 1]
        assert not doubled, doubled[:10]
        ids = {r["id"] for r in await db.fetch("SELECT id FROM duetime.schedules")}
        seconds = {start + timedelta(seconds=i) for i in range(WINDOW + 1)}
        got = {(r["schedule_id"], r["due_at"]) for r in rows}
        missing = {(sid, t) for sid in ids for t in seconds} - got
        assert not missing, sorted(missing)[:10]
        for r in rows[:100]:
            iso = r["due_at"].astimezone(UTC).replace(tzinfo=None).isoformat()
            assert r["key"] == f"schedule:{r['schedule_id']}:{iso}Z"
        dup_keys = await db.fetchval(
            "SELECT count(*) FROM (SELECT idempotency_key FROM duetime.jobs "
            "GROUP BY idempotency_key HAVING count(*) > 1) d"
        )
        assert dup_keys == 0
        fires = await db.fetchval(
            "SELECT count(*) FROM duetime.schedule_fires WHERE fire_time BETWEEN $1 AND $2",
            start,
            end,
        )
        assert fires == expected
        caught_up = await db.fetchval("SELECT sum(missed_count) FROM duetime.schedules")
        skipped = await db.fetchval("SELECT sum(skipped_count) FROM duetime.schedules")
        assert skipped == 0  # fire_all with a cap of 1000: every missed time fired
        assert all(n.proc.running() for n in nodes if n is not leader)
        print(
            f"\n[schedules failover] {SCHEDULES} schedules x {WINDOW + 1} s = {expected} fire "
            f"times, each exactly once; new leader after {failover:.2f}s; "
            f"{caught_up} fire times found late and caught up (fire_all)"
        )
    finally:
        await db.close()
