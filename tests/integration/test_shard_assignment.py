"""Shard assignment against the real etcd: replica processes running only
``scheduler.leadership.elector`` (bench/shard_sim.py at a small size).

8 shards, 3 replica processes, lease TTL 2 s: the cluster converges balanced
(nobody above ⌈K/R⌉), a fourth process joining gets its share within the stated bound
(settle 1 s + two poll intervals + 1 s of slack = 3 s, from the moment its member key
is visible), a ``kill -9`` replica's shards are re-led within TTL + 1 s, and at no
sample do two processes believe they lead the same shard (their own reports, not
etcd's keys). The run uses its own etcd prefix and deletes it.
"""

from __future__ import annotations

import uuid

import aetcd
import pytest

from bench.shard_sim import Params, run_simulation

pytestmark = pytest.mark.timeout(150)

TTL = 2.0
REBALANCE_BOUND = 3.0


async def test_converges_rebalances_and_releads_without_two_believers(
    etcd_endpoints: str,
) -> None:
    endpoint = etcd_endpoints.split(",")[0]
    prefix = f"duetime-test/shards-{uuid.uuid4().hex[:10]}"
    params = Params(
        shards=8, replicas=4, join=1, kill=1, ttl=TTL, quiet=2.0, phase_timeout=40.0,
        endpoint=endpoint, prefix=prefix,
    )  # fmt: skip
    result = await run_simulation(params)
    print("MEASURE", result)

    for phase, replicas in (("after_start", 3), ("after_join", 4), ("after_kill", 3)):
        spread = result[phase]
        assert spread["replicas"] == replicas
        assert spread["max_leaders"] <= spread["target"], (phase, spread)
    assert result["after_join"]["min_leaders"] == 2, "the newcomer got its share"
    assert result["rebalance_s"] <= REBALANCE_BOUND, result
    assert result["killed_shards"] >= 1
    assert result["relead_s_max"] <= TTL + 1.0, result
    assert result["two_believer_samples"] == 0
    assert result["belief_overlaps"] == 0

    host, _, port = endpoint.rpartition(":")
    client = aetcd.Client(host=host, port=int(port), timeout=2.0)
    try:
        left = await client.get_prefix(f"{prefix}/".encode())
        assert len(left) == 0, "the simulation removes its prefix"
    finally:
        await client.close()
