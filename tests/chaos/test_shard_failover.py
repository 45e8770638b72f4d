"""Per-shard failover of ``duetime scheduler`` replicas as real processes.

Three shards (databases of this test's own), two replicas and one worker, TTL 2 s.
Jobs are inserted with plain SQL into every shard, due over 8 s; 2 s into the stream
the replica leading two shards is killed with SIGKILL. Measured (printed with
``pytest -s``) and asserted, per shard the dead replica led:

- **re-led**: from the kill (``time.time()`` just before the signal) to the surviving
  replica's ``fence_advanced`` log line for that shard (its fence update committed,
  the step before its duties start): within TTL + 1 s;
- **jobs continue**: the first claim committed under the new epoch in that shard
  (``min(dispatched_at)`` of its jobs with that ``dispatch_epoch``), printed;
- every job of every shard succeeds, each effect once and in its own shard.

Then a third replica starts: no replica leads more than ceil(3/2) = 2 shards, and every
shard is led by all three views, within ``JOIN_BOUND`` of the newcomer's member key
appearing in etcd (``Elector``: settle min(1 s, TTL/2) + one poll interval
0.5 s + the handover and the fence advance). Finally the killed replica restarts:
three replicas lead one shard each within the same bound.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import AsyncIterator

import pytest

from tests.support.procs import Processes
from tests.support.shards import Proc, ShardCluster, parse_ts
from tests.support.wait import wait_for

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(120)]

SHARDS = ("a", "b", "c")
TTL = 2.0
START_TIMEOUT = 30.0
JOBS_PER_SHARD = 150
WINDOW = 8.0
KILL_AFTER = 2.0
JOIN_BOUND = 5.0


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
        tag="sf",
        shards=SHARDS,
        ttl=TTL,
    ) as cluster:
        yield cluster


async def balanced(cluster: ShardCluster, live: list[Proc]) -> dict[str, tuple[str, int]] | None:
    """Every shard led by all views, by live replicas only, none above ceil(K/R)."""
    agreed = await cluster.agreed()
    if agreed is None:
        return None
    names = {p.name for p in live}
    per_node = Counter(node for node, _ in agreed.values())
    if set(per_node) - names or max(per_node.values()) > math.ceil(len(SHARDS) / len(live)):
        return None
    return agreed


async def wait_balanced(
    cluster: ShardCluster, live: list[Proc], timeout: float, message: str
) -> dict[str, tuple[str, int]]:
    async def probe() -> dict[str, tuple[str, int]] | None:
        return await balanced(cluster, live)

    try:
        found = await wait_for(probe, timeout=timeout, interval=0.02, message=message)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{cluster.describe()}") from None
    assert found is not None
    return found


async def member_seen(cluster: ShardCluster, name: str, timeout: float) -> float:
    async def seen() -> bool:
        return name in await cluster.members()

    await wait_for(seen, timeout=timeout, interval=0.01, message=f"member key of {name}")
    return time.monotonic()


async def test_kill_a_shard_leader_then_join(shard_cluster: ShardCluster, unique: str) -> None:
    cluster = shard_cluster
    r1 = cluster.spawn_scheduler(f"{unique}-r1")
    r2 = cluster.spawn_scheduler(f"{unique}-r2")
    cluster.spawn_worker(f"{unique}-w1", concurrency=16)
    leaders = await wait_balanced(cluster, [r1, r2], START_TIMEOUT, "3 shards over 2 replicas")
    await cluster.wait_workers(START_TIMEOUT)
    per_node = Counter(node for node, _ in leaders.values())
    victim = r1 if per_node[r1.name] >= per_node[r2.name] else r2
    survivor = r2 if victim is r1 else r1
    victims = {s: epoch for s, (node, epoch) in leaders.items() if node == victim.name}
    print(f"\n[shard-failover] leaders {leaders}; killing {victim.name} (leads {sorted(victims)})")

    for shard in SHARDS:
        await cluster.insert(shard, JOBS_PER_SHARD, over=WINDOW)
    await asyncio.sleep(KILL_AFTER)
    killed_at = time.time()
    victim.proc.kill9()

    async def re_led() -> bool:
        holders = await cluster.holders()
        return all(
            (h := holders[s]) is not None and h[0] == survivor.name and h[1] > e
            for s, e in victims.items()
        )

    try:
        await wait_for(re_led, timeout=TTL + 5, interval=0.01, message="victim's shards re-led")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{cluster.describe()}") from None
    holders = await cluster.holders()
    new_epochs = {s: h[1] for s, h in holders.items() if h is not None}

    async def advanced() -> dict[str, float] | None:
        lines = {
            e["shard"]: parse_ts(e["timestamp"])
            for e in survivor.events("fence_advanced")
            if e.get("shard") in victims and (h := holders[e["shard"]]) and e["epoch"] == h[1]
        }
        return lines if set(lines) == set(victims) else None

    fenced_at = await wait_for(advanced, timeout=TTL + 5, interval=0.02, message="fence lines")
    assert fenced_at is not None
    for shard, at in sorted(fenced_at.items()):
        print(f"[shard-failover] shard {shard}: fence advanced {at - killed_at:.3f} s after "
              f"the kill (epoch {victims[shard]} -> {new_epochs[shard]})")  # fmt: skip
        assert at - killed_at <= TTL + 1.0, (shard, at - killed_at)

    await cluster.wait_done(timeout=WINDOW + 30)
    for rep in (await cluster.check()).values():
        assert rep.jobs == JOBS_PER_SHARD, rep
        assert rep.lost == [], rep
        assert rep.doubled == [], rep
        assert rep.missing_effects == 0, rep
        assert rep.foreign == 0, rep
        assert rep.ledger == JOBS_PER_SHARD, rep
    for shard in victims:
        new_epoch = new_epochs[shard]
        first = await cluster.first_dispatch_after(shard, new_epoch)
        assert first is not None, shard
        print(f"[shard-failover] shard {shard}: first claim in epoch {new_epoch} "
              f"{first - killed_at:.3f} s after the kill")  # fmt: skip

    # A newcomer gets its share from the survivor, which hands the surplus over.
    r3 = cluster.spawn_scheduler(f"{unique}-r3")
    joined = await member_seen(cluster, r3.name, START_TIMEOUT)
    after = await wait_balanced(cluster, [survivor, r3], JOIN_BOUND, "balance after a join")
    took = time.monotonic() - joined
    print(f"[shard-failover] 2 live replicas balanced {took:.3f} s after the newcomer's member "
          f"key appeared: {after}")  # fmt: skip
    assert r3.name in {node for node, _ in after.values()}

    # The killed replica comes back: three replicas, one shard each.
    victim.proc.start()
    rejoined = await member_seen(cluster, victim.name, START_TIMEOUT)
    final = await wait_balanced(cluster, [survivor, r3, victim], JOIN_BOUND, "1/1/1")
    took = time.monotonic() - rejoined
    print(f"[shard-failover] 3 live replicas balanced {took:.3f} s after the restarted "
          f"replica's member key appeared: {final}")  # fmt: skip
    assert sorted(Counter(node for node, _ in final.values()).values()) == [1, 1, 1]
