"""``shards``: dispatch throughput with K shards and R ``duetime scheduler`` processes.

K shard databases (``duetime_bench_shards_<hex>_s<i>``, migrated) on the local server,
created once and reused, emptied between runs. For every (K, R):

1. start R ``duetime scheduler`` processes with ``DUETIME_SHARDS`` naming the first K
   databases, a fresh etcd prefix and a fresh queue; wait until every shard's key
   ``<prefix>/shards/<name>/leader`` is held, nobody holds more than ⌈K/R⌉, all R
   member keys are there, each shard's fence carries its key's epoch, and nothing
   moved for ``settle`` seconds (so no hand-over happens during the measurement);
2. insert N/K due jobs into each shard with one server-side ``INSERT … SELECT``, all
   due at one instant T0 a few seconds ahead (database clock), then ``ANALYZE``;
3. from T0, poll every shard's count of ``dispatched`` rows until all N are; nobody
   consumes (the dispatch path alone: claim, publish with confirms, mark, commit);
4. stop the replicas (SIGTERM), purge and delete the queue, delete the etcd prefix.

Reported per run: jobs/s = N / (last ``dispatched_at`` − T0), the same over the middle
80 % of the jobs (``mid_jobs_per_s``: without the wake-up at T0 and the slowest
shard's tail), per-shard rates, and the CPU of the scheduler processes, of PostgreSQL
(all its processes), RabbitMQ and etcd, and the machine's busy cores over the window
(``bench.cpu``), and the jobs per CPU second of that stack (``jobs_per_stack_core_s``:
on a shared machine, what other programs take moves it less than the rate). The ratio
to K = 1 is taken for the same R in the same run.

Baselines, measured first in the same run on the same databases: the raw PostgreSQL
claim rate (``claim_only``: the dispatcher's fenced claim + mark statements, committed,
nothing published, ``bench.dispatch_rate.bench_claim_only``) on one shard and on K
shards at once (one loop per shard in this process), and the broker's confirmed
publish rate (``publish_only``).

With a tree whose ``duetime scheduler`` cannot lead shards, K = 1 runs unsharded (the
single replica on the one database) and K > 1 is reported as skipped. With
``single_reference`` the unsharded K = 1 run is added beside the sharded one: the cost
of the sharded path itself. ``rounds`` repeats the whole sequence; each ratio is taken
against K = 1 of its own round, and ``summary`` gives the medians and ranges over the
rounds (on a shared machine what other programs take changes from minute to minute).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import math
import os
import statistics
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aetcd
import aio_pika
import asyncpg

from bench.cpu import CpuMeter
from bench.dispatch_rate import EPOCH, bench_claim_only, bench_publish_only, purge
from bench.harness import REPO, Services, with_database
from bench.report import load_average, now_iso, ratio
from scheduler import broker, db
from scheduler.config import load_settings
from scheduler.config.shards import member_key, shard_key
from scheduler.migrate import migrate
from scheduler.status import election_key
from scheduler.store.fence import FenceStore
from scheduler.store.queues import QueueStore
from tests.support.procs import Processes, duetime_argv

INSERT_AT = (
    "INSERT INTO duetime.jobs (task, payload, due_at, queue) "
    "SELECT 'bench.task', jsonb_build_object('i', i), $3::timestamptz, $1::text "
    "  FROM generate_series(1, $2::int) AS i"
)
SHARDED_MODULES = ("scheduler.leadership.elector",)
COUNT_DISPATCHED = "SELECT count(*) FROM duetime.jobs WHERE status = 'dispatched'"
DISPATCH_TIMES = (
    "SELECT extract(epoch FROM dispatched_at - $1::timestamptz)::float8 AS t"
    "  FROM duetime.jobs WHERE status = 'dispatched' ORDER BY 1"
)
POLL = 0.1


def sharded_scheduler_available() -> bool:
    """Whether this tree's ``duetime scheduler`` leads shards (``DUETIME_SHARDS``)."""
    return any(importlib.util.find_spec(m) is not None for m in SHARDED_MODULES)


@dataclass(frozen=True)
class ShardsParams:
    shards: tuple[int, ...] = (1, 2, 4)
    replicas: tuple[int, ...] = (2,)
    jobs: int = 40_000  # per run, split evenly over the K shards
    batch: int = 500  # the claim baseline's batch (the dispatcher's default)
    lease_ttl: float = 5.0
    start_in: float = 3.0  # T0: this long after the insert begins
    settle: float = 1.5  # assignment unchanged this long before inserting
    ready_timeout: float = 60.0
    single_reference: bool = True
    rounds: int = 1  # the whole sequence repeated; ratios taken within a round

    @classmethod
    def quick(cls) -> ShardsParams:
        return cls(shards=(1, 2), replicas=(2,), jobs=2000, single_reference=False)


class ShardBench:
    """The shard databases and everything one run starts; cleaned up on exit."""

    def __init__(self, services: Services, count: int) -> None:
        self.services = services
        self.token = uuid.uuid4().hex[:8]
        self.names = [f"s{i}" for i in range(count)]
        self.urls = {
            n: with_database(services.server_url, f"duetime_bench_shards_{self.token}_{n}")
            for n in self.names
        }
        self.pools: dict[str, asyncpg.Pool] = {}
        self.log_dir = Path(tempfile.mkdtemp(prefix="duetime-bench-shards-"))
        host, _, port = services.etcd_endpoints.split(",")[0].rpartition(":")
        self.etcd = aetcd.Client(host=host, port=int(port), timeout=5)

    async def __aenter__(self) -> ShardBench:
        try:
            for name, url in self.urls.items():
                admin = await asyncpg.connect(self.services.server_url, timeout=10)
                try:
                    await admin.execute(f'CREATE DATABASE "{url.rsplit("/", 1)[1]}"')
                finally:
                    await admin.close()
                await migrate(url)
                self.pools[name] = await db.create_pool(url, min_size=1, max_size=2, timeout=30)
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        for pool in self.pools.values():
            await pool.close()
        admin = await asyncpg.connect(self.services.server_url, timeout=10)
        try:
            for url in self.urls.values():
                name = url.rsplit("/", 1)[1]
                await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()
        with contextlib.suppress(Exception):
            await self.etcd.close()

    # -- baselines ---------------------------------------------------------------------

    async def claim_only(self, k: int, n: int, batch: int) -> dict[str, Any]:
        """The fenced claim + mark on K shards at once, N/K rows each (EPOCH fences)."""
        names = self.names[:k]
        for name in names:
            await FenceStore(self.pools[name]).advance(EPOCH, "bench")
        queue = f"bench-claim-{self.token}"
        for name in names:
            await QueueStore(self.pools[name]).add(queue)  # only declared queues are claimed
        started = time.perf_counter()
        parts = await asyncio.gather(
            *(bench_claim_only(self.pools[s], queue, n // k, batch) for s in names)
        )
        elapsed = time.perf_counter() - started
        rows = sum(p["rows"] for p in parts)
        for name in names:
            await self.pools[name].execute("TRUNCATE duetime.jobs")
        return {"shards": k, "rows": rows, "seconds": round(elapsed, 3),
                "rows_per_s": round(rows / elapsed)}  # fmt: skip

    async def publish_only(self, n: int, batch: int) -> dict[str, Any]:
        queue = f"bench-publish-{self.token}"
        settings = load_settings(
            env={}, overrides={"database_url": self.urls[self.names[0]],
                               "amqp_url": self.services.amqp_url, "node_id": "bench"},
        )  # fmt: skip
        try:
            return await bench_publish_only(settings, queue, n, batch)
        finally:
            await delete_queue(self.services.amqp_url, queue)

    # -- one run -----------------------------------------------------------------------

    def env(
        self, names: list[str], prefix: str, node: str, ttl: float, sharded: bool
    ) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DUETIME_")}
        env.update(
            DUETIME_DATABASE_URL=self.urls[names[0]],
            DUETIME_AMQP_URL=self.services.amqp_url,
            DUETIME_ETCD_ENDPOINTS=self.services.etcd_endpoints,
            DUETIME_ETCD_PREFIX=prefix,
            DUETIME_NODE_ID=node,
            DUETIME_LEASE_TTL=str(ttl),
            DUETIME_LOG_FORMAT="json",
            DUETIME_LOG_LEVEL="warning",
            # nobody consumes and the rate is a raw limit: no bound on the broker's buffer
            DUETIME_DISPATCH_BUFFER=str(10**9),
        )
        if sharded:
            env["DUETIME_SHARDS"] = ",".join(f"{n}={self.urls[n]}" for n in names)
        return env

    async def fences(self, names: list[str]) -> dict[str, int]:
        return {n: int(await self.pools[n].fetchval(
            "SELECT epoch FROM duetime.leader_fence WHERE shard = 0")) for n in names}  # fmt: skip

    async def holders(
        self, prefix: str, names: list[str], sharded: bool
    ) -> tuple[dict[str, tuple[str, int]], set[str]]:
        """shard -> (node, epoch) of the keys held, and the member nodes."""
        if not sharded:
            kv = await self.etcd.get(election_key(prefix).encode())
            held = {names[0]: (bytes(kv.value).decode(), kv.create_revision)} if kv else {}
            return held, set()
        held = {}
        for name in names:
            kv = await self.etcd.get(shard_key(prefix, name).encode())
            if kv is not None:
                held[name] = (bytes(kv.value).decode(), kv.create_revision)
        start = member_key(prefix, "").encode()
        members = {
            bytes(kv.key)[len(start):].decode()
            for kv in await self.etcd.get_prefix(start)
        }  # fmt: skip
        return held, members

    async def wait_led(
        self, prefix: str, names: list[str], r: int, sharded: bool, p: ShardsParams,
        procs: Processes,
    ) -> dict[str, tuple[str, int]]:  # fmt: skip
        """Every shard led and fenced, balanced, unchanged for ``settle`` seconds."""
        deadline = time.monotonic() + p.ready_timeout
        last: dict[str, tuple[str, int]] | None = None
        since = time.monotonic()
        while time.monotonic() < deadline:
            for child in procs:
                if not child.running():
                    raise RuntimeError(f"{child.name} exited:\n{child.tail()}")
            held, members = await self.holders(prefix, names, sharded)
            fences = await self.fences(names)
            counts = [sum(1 for node, _ in held.values() if node == m) for m in members]
            balanced = len(members) == r and max(counts) <= math.ceil(len(names) / r)
            ok = (
                len(held) == len(names)
                and all(fences[s] == epoch for s, (_, epoch) in held.items())
                and (not sharded or balanced)
            )
            if not ok or held != last:
                last, since = (held if ok else None), time.monotonic()
            elif time.monotonic() - since >= p.settle:
                return held
            await asyncio.sleep(POLL)
        raise TimeoutError(f"shards not led and balanced within {p.ready_timeout}s: {last}")

    async def run_one(self, k: int, r: int, sharded: bool, p: ShardsParams) -> dict[str, Any]:
        names = self.names[:k]
        tag = f"k{k}r{r}{'' if sharded else 'single'}-{self.token}"
        prefix, queue = f"duetime-bench/shards-{tag}", f"bench-shards-{tag}"
        for name in names:
            await self.pools[name].execute("TRUNCATE duetime.jobs")
            await QueueStore(self.pools[name]).add(queue)  # only declared queues dispatch
        per_shard = p.jobs // k
        n = per_shard * k
        procs = Processes(self.log_dir)
        load_start = load_average()
        try:
            for i in range(r):
                node = f"bench-shards-r{i}"
                env = self.env(names, prefix, node, p.lease_ttl, sharded)
                procs.spawn(duetime_argv("scheduler"), name=f"{tag}-{node}", env=env, cwd=REPO)
            held = await self.wait_led(prefix, names, r, sharded, p, procs)
            t0 = await self.pools[names[0]].fetchval(
                "SELECT now() + make_interval(secs => $1)", p.start_in
            )
            await asyncio.gather(*(self.pools[s].execute(INSERT_AT, queue, per_shard, t0)
                                   for s in names))  # fmt: skip
            await asyncio.gather(*(self.pools[s].execute("ANALYZE duetime.jobs") for s in names))
            meter = CpuMeter({"schedulers": [c.pid for c in procs]})
            wait = t0.timestamp() - time.time()
            if wait > 0:
                await asyncio.sleep(wait)
            meter.start()
            deadline = time.monotonic() + max(120.0, n / 200)
            done = 0
            while time.monotonic() < deadline:
                counts = await asyncio.gather(*(
                    self.pools[s].fetchval(COUNT_DISPATCHED) for s in names
                ))  # fmt: skip
                done = sum(counts)
                if done >= n:
                    break
                await asyncio.sleep(POLL)
            cpu = meter.stop()
            times = {
                s: [row["t"] for row in await self.pools[s].fetch(DISPATCH_TIMES, t0)]
                for s in names
            }
        finally:
            await procs.stop_all(timeout=15)
            procs.kill_all()
            await delete_queue(self.services.amqp_url, queue)
            with contextlib.suppress(Exception):
                await self.etcd.delete_prefix(f"{prefix}/".encode())
        every = sorted(t for ts in times.values() for t in ts)
        last = every[-1] if every else None
        lo, hi = (every[len(every) // 10], every[len(every) * 9 // 10 - 1]) if every else (0, 0)
        return {
            "shards": k,
            "replicas": r,
            "mode": "sharded" if sharded else "single",
            "jobs": n,
            "dispatched": done,
            "complete": done >= n,
            "seconds": round(last, 3) if last else None,
            "jobs_per_s": round(n / last) if last else None,
            "mid_jobs_per_s": round(0.8 * len(every) / (hi - lo)) if hi > lo else None,
            "first_dispatch_s": round(every[0], 3) if every else None,
            "per_shard": {s: _shard_figures(ts) for s, ts in times.items()},
            "leaders": {s: node for s, (node, _) in held.items()},
            "cpu": cpu,
            "jobs_per_stack_core_s": _per_stack_core(n / last if last else None, cpu),
            "saturation": saturation(cpu, r),
            "load_avg_start": load_start,
            "load_avg_end": load_average(),
        }


def _shard_figures(times: list[float]) -> dict[str, float | None]:
    """One shard's rate, last and median dispatch (seconds after T0)."""
    if not times:
        return {"jobs_per_s": None, "last_s": None, "p50_s": None}
    return {
        "jobs_per_s": round(len(times) / times[-1]) if times[-1] > 0 else None,
        "last_s": round(times[-1], 3),
        "p50_s": round(statistics.median(times), 3),
    }


def _per_stack_core(rate: float | None, cpu: dict[str, float]) -> int | None:
    """Jobs per CPU second of the schedulers, PostgreSQL, RabbitMQ and etcd together: a
    figure other programs on a shared machine disturb less than the rate itself."""
    stack = sum(cpu.get(f"{g}_cores", 0.0) for g in ("schedulers", "postgres", "rabbitmq", "etcd"))
    return round(rate / stack) if rate and stack > 0 else None


def saturation(cpu: dict[str, float], r: int) -> str:
    """Which CPU ran out over the window, by the numbers in ``cpu``."""
    cores = cpu.get("machine_cores") or 1.0
    groups = {g: cpu.get(f"{g}_cores", 0.0) for g in ("schedulers", "postgres", "rabbitmq", "etcd")}
    top = max(groups, key=lambda g: groups[g])
    if cpu.get("machine_busy_cores", 0.0) >= 0.9 * cores:
        return (
            f"machine CPU ({cpu['machine_busy_cores']:g} of {cores:g} cores busy; most: {top}, "
            f"other programs: {cpu.get('others_cores', 0.0):g})"
        )
    if cpu.get("schedulers_max_process_cores", 0.0) >= 0.9:
        return "one scheduler process's CPU (an event loop at ~1 core)"
    busy = cpu.get("machine_busy_cores", 0.0)
    return f"no CPU limit reached ({busy:g} of {cores:g} cores busy): waiting on I/O"


async def delete_queue(url: str, queue: str) -> None:
    with contextlib.suppress(Exception):
        await purge(url, queue)
        connection = await aio_pika.connect(url, timeout=10)
        async with connection:
            channel = await connection.channel()
            for name in broker.job_queue_names(queue):
                await channel.queue_delete(name)


def _ratios(
    runs: list[dict[str, Any]], claim: list[dict[str, Any]], publish: dict[str, Any], mode: str
) -> None:
    """Each run of ``mode`` against K = 1 of the same R, and against the baselines."""
    claim_by_k = {c["shards"]: c["rows_per_s"] for c in claim}
    for row in (x for x in runs if x["mode"] == mode):
        same_r = [x for x in runs if x["replicas"] == row["replicas"] and x["shards"] == 1
                  and x["round"] == row["round"]]  # fmt: skip
        ref = next((x for x in same_r if x["mode"] == mode), None)
        single = next((x for x in same_r if x["mode"] == "single"), None)
        for key, field in (("ratio_to_k1", "jobs_per_s"), ("mid_ratio_to_k1", "mid_jobs_per_s")):
            row[key] = ratio(row[field], ref[field] if ref else None)
        row["ratio_to_claim_only_k1"] = ratio(row["jobs_per_s"], claim_by_k.get(1))
        row["ratio_to_claim_only_same_k"] = ratio(row["jobs_per_s"], claim_by_k.get(row["shards"]))
        row["ratio_to_publish_only"] = ratio(row["jobs_per_s"], publish["msgs_per_s"])
        if mode == "sharded" and row["shards"] == 1 and single is not None:
            row["ratio_to_unsharded_k1"] = ratio(row["jobs_per_s"], single["jobs_per_s"])


def _summary(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (mode, R, K) over the rounds: median rate and ratio, and their range."""
    out = []
    keys = sorted({(x["mode"], x["replicas"], x["shards"]) for x in runs})
    for mode, r, k in keys:
        rows = [x for x in runs if (x["mode"], x["replicas"], x["shards"]) == (mode, r, k)]
        rates = [x["jobs_per_s"] for x in rows if x["jobs_per_s"]]
        ratios = [x["ratio_to_k1"] for x in rows if x.get("ratio_to_k1")]
        per_core = [x["jobs_per_stack_core_s"] for x in rows if x.get("jobs_per_stack_core_s")]
        others = [x["cpu"].get("others_cores", 0.0) for x in rows]
        out.append({
            "mode": mode, "replicas": r, "shards": k, "rounds": len(rows),
            "jobs_per_s_median": round(statistics.median(rates)) if rates else None,
            "jobs_per_s_range": [min(rates), max(rates)] if rates else None,
            "ratio_to_k1_median": round(statistics.median(ratios), 3) if ratios else None,
            "ratio_to_k1_range": [min(ratios), max(ratios)] if ratios else None,
            "jobs_per_stack_core_s_median":
                round(statistics.median(per_core)) if per_core else None,
            "others_cores_median": round(statistics.median(others), 3) if others else None,
        })  # fmt: skip
    return out


async def run(services: Services, params: ShardsParams) -> dict[str, Any]:
    load_start = load_average()
    sharded = sharded_scheduler_available()
    result: dict[str, Any] = {
        "scenario": "shards",
        "started_at": now_iso(),
        "params": asdict(params),
        "sharded_scheduler": sharded,
    }
    runs: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    async with ShardBench(services, max(params.shards)) as bench:
        claim = [await bench.claim_only(k, params.jobs, params.batch) for k in params.shards]
        publish = await bench.publish_only(params.jobs, params.batch)
        for round_no in range(params.rounds):
            for r in params.replicas:
                if params.single_reference and sharded and 1 in params.shards:
                    runs.append({"round": round_no, **await bench.run_one(1, r, False, params)})
                for k in params.shards:
                    if k > 1 and not sharded:
                        why = "this tree's duetime scheduler cannot lead shards"
                        skipped.append({"shards": k, "replicas": r, "why": why})
                        continue
                    runs.append({"round": round_no, **await bench.run_one(k, r, sharded, params)})
    _ratios(runs, claim, publish, "sharded" if sharded else "single")
    result.update(
        claim_only=claim,
        publish_only=publish,
        runs=runs,
        summary=_summary(runs),
        skipped=skipped,
        load_avg_start=load_start,
        load_avg_end=load_average(),
        targets={"complete": bool(runs) and all(r["complete"] for r in runs)},
    )
    return result
