"""A sharded duetime cluster as real processes, observed only from outside.

``ShardCluster`` owns, for one test: K migrated shard databases of its own (each with
the ``shard_effects`` table of ``tests.fixtures_tasks.shards``), ``duetime scheduler``
and ``duetime worker`` processes started with ``DUETIME_SHARDS`` naming all of them,
one etcd prefix and one job queue. Its views of "who leads which shard", which tests
cross-check:

- etcd: the value (node id) and create_revision (epoch) of every
  ``<prefix>/shards/<name>/leader`` key, and the ``<prefix>/members/`` keys;
- PostgreSQL: each shard's ``leader_fence`` row (its own epoch and leader node);
- the processes: their JSON log lines (``shard_leading`` / ``shard_stepping_down``
  with ``shard``, ``node_id`` and ``epoch``).

Jobs are inserted with plain SQL into each shard's database, and ``check()`` reports
per shard: jobs not succeeded (lost), effects applied more than once, ledger rows,
and effects written to any database but the job's own. ``__aexit__`` kills every
process, drops the databases, deletes the prefix and the queue, whatever happened.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import aetcd
import aio_pika
import asyncpg

from tests.conftest import own_database
from tests.fixtures_tasks.shards import EFFECTS_DDL, EFFECTS_TABLE, TASK
from tests.support.etcd import free_port
from tests.support.helpers import declare_queues, delete_job_queue
from tests.support.procs import ChildProcess, Processes, duetime_argv
from tests.support.wait import wait_for


def parse_ts(text: str) -> float:
    """A log line's ISO timestamp as epoch seconds (comparable with ``time.time()``)."""
    return datetime.fromisoformat(text).timestamp()


@dataclass
class Proc:
    name: str  # the node id
    proc: ChildProcess
    metrics_port: int

    def events(self, *names: str) -> list[dict[str, Any]]:
        out = []
        for line in self.proc.output().splitlines():
            if not line.startswith("{"):
                continue
            try:
                event = json.loads(line)
            except json.JSONDecodeError:  # a line cut by kill -9
                continue
            if not names or event.get("event") in names:
                out.append(event)
        return out

    def leading(self) -> dict[str, int]:
        """Shard -> epoch this process last said it leads, unless it stepped down since."""
        current: dict[str, int] = {}
        for event in self.events("shard_leading", "shard_stepping_down"):
            if event["event"] == "shard_leading":
                current[event["shard"]] = event["epoch"]
            else:
                current.pop(event["shard"], None)
        return current


@dataclass
class ShardReport:
    shard: str
    jobs: int
    succeeded: int
    lost: list[int]  # ids of jobs not succeeded
    doubled: list[int]  # ids of jobs whose effect was applied more than once
    ledger: int
    foreign: int  # effects written to a database that is not this shard's
    missing_effects: int  # succeeded jobs without an effect


@dataclass
class ShardCluster:
    procs: Processes
    base_env: Mapping[str, str]
    server_dsn: str
    etcd_endpoint: str
    prefix: str
    queue: str
    shards: Sequence[str]
    suffix: str
    ttl: float = 2.0
    urls: dict[str, str] = field(default_factory=dict)
    pools: dict[str, asyncpg.Pool] = field(default_factory=dict)
    schedulers: dict[str, Proc] = field(default_factory=dict)
    workers: dict[str, Proc] = field(default_factory=dict)

    @classmethod
    def for_test(
        cls,
        procs: Processes,
        test_env: Mapping[str, str],
        *,
        server_dsn: str,
        etcd_endpoints: str,
        unique: str,
        tag: str,
        shards: Sequence[str],
        ttl: float = 2.0,
    ) -> ShardCluster:
        """A cluster of its own for one test: etcd prefix, queue and databases named
        after the test's ``unique`` token and the module's ``tag``."""
        return cls(
            procs,
            test_env,
            server_dsn=server_dsn,
            etcd_endpoint=etcd_endpoints.split(",")[0],
            prefix=f"duetime-test/{unique}",
            queue=f"{tag}-{unique}",
            shards=shards,
            suffix=f"{tag}{unique[:6]}",
            ttl=ttl,
        )

    def __post_init__(self) -> None:
        self._stack = contextlib.AsyncExitStack()
        host, _, port = self.etcd_endpoint.rpartition(":")
        self._etcd = aetcd.Client(host=host, port=int(port), timeout=1)

    async def __aenter__(self) -> ShardCluster:
        try:
            for name in self.shards:
                url = await self._stack.enter_async_context(
                    own_database(self.server_dsn, f"{self.suffix}_{name}")
                )
                pool = await asyncpg.create_pool(url, min_size=1, max_size=2, timeout=10)
                self._stack.push_async_callback(pool.close)
                await pool.execute(EFFECTS_DDL)
                await declare_queues(pool, self.queue)
                self.urls[name], self.pools[name] = url, pool
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.procs.kill_all()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._etcd.delete_prefix(f"{self.prefix}/".encode()), 2)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._etcd.close(), 2)
        with contextlib.suppress(Exception):
            connection = await aio_pika.connect(self.base_env["DUETIME_AMQP_URL"], timeout=5)
            async with connection:
                channel = await connection.channel()
                await delete_job_queue(channel, self.queue)
        await self._stack.aclose()

    # -- processes -------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in self.base_env.items() if not k.startswith("DUETIME_")}
        env.update(
            DUETIME_AMQP_URL=self.base_env["DUETIME_AMQP_URL"],
            DUETIME_ETCD_ENDPOINTS=self.etcd_endpoint,
            DUETIME_ETCD_PREFIX=self.prefix,
            DUETIME_DATABASE_URL=self.urls[self.shards[0]],
            DUETIME_SHARDS=",".join(f"{n}={u}" for n, u in self.urls.items()),
            DUETIME_LEASE_TTL=str(self.ttl),
            DUETIME_LOG_FORMAT="json",
            DUETIME_LOG_LEVEL="info",
            DUETIME_VISIBILITY_TIMEOUT="10",
            DUETIME_RECONCILE_INTERVAL="2",
        )
        return env

    def spawn_scheduler(self, name: str) -> Proc:
        port = free_port()
        env = {**self.env(), "DUETIME_NODE_ID": name, "DUETIME_METRICS_PORT": str(port)}
        proc = Proc(name, self.procs.spawn(duetime_argv("scheduler"), name=name, env=env), port)
        self.schedulers[name] = proc
        return proc

    def spawn_worker(self, name: str, concurrency: int = 8) -> Proc:
        argv = duetime_argv(
            "worker", "--import", "tests.fixtures_tasks.shards", "--queue", self.queue,
            "--concurrency", str(concurrency),
        )  # fmt: skip
        env = {**self.env(), "DUETIME_NODE_ID": name}
        proc = Proc(name, self.procs.spawn(argv, name=name, env=env), 0)
        self.workers[name] = proc
        return proc

    async def wait_workers(self, timeout: float) -> None:
        def up() -> bool:
            return all(
                w.proc.running() and w.events("worker_started") for w in self.workers.values()
            )

        await wait_for(up, timeout=timeout, message="workers started")

    def describe(self) -> str:
        parts = []
        for p in [*self.schedulers.values(), *self.workers.values()]:
            parts.append(f"--- {p.name} ({p.proc!r})\n{p.proc.tail(25)}")
        return "\n".join(parts)

    # -- views -----------------------------------------------------------------------

    async def holders(self) -> dict[str, tuple[str, int] | None]:
        """Shard -> (node id, epoch) from its election key, or None when unled."""
        out: dict[str, tuple[str, int] | None] = {}
        for name in self.shards:
            key = f"{self.prefix}/shards/{name}/leader".encode()
            kv = await asyncio.wait_for(self._etcd.get(key), 2)
            out[name] = None if kv is None else (bytes(kv.value).decode(), kv.create_revision)
        return out

    async def members(self) -> set[str]:
        start = f"{self.prefix}/members/"
        result = await asyncio.wait_for(self._etcd.get_prefix(start.encode()), 2)
        return {bytes(kv.key).decode()[len(start) :] for kv in result}

    async def fence(self, shard: str) -> asyncpg.Record:
        row = await self.pools[shard].fetchrow(
            "SELECT epoch, leader_node, elected_at FROM duetime.leader_fence WHERE shard = 0"
        )
        assert row is not None
        return row

    async def agreed(self) -> dict[str, tuple[str, int]] | None:
        """Shard -> (node, epoch) when every shard is led by all three views (its key,
        its fence, the holder's own log), else None."""
        holders = await self.holders()
        out: dict[str, tuple[str, int]] = {}
        for shard, holder in holders.items():
            if holder is None or holder[0] not in self.schedulers:
                return None
            fence = await self.fence(shard)
            if (fence["epoch"], fence["leader_node"]) != (holder[1], holder[0]):
                return None
            if self.schedulers[holder[0]].leading().get(shard) != holder[1]:
                return None
            out[shard] = holder
        return out

    async def wait_agreed(self, timeout: float, message: str) -> dict[str, tuple[str, int]]:
        try:
            found = await wait_for(self.agreed, timeout=timeout, interval=0.02, message=message)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.describe()}") from None
        assert found is not None
        return found

    # -- load and the check ------------------------------------------------------------

    async def insert(self, shard: str, count: int, *, over: float, sleep_ms: float = 5) -> None:
        """``count`` jobs into ``shard`` with plain SQL, due evenly over ``over`` seconds."""
        await self.pools[shard].execute(
            "INSERT INTO duetime.jobs (task, payload, due_at, queue) "
            "SELECT $1, jsonb_build_object('sleep_ms', $2::float8), "
            "       now() + make_interval(secs => $3::float8 * g / $4), $5 "
            "FROM generate_series(1, $4) AS g",
            TASK, sleep_ms, over, count, self.queue,
        )  # fmt: skip

    async def wait_done(self, timeout: float) -> None:
        async def done() -> bool:
            for pool in self.pools.values():
                left = await pool.fetchval(
                    "SELECT count(*) FROM duetime.jobs WHERE status NOT IN "
                    "('succeeded', 'dead', 'cancelled')"
                )
                if left:
                    return False
            return True

        try:
            await wait_for(done, timeout=timeout, interval=0.2, message="every job terminal")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{await self.counts()}\n{self.describe()}") from None

    async def counts(self) -> dict[str, dict[str, int]]:
        out = {}
        for shard, pool in self.pools.items():
            rows = await pool.fetch("SELECT status, count(*) AS n FROM duetime.jobs GROUP BY 1")
            out[shard] = {r["status"]: r["n"] for r in rows}
        return out

    async def check(self) -> dict[str, ShardReport]:
        out = {}
        for shard, pool in self.pools.items():
            database = await pool.fetchval("SELECT current_database()")
            jobs = await pool.fetch("SELECT id, status FROM duetime.jobs")
            effects = await pool.fetch(
                f"SELECT job_id, count(*) AS n FROM {EFFECTS_TABLE} GROUP BY job_id"
            )
            per_job = {r["job_id"]: r["n"] for r in effects}
            foreign = await pool.fetchval(
                f"SELECT count(*) FROM {EFFECTS_TABLE} WHERE db <> $1", database
            )
            ledger = await pool.fetchval("SELECT count(*) FROM duetime.job_ledger")
            succeeded = [r["id"] for r in jobs if r["status"] == "succeeded"]
            out[shard] = ShardReport(
                shard=shard,
                jobs=len(jobs),
                succeeded=len(succeeded),
                lost=[r["id"] for r in jobs if r["status"] != "succeeded"],
                doubled=[j for j, n in per_job.items() if n > 1],
                ledger=ledger,
                foreign=foreign,
                missing_effects=sum(1 for j in succeeded if j not in per_job),
            )
        return out

    async def first_dispatch_after(self, shard: str, epoch: int) -> float | None:
        """Epoch seconds of the first claim committed in ``epoch`` in ``shard``."""
        at = await self.pools[shard].fetchval(
            "SELECT min(dispatched_at) FROM duetime.jobs WHERE dispatch_epoch = $1", epoch
        )
        return None if at is None else float(at.timestamp())
