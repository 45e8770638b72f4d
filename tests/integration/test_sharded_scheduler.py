"""Two shards led by two ``duetime scheduler`` processes (real PostgreSQL, RabbitMQ, etcd).

Each shard is a migrated database of this test's own; both replicas and one worker get
``DUETIME_SHARDS`` naming both, TTL 2 s, a unique etcd prefix and a queue of their own.
Jobs are inserted with plain SQL into each shard's database. Checked: every job
succeeds, each effect once and in its own shard's database, one ledger row per job in
that shard; each shard is led by exactly one replica by all three views (its etcd key,
its fence row, the holder's log), and the two replicas lead one shard each once stable.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import AsyncIterator

import pytest

from tests.support.procs import Processes
from tests.support.shards import ShardCluster
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(90)

SHARDS = ("a", "b")
START_TIMEOUT = 30.0  # three Python processes importing grpc/aio-pika on a 2-core box
JOBS_PER_SHARD = 150


@pytest.fixture
async def shard_cluster(
    procs: Processes, test_env: dict[str, str], server_dsn: str, etcd_endpoints: str, unique: str
) -> AsyncIterator[ShardCluster]:
    async with ShardCluster.for_test(
        procs,
        test_env,
        server_dsn=server_dsn,
        etcd_endpoints=etcd_endpoints,
        unique=unique,
        tag="ss",
        shards=SHARDS,
    ) as cluster:
        yield cluster


async def test_two_shards_two_replicas_one_worker(shard_cluster: ShardCluster, unique: str) -> None:
    cluster = shard_cluster
    started = time.monotonic()
    r1 = cluster.spawn_scheduler(f"{unique}-r1")
    r2 = cluster.spawn_scheduler(f"{unique}-r2")
    cluster.spawn_worker(f"{unique}-w1")

    async def split() -> dict[str, tuple[str, int]] | None:
        agreed = await cluster.agreed()
        if agreed is None:
            return None
        per_node = Counter(node for node, _ in agreed.values())
        return agreed if sorted(per_node.values()) == [1, 1] else None

    try:
        leaders = await wait_for(split, timeout=START_TIMEOUT, interval=0.05, message="1/1 split")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{cluster.describe()}") from None
    assert leaders is not None
    print(f"\n[sharded] both shards led, one per replica, {time.monotonic() - started:.2f} s "
          f"after spawning: {leaders}")  # fmt: skip
    await cluster.wait_workers(START_TIMEOUT)

    for shard in SHARDS:
        await cluster.insert(shard, JOBS_PER_SHARD, over=3.0)
    inserted = time.monotonic()
    await cluster.wait_done(timeout=40)
    print(f"[sharded] {len(SHARDS) * JOBS_PER_SHARD} jobs done "
          f"{time.monotonic() - inserted:.2f} s after insert (due over 3 s)")  # fmt: skip

    reports = await cluster.check()
    for rep in reports.values():
        assert rep.jobs == JOBS_PER_SHARD, rep
        assert rep.lost == [], rep
        assert rep.doubled == [], rep
        assert rep.missing_effects == 0, rep
        assert rep.foreign == 0, rep
        assert rep.ledger == JOBS_PER_SHARD, rep

    # Still one leader per shard by all views, split 1/1, nobody stepped down meanwhile.
    assert await cluster.agreed() == leaders
    for node in (r1, r2):
        assert node.proc.running(), cluster.describe()
        assert not node.events("shard_stepping_down"), cluster.describe()
        mine = {s for s, (n, _) in leaders.items() if n == node.name}
        assert set(node.leading()) == mine

    # SIGTERM: duties stop, the lease is revoked, the other replica takes both at once.
    stopped_at = time.monotonic()
    r1.proc.sigterm()

    async def r2_leads_both() -> bool:
        agreed = await cluster.agreed()
        return agreed is not None and {n for n, _ in agreed.values()} == {r2.name}

    try:
        await wait_for(r2_leads_both, timeout=3.0, interval=0.01, message="r2 leads both")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{cluster.describe()}") from None
    took = time.monotonic() - stopped_at
    assert await r1.proc.wait(10) == 0
    print(f"[sharded] SIGTERM of {r1.name}: {r2.name} leads both shards after {took:.3f} s")
    assert took < 1.0 + cluster.ttl / 2, took
