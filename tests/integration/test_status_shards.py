"""``duetime status`` with shards: leader, epoch and backlog per shard, and the members.

Two shard databases of this module's own (``own_database``) so the counts are exact,
and an etcd prefix per test. The keys are written the way sharded replicas write them
(``scheduler.leadership.elector``): ``<prefix>/members/<node>`` and
``<prefix>/shards/<name>/leader`` on the node's lease (value = node id, epoch = the
key's create_revision), and each shard's fence row as its leader fences it.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aetcd
import asyncpg
import pytest

from scheduler import db
from scheduler.config.shards import member_key, shard_key
from tests.conftest import own_database
from tests.support.cli import Run, run_duetime

pytestmark = pytest.mark.timeout(120)

SHARDS = ("a", "b")
UNREACHABLE = "postgresql://u:topsecret@127.0.0.1:1/none"


@pytest.fixture(scope="module")
async def shard_urls(server_dsn: str) -> AsyncIterator[dict[str, str]]:
    async with contextlib.AsyncExitStack() as stack:
        yield {
            name: await stack.enter_async_context(own_database(server_dsn, f"status_{name}"))
            for name in SHARDS
        }


@dataclass
class Cluster:
    urls: dict[str, str]
    pools: dict[str, asyncpg.Pool]
    etcd: aetcd.Client
    prefix: str
    env: dict[str, str]
    leases: dict[str, object] = field(default_factory=dict)

    async def join(self, node: str) -> None:
        """Register ``node`` as a member, on a lease of its own (as a replica does)."""
        lease = await self.etcd.lease(30)
        self.leases[node] = lease
        await self.etcd.put(member_key(self.prefix, node).encode(), node.encode(), lease=lease)

    async def lead(self, shard: str, node: str, *, renewed_ago: float = 0.0) -> int:
        """``node`` holds ``shard``'s key on its lease and has fenced the shard's database."""
        key = shard_key(self.prefix, shard).encode()
        await self.etcd.put(key, node.encode(), lease=self.leases[node])
        kv = await self.etcd.get(key)
        assert kv is not None
        await self.pools[shard].execute(
            "UPDATE duetime.leader_fence SET epoch = $1, leader_node = $2,"
            " elected_at = now() - interval '5 minutes',"
            " renewed_at = now() - make_interval(secs => $3) WHERE shard = 0",
            kv.create_revision,
            node,
            renewed_ago,
        )
        return int(kv.create_revision)

    def shards_env(self, **override: str) -> dict[str, str]:
        urls = {**self.urls, **override}
        return {**self.env, "DUETIME_SHARDS": ",".join(f"{n}={u}" for n, u in urls.items())}

    async def run(self, *args: str, env: dict[str, str] | None = None) -> Run:
        return await run_duetime(env or self.shards_env(), "status", *args, timeout=30)

    async def status_json(self, *args: str, env: dict[str, str] | None = None) -> tuple[int, dict]:
        code, out, err = await self.run("--json", *args, env=env)
        assert code in (0, 1), f"exit {code}: {err}"
        return code, json.loads(out)


@pytest.fixture
async def cluster(
    shard_urls: dict[str, str], etcd_endpoints: str, test_env: dict[str, str], unique: str
) -> AsyncIterator[Cluster]:
    pools = {name: await db.create_pool(url, max_size=2) for name, url in shard_urls.items()}
    for pool in pools.values():  # each test starts from empty shards, never fenced
        await pool.execute("TRUNCATE duetime.jobs")
        await pool.execute(
            "UPDATE duetime.leader_fence SET epoch = 0, leader_node = NULL, elected_at = NULL,"
            " renewed_at = NULL WHERE shard = 0"
        )
    host, _, port = etcd_endpoints.split(",")[0].rpartition(":")
    client = aetcd.Client(host=host, port=int(port), timeout=5)
    prefix = f"duetime-test/{unique}"
    env = {**test_env, "DUETIME_ETCD_PREFIX": prefix, "DUETIME_LOG_LEVEL": "warning"}
    env.pop("DUETIME_LOG_FORMAT", None)
    try:
        yield Cluster(shard_urls, pools, client, prefix, env)
    finally:
        with contextlib.suppress(Exception):
            await client.delete_prefix(prefix.encode())
        await client.close()
        for pool in pools.values():
            await pool.close()


async def _seed(pool: asyncpg.Pool, *, due: int, future: int, dispatched: int, dead: int) -> None:
    """Jobs in known states; dispatched ones under the shard's current fence epoch."""
    await pool.execute(
        """
        INSERT INTO duetime.jobs (task, due_at, status, dispatched_at, finished_at,
                                  dispatch_epoch)
        SELECT 't', v.due_at, v.status, v.dispatched_at, v.finished_at,
               CASE WHEN v.status = 'dispatched' THEN
                   (SELECT epoch FROM duetime.leader_fence WHERE shard = 0) END
          FROM (
            SELECT now() - interval '5 seconds' AS due_at, 'pending' AS status,
                   NULL::timestamptz AS dispatched_at, NULL::timestamptz AS finished_at
              FROM generate_series(1, $1)
            UNION ALL
            SELECT now() + interval '1 hour', 'pending', NULL, NULL FROM generate_series(1, $2)
            UNION ALL
            SELECT now() - interval '1 minute', 'dispatched', now(), NULL
              FROM generate_series(1, $3)
            UNION ALL
            SELECT now() - interval '1 minute', 'dead', now(), now() FROM generate_series(1, $4)
          ) AS v
        """,
        due,
        future,
        dispatched,
        dead,
    )


def _by_name(report: dict) -> dict[str, dict]:
    return {s["name"]: s for s in report["shards"]}


async def test_each_shard_shows_leader_epoch_fence_and_backlog(cluster: Cluster) -> None:
    await cluster.join("node-1")
    await cluster.join("node-2")
    epoch_a = await cluster.lead("a", "node-1")
    epoch_b = await cluster.lead("b", "node-2")
    await _seed(cluster.pools["a"], due=3, future=2, dispatched=1, dead=1)
    await _seed(cluster.pools["b"], due=0, future=1, dispatched=4, dead=0)

    code, report = await cluster.status_json("--max-backlog-age", "60")
    assert code == 0, report["problems"]
    assert report["healthy"] is True and report["problems"] == [] and report["warnings"] == []
    assert report["etcd"]["reachable"] is True
    assert [m["node"] for m in report["members"]] == ["node-1", "node-2"]
    assert all(0 < m["lease_remaining"] <= 30 for m in report["members"])
    shards = _by_name(report)
    assert list(shards) == ["a", "b"]  # in configured order
    a, b = shards["a"], shards["b"]
    assert a["reachable"] is True and a["healthy"] is True and a["error"] is None
    assert a["etcd"]["key"] == f"{cluster.prefix}/shards/a/leader"
    assert (a["etcd"]["leader"], a["etcd"]["epoch"]) == ("node-1", epoch_a)
    assert (a["leader"]["leader_node"], a["leader"]["epoch"]) == ("node-1", epoch_a)
    assert (b["etcd"]["leader"], b["leader"]["epoch"]) == ("node-2", epoch_b)
    assert epoch_b > epoch_a  # each shard has its own key, so its own epoch
    assert a["backlog"]["pending"] == 5 and a["backlog"]["due_now"] == 3
    assert (a["backlog"]["dispatched"], a["backlog"]["dead_last_hour"]) == (1, 1)
    assert 5 <= a["backlog"]["oldest_overdue"] < 15
    assert b["backlog"]["oldest_unstarted"] < 10  # seeded as dispatched just now
    assert {**b["backlog"], "oldest_unstarted": None} == {
        "pending": 1, "due_now": 0, "oldest_overdue": None, "dispatched": 4, "dead_last_hour": 0,
        "unstarted": 4, "oldest_unstarted": None,
    }  # fmt: skip
    assert report["broker"]["reachable"] is True
    assert [q["queue"] for q in a["queues"]] == ["default"]

    code, out, err = await cluster.run("--max-backlog-age", "60")
    assert code == 0, out + err
    lines = out.splitlines()
    assert lines[0].split() == [
        "SHARD", "LEADER", "EPOCH", "FENCE_EPOCH", "RENEWED", "PENDING", "DUE_NOW",
        "OLDEST_OVERDUE", "DISPATCHED", "UNSTARTED", "OLDEST_UNSTARTED", "DEAD_1H", "STATE",
    ]  # fmt: skip
    assert lines[1].split()[:4] == ["a", "node-1", str(epoch_a), str(epoch_a)]
    assert lines[1].split()[-1] == "ok"
    assert lines[2].split()[:4] == ["b", "node-2", str(epoch_b), str(epoch_b)]
    assert "members    2: node-1" in out and "node-2" in out
    assert out.rstrip().endswith("status: OK")


async def test_unreachable_shard_is_shown_and_does_not_hide_the_others(cluster: Cluster) -> None:
    await cluster.join("node-1")
    epoch_a = await cluster.lead("a", "node-1")
    await cluster.lead("b", "node-1")
    env = cluster.shards_env(b=UNREACHABLE)

    code, report = await cluster.status_json(env=env)
    assert code == 1
    assert [(p["code"], p["shard"]) for p in report["problems"]] == [("database_unreachable", "b")]
    shards = _by_name(report)
    assert shards["a"]["healthy"] is True and shards["a"]["leader"]["epoch"] == epoch_a
    b = shards["b"]
    assert b["reachable"] is False and b["healthy"] is False and b["leader"] is None
    assert "127.0.0.1:1" in b["error"] and b["backlog"] is None
    assert b["etcd"]["leader"] == "node-1"  # etcd still says who leads it

    code, out, _ = await cluster.run(env=env)
    assert code == 1
    assert "topsecret" not in out
    rows = {line.split()[0]: line for line in out.splitlines()[1:3]}
    assert rows["a"].split()[-1] == "ok" and rows["b"].split()[-1] == "UNREACHABLE"
    assert "shard b: unreachable: cannot connect to PostgreSQL" in out
    assert out.rstrip().splitlines()[-1].startswith("status: UNHEALTHY: shard b: ")


async def test_unled_and_stale_shards_are_problems_of_that_shard(cluster: Cluster) -> None:
    await cluster.join("node-1")
    await cluster.lead("a", "node-1", renewed_ago=7.0)  # TTL 2 s here: stale after 6 s
    code, report = await cluster.status_json()
    assert code == 1
    assert sorted((p["shard"], p["code"]) for p in report["problems"]) == [
        ("a", "leader_stale"), ("b", "no_leader"), ("b", "no_leader"),
    ]  # fmt: skip
    b = _by_name(report)["b"]
    assert b["etcd"]["reachable"] is True and b["etcd"]["leader"] is None
    assert b["leader"]["epoch"] == 0

    code, out, _ = await cluster.run()
    assert code == 1
    assert "PROBLEM: shard b: no leader: election key" in out
    assert "no_leader" in out.splitlines()[2] and "leader_stale" in out.splitlines()[1]


async def test_etcd_unreachable_is_one_warning_judged_by_fences(cluster: Cluster) -> None:
    await cluster.join("node-1")
    await cluster.lead("a", "node-1")
    await cluster.lead("b", "node-1")
    code, report = await cluster.status_json(
        "--etcd-endpoints", "127.0.0.1:1", "--etcd-timeout", "0.5"
    )
    assert code == 0, report["problems"]
    assert [w["code"] for w in report["warnings"]] == ["etcd_unreachable"]
    assert "shard" not in report["warnings"][0]
    assert report["etcd"]["reachable"] is False and report["members"] == []
    assert all(s["healthy"] and s["etcd"]["reachable"] is False for s in report["shards"])
    assert [s["leader"]["leader_node"] for s in report["shards"]] == ["node-1", "node-1"]


async def test_a_full_limit_of_a_shard_is_a_warning_of_that_shard(cluster: Cluster) -> None:
    """The limit line of the unsharded status (``limit_holding``), per shard."""
    await cluster.join("node-1")
    for shard in SHARDS:
        await cluster.lead(shard, "node-1")
    await _seed(cluster.pools["b"], due=3, future=0, dispatched=1, dead=0)
    limits = cluster.pools["b"]
    await limits.execute("INSERT INTO duetime.limits (target, max_running) VALUES ('task:t', 1)")
    try:
        code, report = await cluster.status_json("--max-backlog-age", "600")
        code_text, out, err = await cluster.run("--max-backlog-age", "600")
    finally:
        await limits.execute("DELETE FROM duetime.limits")
    assert code == 0, report["problems"]
    line = "limit task:t holds 3 due jobs: 1 of 1 running"
    assert report["warnings"] == [{"shard": "b", "code": "limit_holding", "message": line}]
    assert code_text == 0, out + err
    assert f"warning: shard b: {line}" in out.splitlines()
