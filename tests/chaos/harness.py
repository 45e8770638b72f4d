"""A duetime cluster under fire: replicas and workers as real processes, optionally
talking to PostgreSQL and RabbitMQ through ``FaultProxy``s, and the faults to apply.

``ChaosCluster`` owns, for one scenario:

- a database of its own (``migrated_dsn``) with the check tables and triggers of
  ``tests/chaos/check.py`` installed before any process starts;
- scheduler replicas, spawned through ``SchedulerCluster`` (``tests/chaos/cluster.py``:
  its leader views, fence audit and log parsing are reused as they are);
- workers (``duetime worker --import tests.chaos.chaos_tasks``), restartable;
- with ``proxy_pg``/``proxy_amqp``, one proxy per *side* (``scheduler``, ``worker``) in
  front of each service, so a scenario can cut one side and not the other. The test's
  own connections and the handler's delivery recorder always go straight to PostgreSQL:
  the observer is never part of the fault.

Every fault is appended to ``faults`` (what, when) and every provoked leader change to
``failovers`` (seconds until a new leader leads by all views). ``__aexit__`` kills every
process and stops every proxy, whatever happened.

Settings given to every process, and why: TTL 2 s (fast failovers); visibility timeout
10 s and reconcile interval 2 s, so a job whose message really is gone is re-published
within the test's bounds (a re-publish of a live message is absorbed by the ledger).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

import asyncpg

from tests.chaos.chaos_tasks import RECORD_DSN_ENV, TASK
from tests.chaos.check import SETUP_SQL, TERMINAL, Report, verify
from tests.chaos.cluster import Node, SchedulerCluster
from tests.support.helpers import declare_queues
from tests.support.procs import ChildProcess, Processes, duetime_argv
from tests.support.proxy import FaultProxy
from tests.support.wait import wait_for

TTL = 2.0
#: wait_settled's "nothing moves": longer than the visibility timeout (10 s) plus the
#: reconcile interval (2 s), so a limbo job that would be rescued has been
STALL = 15.0
START_TIMEOUT = 30.0  # five Python processes importing grpc/aio-pika on a 2-core box
SIDES = ("scheduler", "worker")
SERVICES = ("pg", "amqp")
SKIP_EVENTS = ("delivery_skipped", "delivery_duplicate")


def _json_lines(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by kill -9
                continue
    return out


@dataclass
class WorkerProc:
    name: str
    proc: ChildProcess
    starts: int = 1

    def up(self) -> bool:
        started = sum(
            1 for e in _json_lines(self.proc.output()) if e.get("event") == "worker_started"
        )
        return self.proc.running() and started >= self.starts


@dataclass
class Plan:
    """The load of one run: ``jobs`` due over ``window`` seconds from insertion, a share
    ``burst`` of them due at once (a storm), each sleeping ``sleep_ms`` (a range) in its
    handler, a share ``fail_share`` failing their first attempt on purpose."""

    jobs: int
    window: float
    burst: float = 0.0
    sleep_ms: tuple[float, float] = (0.0, 20.0)
    fail_share: float = 0.02


@dataclass
class ChaosCluster:
    scenario: str
    seed: int
    soak: bool
    tmp_path: Path
    base_env: Mapping[str, str]
    dsn: str
    amqp_url: str
    etcd_endpoint: str
    prefix: str
    queue: str
    rng: random.Random
    proxy_pg: bool = False
    proxy_amqp: bool = False
    ttl: float = TTL
    concurrency: int = 16  # x2 workers: PostgreSQL max_connections (100) is shared
    failovers: list[float] = field(default_factory=list)
    faults: list[str] = field(default_factory=list)
    workers: dict[str, WorkerProc] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.procs = Processes(self.tmp_path)
        self.proxies: dict[tuple[str, str], FaultProxy] = {}
        self.pool: asyncpg.Pool | None = None
        self.replicas: SchedulerCluster | None = None
        self._started = time.monotonic()
        self.due_by = self._started  # monotonic time the last inserted job is due
        self.late_s = 0.0  # seconds past wait_settled's timeout the jobs took to settle

    # -- lifecycle -------------------------------------------------------------------

    async def __aenter__(self) -> ChaosCluster:
        try:
            self.pool = await asyncpg.create_pool(self.dsn, min_size=1, max_size=3, timeout=10)
            await self.pool.execute(SETUP_SQL)
            await declare_queues(self.pool, self.queue)
            for side in SIDES:
                if self.proxy_pg:
                    self.proxies[(side, "pg")] = await self._proxy(self.dsn)
                if self.proxy_amqp:
                    self.proxies[(side, "amqp")] = await self._proxy(self.amqp_url)
            self.replicas = SchedulerCluster(
                self.procs,
                self._env("scheduler"),
                dsn=self.dsn,
                etcd_endpoint=self.etcd_endpoint,
                prefix=self.prefix,
                ttl=self.ttl,
            )
            await self.replicas.__aenter__()
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.procs.kill_all()
        try:
            if self.replicas is not None:
                await self.replicas.__aexit__(exc_type, exc, tb)
        finally:
            for proxy in self.proxies.values():
                await proxy.stop()
            if self.pool is not None:
                self.pool.terminate()

    async def _proxy(self, url: str) -> FaultProxy:
        parts = urlsplit(url)
        return await FaultProxy(parts.hostname or "127.0.0.1", parts.port or 0).start()

    def _env(self, side: str) -> dict[str, str]:
        env = {k: v for k, v in self.base_env.items() if not k.startswith("DUETIME_")}
        env.update(
            DUETIME_DATABASE_URL=self._url(side, "pg", self.dsn),
            DUETIME_AMQP_URL=self._url(side, "amqp", self.amqp_url),
            DUETIME_ETCD_ENDPOINTS=self.etcd_endpoint,
            DUETIME_ETCD_PREFIX=self.prefix,
            DUETIME_LEASE_TTL=str(self.ttl),
            DUETIME_LOG_FORMAT="json",
            DUETIME_LOG_LEVEL="info",
            DUETIME_VISIBILITY_TIMEOUT="10",
            DUETIME_RECONCILE_INTERVAL="2",
        )
        env[RECORD_DSN_ENV] = self.dsn
        return env

    def _url(self, side: str, service: str, url: str) -> str:
        proxy = self.proxies.get((side, service))
        return proxy.route(url) if proxy is not None else url

    @property
    def cluster(self) -> SchedulerCluster:
        assert self.replicas is not None, "not entered"
        return self.replicas

    @property
    def db(self) -> asyncpg.Pool:
        assert self.pool is not None, "not entered"
        return self.pool

    def elapsed(self) -> float:
        return time.monotonic() - self._started

    def note(self, fault: str) -> None:
        self.faults.append(f"t+{self.elapsed():.1f}s {fault}")

    # -- processes -------------------------------------------------------------------

    def spawn_replicas(self, count: int) -> list[Node]:
        # the side's database URL overrides the direct one SchedulerCluster sets
        url = self._url("scheduler", "pg", self.dsn)
        return [
            self.cluster.spawn(f"{self.scenario}-r{i}", DUETIME_DATABASE_URL=url)
            for i in range(1, count + 1)
        ]

    def spawn_workers(self, count: int) -> list[WorkerProc]:
        out = []
        for i in range(1, count + 1):
            name = f"{self.scenario}-w{i}"
            argv = duetime_argv(
                "worker",
                "--import",
                "tests.chaos.chaos_tasks",
                "--queue",
                self.queue,
                "--concurrency",
                str(self.concurrency),
                "--grace-period",
                "5",
            )
            env = {**self._env("worker"), "DUETIME_NODE_ID": name}
            worker = WorkerProc(name, self.procs.spawn(argv, name=name, env=env))
            self.workers[name] = worker
            out.append(worker)
        return out

    async def wait_ready(self, timeout: float = START_TIMEOUT) -> tuple[Node, int]:
        """A leader leads, every replica campaigns, every worker consumes."""
        leader = await self.cluster.wait_leader(timeout)
        await self.cluster.wait_all_up(timeout)
        await self.wait_workers(timeout)
        return leader

    async def wait_workers(self, timeout: float = START_TIMEOUT) -> None:
        def up() -> bool:
            return all(w.up() for w in self.workers.values())

        try:
            await wait_for(up, timeout=timeout, message="every worker consuming")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.describe()}") from None

    # -- load ------------------------------------------------------------------------

    async def insert_jobs(self, plan: Plan) -> int:
        """Insert ``plan.jobs`` jobs (one statement, due times on the database clock)."""
        delays, payloads = [], []
        for _ in range(plan.jobs):
            burst = self.rng.random() < plan.burst
            delays.append(0.0 if burst else self.rng.uniform(0.0, plan.window))
            payload: dict[str, Any] = {"sleep_ms": round(self.rng.uniform(*plan.sleep_ms), 1)}
            if self.rng.random() < plan.fail_share:
                payload["fail_attempts"] = 1
            payloads.append(json.dumps(payload))
        await self.db.execute(
            "INSERT INTO duetime.jobs (task, queue, payload, due_at) "
            "SELECT $1, $2, p::jsonb, now() + make_interval(secs => d) "
            "FROM unnest($3::float8[], $4::text[]) AS t(d, p)",
            TASK,
            self.queue,
            delays,
            payloads,
            timeout=60,
        )
        self.due_by = max(self.due_by, time.monotonic() + plan.window)
        return plan.jobs

    async def settled(self) -> int:
        """How many of our jobs are not terminal yet."""
        return int(
            await self.db.fetchval(
                "SELECT count(*) FROM duetime.jobs WHERE task = $1 AND status <> ALL($2::text[])",
                TASK,
                list(TERMINAL),
            )
        )

    async def wait_settled(self, timeout: float, grace: float = 0.0) -> bool:
        """Wait until every job is terminal; False (not an error) if it gives up:
        ``report()`` then names the jobs that are not.

        ``timeout`` is what the run is given. Past it, up to ``grace`` seconds more while
        the backlog still shrinks: a machine slower than the run was sized for drains
        late, while a lost job never moves, so it gives up once ``STALL`` seconds pass
        without a job settling (or at ``timeout + grace``). The seconds past ``timeout``
        are reported (``late_s``), so a run that needed them says so."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline, hard = start + timeout, start + timeout + grace
        left, moved = await self.settled(), start
        while left:
            now = loop.time()
            if now >= hard or (now >= deadline and now - moved >= STALL):
                self.late_s = max(0.0, now - deadline)
                return False
            await asyncio.sleep(0.25)
            now_left = await self.settled()
            if now_left < left:
                moved = loop.time()
            left = now_left
        self.late_s = max(0.0, loop.time() - deadline)
        return True

    # -- faults ----------------------------------------------------------------------

    async def kill_leader(self) -> float:
        """kill -9 the leader (standbys ready first), measure the failover, restart it
        as a standby. Returns the seconds until a new leader leads by all views."""
        await self.cluster.wait_all_up(START_TIMEOUT)
        leader, epoch = await self.cluster.wait_leader(START_TIMEOUT)
        started = time.monotonic()
        leader.proc.kill9()
        self.note(f"kill -9 leader {leader.name} (epoch {epoch})")
        _, new_epoch = await self.cluster.wait_leader(
            self.ttl + 5, exclude=[leader.name], message=f"a leader after killing {leader.name}"
        )
        took = time.monotonic() - started
        assert new_epoch > epoch
        self.failovers.append(took)
        leader.proc.kill()  # reap it, then back as a standby
        self.cluster.restart(leader)
        return took

    async def kill_worker(self) -> str:
        """kill -9 a random worker (all up first, so it is busy) and restart it."""
        await self.wait_workers()
        worker = self.rng.choice(sorted(self.workers.values(), key=lambda w: w.name))
        worker.proc.kill9()
        self.note(f"kill -9 worker {worker.name}")
        worker.proc.kill()
        worker.proc.start()
        worker.starts += 1
        return worker.name

    async def outage(self, sides: tuple[str, ...], service: str, seconds: float) -> None:
        """Cut every connection of ``sides`` to ``service`` and refuse new ones for
        ``seconds`` (the length of the outage is the scenario), then heal."""
        proxies = [self.proxies[(side, service)] for side in sides]
        for proxy in proxies:
            proxy.refuse(True)
        cut = sum(proxy.cut() for proxy in proxies)
        self.note(f"{service} outage {'+'.join(sides)} {seconds:.1f}s ({cut} connections cut)")
        try:
            await asyncio.sleep(seconds)
        finally:
            for proxy in proxies:
                proxy.heal()

    # -- verdict ---------------------------------------------------------------------

    def skipped_deliveries(self) -> int:
        return sum(
            1
            for w in self.workers.values()
            for e in _json_lines(w.proc.output())
            if e.get("event") in SKIP_EVENTS
        )

    async def report(self) -> Report:
        report = Report(self.scenario, self.seed, self.soak)
        report.failovers = [round(f, 3) for f in self.failovers]
        report.faults = list(self.faults)
        report.skipped_deliveries = self.skipped_deliveries()
        # one snapshot: the workers may still be settling jobs while the report reads
        # (a run judged before it settled), and counts taken at different instants
        # would disagree with each other (ledger rows vs succeeded jobs)
        async with (
            self.db.acquire() as conn,
            conn.transaction(isolation="repeatable_read", readonly=True),
        ):
            await verify(conn, report)
        report.duration_s = round(self.elapsed(), 1)
        report.late_s = round(self.late_s, 1)
        return report

    def describe(self) -> str:
        parts = [self.cluster.describe()]
        for w in self.workers.values():
            parts.append(f"--- {w.name} ({w.proc!r})\n{w.proc.tail(25)}")
        parts.append(f"logs: {self.tmp_path}")
        return "\n".join(parts)


RESULTS = Path(__file__).with_name("results.jsonl")  # soak figures, one JSON line per run
