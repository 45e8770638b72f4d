"""A 3-node RabbitMQ cluster loses the node that leads the job queue mid-storm
(DESIGN §8: quorum queues, ``DUETIME_AMQP_URL`` listing every node).

Three private nodes on loopback (``tests/support/rabbit.py``; the machine's own broker
is not touched) are joined into one cluster. A real scheduler replica and a real
worker process get all three URLs; both connect to the first, where the worker
declares the job queue, so its quorum leader is the node they talk to (RabbitMQ
places a new queue's leader on the declaring client's node). While a storm of jobs
comes due, that node is killed -9. Then, from PostgreSQL alone
(``tests/chaos/check.py``): every job succeeded, none lost, exactly one committed
effect per job, no stale claim; and from the surviving nodes: the queue has a new
leader among them, and the dispatcher's, reconciler's and worker's connections are
open on a live node.

Duration (CI budget): the cluster's boot and join are most of it; the figures are
printed (``[rabbit]`` lines) and recorded in docs/operations.md.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest

from scheduler.broker import queue_name
from tests.chaos.chaos_tasks import TASK
from tests.chaos.check import TERMINAL
from tests.chaos.harness import ChaosCluster, Plan
from tests.support import rabbit
from tests.support.rabbit import RabbitCluster
from tests.support.wait import wait_for

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(240)]

SEED = int(os.environ.get("DUETIME_TEST_SEED") or random.SystemRandom().randrange(1, 2**31))
JOBS = 3000
WINDOW = 8.0  # seconds over which the jobs come due
SETTLE = 60.0  # after the window, for the backlog to drain
CLIENTS = ("duetime-dispatcher", "duetime-reconciler", "duetime-worker")


async def _succeeded(c: ChaosCluster) -> int:
    return int(
        await c.db.fetchval(
            "SELECT count(*) FROM duetime.jobs WHERE task = $1 AND status = 'succeeded'", TASK
        )
    )


async def _clients_on(cluster: RabbitCluster) -> dict[str, str | None]:
    """Each duetime client (by the connection name prefix) -> node name it is on."""
    found: dict[str, str | None] = {}
    for name, node in (await cluster.connections()).items():
        for client in CLIENTS:
            if name.startswith(client + ":"):
                found[client] = node.name if node is not None else None
    return found


async def test_queue_leader_killed_mid_storm(
    tmp_path: Path,
    test_env: dict[str, str],
    migrated_dsn: str,
    etcd_endpoints: str,
    unique: str,
) -> None:
    reason = rabbit.missing()
    if reason:
        pytest.fail(f"private RabbitMQ nodes cannot run here: {reason}", pytrace=False)
    print(f"\n[rabbit] seed {SEED} (replay: DUETIME_TEST_SEED={SEED})")
    began = time.monotonic()
    async with RabbitCluster(3, base_dir=tmp_path / "rabbit") as cluster:
        print(f"[rabbit] cluster up: {cluster.timings}")
        c = ChaosCluster(
            scenario="rabbit_cluster",
            seed=SEED,
            soak=False,
            tmp_path=tmp_path,
            base_env=test_env,
            dsn=migrated_dsn,
            amqp_url=",".join(node.url() for node in cluster.nodes),
            etcd_endpoint=etcd_endpoints.split(",")[0],
            prefix=f"duetime-test/{unique}",
            queue=f"chaos.rabbit.{unique}",
            rng=random.Random(f"{SEED}:rabbit_cluster"),
        )
        async with c:
            c.spawn_replicas(1)
            c.spawn_workers(1)
            await c.wait_ready()
            ready = time.monotonic()
            queue = queue_name(c.queue)
            leader, members = await cluster.queue_leader(queue)
            assert sorted(members) == sorted(n.name for n in cluster.nodes), members

            await c.insert_jobs(Plan(jobs=JOBS, window=WINDOW, burst=0.3, sleep_ms=(0.0, 5.0)))
            storm = time.monotonic()
            await wait_for(lambda: _succeeded(c), timeout=30, message="the first jobs succeeded")
            before = await _clients_on(cluster)
            assert set(before) == set(CLIENTS), f"clients seen: {before}\n{c.describe()}"
            # the queue leader is the node the clients talk to: killing it moves them all
            assert set(before.values()) == {leader}, (before, leader)

            async def a_share_done() -> bool:
                return await _succeeded(c) >= JOBS // 4

            await wait_for(a_share_done, timeout=30, interval=0.05, message="a quarter done")
            done_at_kill = await _succeeded(c)
            victim = next(n for n in cluster.nodes if n.name == leader)
            cluster.kill9(victim)
            c.note(f"kill -9 RabbitMQ node {victim.name} (queue leader), {done_at_kill} done")
            assert done_at_kill < JOBS, "the storm was over before the kill"

            settled = await c.wait_settled(SETTLE + max(0.0, c.due_by - time.monotonic()))
            drained = time.monotonic()
            report = await c.report()
            print(report.summary())
            for fault in report.faults:
                print(f"[rabbit]   {fault}")
            assert settled and report.ok, (
                "\n".join(report.problems) + "\n" + c.describe() + "\n" + cluster.describe()
            )
            assert report.jobs == JOBS and report.succeeded == JOBS
            assert report.lost == 0 and report.double_effects == 0
            still = await c.db.fetchval(
                "SELECT count(*) FROM duetime.jobs WHERE task = $1 AND status <> ALL($2)",
                TASK,
                list(TERMINAL),
            )
            assert still == 0

            live = {n.name for n in cluster.live()}
            new_leader, _ = await cluster.queue_leader(queue)
            assert new_leader in live, (new_leader, live)

            async def moved() -> dict[str, str | None] | None:
                after = await _clients_on(cluster)
                ok = set(after) == set(CLIENTS) and all(v in live for v in after.values())
                return after if ok else None

            after = await wait_for(moved, timeout=20, interval=0.5, message="clients on live nodes")
            print(
                f"[rabbit] queue leader {leader} killed with {done_at_kill}/{JOBS} done; "
                f"new leader {new_leader}; clients {before} -> {after}"
            )
    total = time.monotonic() - began
    print(
        f"[rabbit] timings: boot {cluster.timings['boot_s']}s, join "
        f"{cluster.timings['join_s']}s, duetime ready at {ready - began:.1f}s, storm+kill+drain "
        f"{drained - storm:.1f}s, total {total:.1f}s"
    )
