"""One demo run, start to finish (``duetime demo``).

1. Check etcd and RabbitMQ answer (else say how to start them: ``make services``).
2. Drop and re-create the demo database, migrate it, create ``demo_effects``, declare
   the run's queue (``duetime queues add``: only declared queues are dispatched).
3. Start ``--replicas`` ``duetime scheduler`` and ``--workers`` ``duetime worker``
   children (logs under ``--log-dir``), with an etcd prefix and a queue unique to this
   run, and a short lease TTL so the failover is quick to watch; wait until a leader
   has fenced the database and every worker consumes. ``duetime dashboard`` runs
   beside them on 127.0.0.1:8089 (a free port when that one is taken); the plan
   printed first says where.
4. Add two cron schedules (every 2 s and every 5 s, seconds-first cron) and publish
   ``--jobs`` one-shot jobs due evenly over ``--duration`` seconds (one COPY).
5. Watch: progress from the database, replica/worker states from their JSON logs. Half
   way, SIGKILL the leader; time the new leader's fence and first dispatch; restart the
   killed replica as a standby.
6. When every job finished (or ``--duration`` + ``--grace`` passed), judge from the
   effects table (``summary.judge``), stop every child (SIGTERM, then SIGKILL), delete
   the run's RabbitMQ queues, print the summary. Exit 0 only when nothing was lost and
   nothing was applied twice.

Ctrl-C or SIGTERM at any point stops the children the same way and exits 130.

The steps stay in one module, in this order, because they share one run's state
(children, pool, events, the failover's timings): split, one run would have to be
followed across files. What stands alone lives beside it: the child processes
(``children``), the numbers (``config``), the verdict (``summary``) and the screen
(``view``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import socket
import sys
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from pathlib import Path

import asyncpg

from demo.children import Child, Children
from demo.config import (
    CHILD_SETTINGS,
    DASHBOARD_LISTEN,
    DEMO_SCHEDULES,
    LEAD_IN,
    MAX_RESTARTS,
    RESTART_DELAY,
    STOP_TIMEOUT,
    DemoConfig,
    duetime_argv,
)
from demo.rows import Progress
from demo.store import DemoStore, recreate_database
from demo.summary import Failover, Summary, judge, render
from demo.tasks import CRON_TASK, JOB_TASK
from demo.view import LiveView, PlainView, ProcessLine, Snapshot, View, fmt_seconds
from scheduler import broker, db
from scheduler.config import Settings, redact_url
from scheduler.errors import ServiceUnavailable
from scheduler.jobspec import JobSpec
from scheduler.migrate import migrate
from scheduler.status import read_election_key
from scheduler.store.jobs import JobStore
from scheduler.store.queues import QueueStore


async def run_demo(settings: Settings, cfg: DemoConfig) -> int:
    """Run the demo; Ctrl-C / SIGTERM stop it cleanly (exit 130)."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    received: list[signal.Signals] = []

    def on_signal(sig: signal.Signals) -> None:
        received.append(sig)
        task.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        return await Demo(settings, cfg).run()
    except asyncio.CancelledError:
        if not received:
            raise
        print(
            f"\nduetime demo: stopped by {received[0].name}; no child left running",
            file=sys.stderr,
            flush=True,
        )
        return 130
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


@dataclass
class _Watch:
    """What the run learned so far (mutated by the watch loop)."""

    states: dict[str, str] = field(default_factory=dict)
    down_since: dict[str, float] = field(default_factory=dict)  # crashed, not restarted yet
    restarts: dict[str, int] = field(default_factory=dict)
    leader_duties: list[str] | None = None
    failover: Failover | None = None
    kill_at: datetime | None = None
    killed: Child | None = None
    events: list[tuple[float, str]] = field(default_factory=list)
    cron_noted: bool = False


class Demo:
    def __init__(self, settings: Settings, cfg: DemoConfig) -> None:
        self.settings = settings
        self.cfg = cfg
        self.run_id = secrets.token_hex(3)
        self.queue = f"demo-{self.run_id}"
        self.prefix = f"duetime-demo/{self.run_id}"
        self.log_dir = cfg.log_dir
        self.children = Children(cfg.log_dir)
        self.watch = _Watch()
        self.t0 = 0.0  # monotonic time the first job is due
        self.view: View = PlainView(cfg.lease_ttl)
        self.schedules_added = 0
        self.dashboard_url: str | None = None

    # -- the run -----------------------------------------------------------------------

    async def run(self) -> int:
        await self._check_services()
        try:
            url = await recreate_database(
                self.settings.database_url, self.cfg.database_name, timeout=self.settings.db_timeout
            )
        except asyncpg.PostgresError as exc:
            raise ServiceUnavailable(
                f"cannot re-create database {self.cfg.database_name}: {exc}"
            ) from None
        await migrate(url, timeout=self.settings.db_timeout)
        pool = await db.create_pool(
            url, max_size=4, timeout=self.settings.db_timeout, application_name="duetime-demo"
        )
        self.store = DemoStore(pool, queue=self.queue, job_task=JOB_TASK)
        await self.store.create_effects_table()
        await QueueStore(pool).add(self.queue)  # only declared queues are dispatched
        self.log_dir.mkdir(parents=True, exist_ok=True)
        listen = _dashboard_listen() if self.cfg.dashboard else None
        if listen is not None:
            self.dashboard_url = f"http://{listen}/"
        self._print_plan(url)
        live = self.cfg.live if self.cfg.live is not None else sys.stdout.isatty()
        self.view = LiveView(self.cfg.lease_ttl) if live else PlainView(self.cfg.lease_ttl)
        summary: Summary | None = None
        try:
            self._spawn_all(url)
            if listen is not None:
                self.children.spawn(
                    "demo-dashboard", "dashboard", duetime_argv("dashboard", "--listen", listen),
                    self._child_env(url, "demo-dashboard"),
                )  # fmt: skip
            with self.view:
                await self._wait_ready()
                await self._add_schedules(pool)
                await self._publish(pool)
                summary = await self._watch_until_drained()
            summary.needed_sigkill = await self.children.stop_all(STOP_TIMEOUT)
        finally:
            self.children.kill_all()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(5):
                    await pool.close()
            await self._delete_queue()
        assert summary is not None  # the try block either set it or raised
        summary.children = {c.name: c.pids for c in self.children.all}
        render(summary, sys.stdout)
        if self.cfg.summary_json is not None:
            summary.write_json(self.cfg.summary_json)
        return 0 if summary.ok else 1

    async def _check_services(self) -> None:
        etcd = await read_election_key(replace(self.settings, etcd_prefix=self.prefix), timeout=2)
        if not etcd.reachable:
            raise ServiceUnavailable(
                f"etcd is not reachable at {','.join(self.settings.etcd_endpoints)} "
                f"({etcd.error}). Start it with `make services` (runs etcd on "
                "127.0.0.1:2379, data under .run/), or point --etcd-endpoints at yours."
            )
        try:
            conn = await broker.connect(self.settings.amqp_url, timeout=5, name="duetime-demo")
        except ServiceUnavailable as exc:
            raise ServiceUnavailable(f"{exc}. Start RabbitMQ (`make services`).") from None
        with contextlib.suppress(Exception):
            async with asyncio.timeout(5):
                await conn.close()

    def _print_plan(self, url: str) -> None:
        cfg = self.cfg
        names = [f"demo-sched-{chr(ord('a') + i)}" for i in range(cfg.replicas)]
        names += [f"demo-worker-{i + 1}" for i in range(cfg.workers)]
        names += ["demo-dashboard"] if self.dashboard_url else []
        kill = (
            f"the leader is SIGKILLed at {cfg.duration / 2:g} s" if cfg.kill_leader else "no kill"
        )
        print(
            f"duetime demo · run {self.run_id}\n"
            f"  database   {redact_url(url)} (dropped and re-created, migrated)\n"
            f"  etcd       {','.join(self.settings.etcd_endpoints)}, prefix {self.prefix}\n"
            f"  queue      {self.queue} (RabbitMQ {broker.queue_name(self.queue)})\n"
            f"  processes  {cfg.replicas} scheduler replicas (lease TTL {cfg.lease_ttl:g} s), "
            f"{cfg.workers} workers x {cfg.concurrency}\n"
            f"  logs       {_shown(self.log_dir)}/ ({', '.join(n + '.log' for n in names)})\n"
            f"  plan       {cfg.jobs} jobs due over {cfg.duration:g} s, cron every 2 s and "
            f"every 5 s; {kill}\n"
            + (
                f"  dashboard  {self.dashboard_url} (served while the demo runs)\n"
                if self.dashboard_url
                else ""
            ),
            flush=True,
        )

    def _child_env(self, url: str, node_id: str) -> dict[str, str]:
        s = self.settings
        env = {k: v for k, v in os.environ.items() if not k.startswith("DUETIME_")}
        env.update(CHILD_SETTINGS)
        env.update(
            PYTHONUNBUFFERED="1",
            DUETIME_DATABASE_URL=url,
            DUETIME_AMQP_URL=s.amqp_url,
            DUETIME_ETCD_ENDPOINTS=",".join(s.etcd_endpoints),
            DUETIME_ETCD_PREFIX=self.prefix,
            DUETIME_ETCD_TIMEOUT=str(s.etcd_timeout),
            DUETIME_DB_TIMEOUT=str(s.db_timeout),
            DUETIME_AMQP_TIMEOUT=str(s.amqp_timeout),
            DUETIME_LEASE_TTL=str(self.cfg.lease_ttl),
            DUETIME_NODE_ID=node_id,
        )
        if s.etcd_username:
            env["DUETIME_ETCD_USERNAME"] = s.etcd_username
        if s.etcd_password:
            env["DUETIME_ETCD_PASSWORD"] = s.etcd_password
        for name in ("etcd_ca_file", "etcd_cert_file", "etcd_key_file"):
            if getattr(s, name):
                env["DUETIME_" + name.upper()] = str(getattr(s, name))
        return env

    def _spawn_all(self, url: str) -> None:
        for i in range(self.cfg.replicas):
            name = f"demo-sched-{chr(ord('a') + i)}"
            self.children.spawn(
                name, "scheduler", duetime_argv("scheduler"), self._child_env(url, name)
            )
            self.watch.states[name] = "starting"
        worker_args = (
            "worker",
            "--import",
            "demo.tasks",
            "--queue",
            self.queue,
            "--concurrency",
            str(self.cfg.concurrency),
        )
        for i in range(self.cfg.workers):
            name = f"demo-worker-{i + 1}"
            self.children.spawn(
                name, "worker", duetime_argv(*worker_args), self._child_env(url, name)
            )
            self.watch.states[name] = "starting"

    async def _wait_ready(self) -> None:
        """Until a replica of ours fenced the database and every worker consumes."""
        deadline = time.monotonic() + self.cfg.startup_timeout
        replicas = {c.name for c in self.children.by_role("scheduler")}
        while True:
            for child in self.children.all:  # fail fast: a start-up crash is no hiccup
                if not child.running():
                    raise ServiceUnavailable(
                        f"{child.name} exited with code {child.returncode} while starting; "
                        f"its log ({_shown(child.log_path)}) ends with:\n{child.tail()}"
                    )
            self._follow_logs()
            fence = await self.store.fence()
            workers_up = all(
                self.watch.states[c.name] == "consuming" for c in self.children.by_role("worker")
            )
            if fence.leader_node in replicas and workers_up:
                return
            if time.monotonic() > deadline:
                waiting = [n for n, s in self.watch.states.items() if s == "starting"]
                raise ServiceUnavailable(
                    f"not ready after {self.cfg.startup_timeout:g} s (leader fenced: "
                    f"{fence.leader_node or 'none'}; still starting: {', '.join(waiting) or '-'}); "
                    f"see the logs in {_shown(self.log_dir)}/"
                )
            self.view.update(self._snapshot("starting", None))
            await asyncio.sleep(0.1)

    async def _add_schedules(self, pool: asyncpg.Pool) -> None:
        try:
            from scheduler.planning import ScheduleSpec
            from scheduler.store.schedules import ScheduleStore
        except ImportError:  # schedules not part of this build
            return
        store = ScheduleStore(pool)
        for name, cron in DEMO_SCHEDULES:
            await store.add(
                ScheduleSpec(
                    name=name,
                    task=CRON_TASK,
                    cron=cron,
                    payload={"schedule": name},
                    queue=self.queue,
                )
            )
            self.schedules_added += 1

    async def _publish(self, pool: asyncpg.Pool) -> None:
        """All jobs in one COPY, due evenly over the duration starting LEAD_IN from now."""
        cfg = self.cfg
        mono = time.monotonic()
        first_due = await self.store.now() + timedelta(seconds=LEAD_IN)
        step = cfg.duration / cfg.jobs
        specs = (
            JobSpec(
                JOB_TASK, {"n": n}, due_at=first_due + timedelta(seconds=n * step), queue=self.queue
            )
            for n in range(cfg.jobs)
        )
        inserted = await JobStore(pool).bulk_enqueue(specs)
        self.t0 = mono + LEAD_IN
        self._event(
            f"published {inserted} jobs in one COPY ({time.monotonic() - mono:.2f} s), "
            f"due over the next {cfg.duration:g} s",
            at=time.monotonic() - self.t0,
        )
        self._note_cron()

    async def _watch_until_drained(self) -> Summary:
        cfg = self.cfg
        last_due = self.t0 + cfg.duration
        deadline = last_due + cfg.grace
        tick = 0.25 if isinstance(self.view, LiveView) else 0.5
        drained_in: float | None = None
        while True:
            progress = await self.store.progress()
            self._follow_logs()
            self._supervise()
            await self._failover_step(progress)
            now = time.monotonic()
            done = now >= last_due and progress.jobs.finished >= cfg.jobs
            phase = "running" if now < last_due else "draining"
            self.view.update(self._snapshot("done" if done else phase, progress))
            if done:
                drained_in = max(0.0, now - last_due)
                break
            if now >= deadline:
                self._event(
                    f"grace of {cfg.grace:g} s over with "
                    f"{cfg.jobs - progress.jobs.finished} jobs unfinished"
                )
                break
            await asyncio.sleep(tick)
        steady = None
        f = self.watch.failover
        if f is not None and self.watch.kill_at is not None and f.first_dispatch_after is not None:
            gap_end = self.watch.kill_at + timedelta(seconds=f.first_dispatch_after)
            steady = await self.store.steady_lag(self.watch.kill_at, gap_end)
        return judge(
            progress=progress,
            published=cfg.jobs,
            steady_lag=steady,
            drained_in=drained_in,
            failover=f,
            cron_note=self._cron_note(),
            run_id=self.run_id,
            database=cfg.database_name,
            queue=self.queue,
            etcd_prefix=self.prefix,
            log_dir=str(_shown(self.log_dir)),
            children={},
        )

    # -- failover ------------------------------------------------------------------------

    async def _failover_step(self, progress: Progress) -> None:
        w, cfg = self.watch, self.cfg
        fence = progress.fence
        if w.failover is None:
            if not cfg.kill_leader or time.monotonic() - self.t0 < cfg.duration / 2:
                return
            leader = self.children.find(fence.leader_node)
            if leader is None or not leader.running():
                return  # mid-election: try again next tick
            leader.kill9()
            w.kill_at = await self.store.now()
            w.killed = leader
            w.states[leader.name] = "killed"
            w.failover = Failover(killed=leader.name, killed_epoch=fence.epoch)
            self._event(f"killed the leader {leader.name} (epoch {fence.epoch}) with SIGKILL")
            if cfg.replicas == 1:  # nobody to take over: bring it back, as systemd would
                leader.start()
                self._event(f"restarted {leader.name} (the only replica)")
            return
        assert w.kill_at is not None
        if w.failover.new_epoch is None:
            if fence.epoch > w.failover.killed_epoch and fence.elected_at is not None:
                after = (fence.elected_at - w.kill_at).total_seconds()
                w.failover = replace(
                    w.failover,
                    new_leader=fence.leader_node,
                    new_epoch=fence.epoch,
                    fenced_after=after,
                )
                self._event(
                    f"{fence.leader_node} leads: fenced epoch {fence.epoch} "
                    f"{fmt_seconds(after)} after the kill"
                )
                if w.killed is not None and not w.killed.running():
                    w.killed.start()
                    w.states[w.killed.name] = "starting"
                    self._event(f"restarted {w.killed.name}: it rejoins as a standby")
            return
        if w.failover.first_dispatch_after is None:
            first = await self.store.first_dispatch(w.failover.new_epoch)
            if first is not None:
                after = (first - w.kill_at).total_seconds()
                w.failover = replace(w.failover, first_dispatch_after=after)
                self._event(
                    f"epoch {w.failover.new_epoch} dispatched its first job "
                    f"{fmt_seconds(after)} after the kill"
                )

    # -- observing -----------------------------------------------------------------------

    def _follow_logs(self) -> None:
        w = self.watch
        for child in self.children.all:
            for event in child.new_events():
                name = event.get("event")
                if name == "campaigning":
                    w.states[child.name] = "campaigning"
                elif name in ("election_follower", "stepping_down", "resigned"):
                    w.states[child.name] = "standby"
                elif name == "leading":
                    w.states[child.name] = "leader"
                    duties = event.get("duties")
                    if isinstance(duties, list):
                        w.leader_duties = [str(d) for d in duties]
                        self._note_cron()
                elif name == "service_ready" and event.get("service") == "worker":
                    w.states[child.name] = "consuming"
            if child.running() or w.states.get(child.name) == "killed":
                continue
            if child.name not in w.down_since:
                w.down_since[child.name] = time.monotonic()
                w.states[child.name] = f"exited {child.returncode}"
                again = w.restarts.get(child.name, 0) < MAX_RESTARTS
                self._event(
                    f"{child.name} exited unexpectedly (code {child.returncode}; see "
                    f"{_shown(child.log_path)}); "
                    + ("restarting it, as systemd would" if again else "not restarting it again")
                )

    def _supervise(self) -> None:
        """Restart crashed children after RESTART_DELAY, at most MAX_RESTARTS each."""
        w = self.watch
        for name, since in list(w.down_since.items()):
            child = self.children.find(name)
            if child is None or w.restarts.get(name, 0) >= MAX_RESTARTS:
                continue
            if time.monotonic() - since >= RESTART_DELAY:
                del w.down_since[name]
                w.restarts[name] = w.restarts.get(name, 0) + 1
                w.states[name] = "starting"
                child.start()

    def _note_cron(self) -> None:
        """Say once, as an event, why no cron fire will show up (if that is so)."""
        note = self._cron_note()
        if note and self.t0 and not self.watch.cron_noted:
            self.watch.cron_noted = True  # the live view shows it in its "cron" row
            self.view.event(time.monotonic() - self.t0, note)

    def _cron_note(self) -> str | None:
        if not self.schedules_added:
            return "schedules not available in this build"
        duties = self.watch.leader_duties
        if duties is not None and "planner" not in duties:
            return (
                f"{self.schedules_added} schedules added, but this `duetime scheduler` "
                "runs no planner (duties: " + ", ".join(duties) + "): no fires"
            )
        return None

    def _event(self, text: str, at: float | None = None) -> None:
        when = at if at is not None else time.monotonic() - self.t0
        self.watch.events.append((when, text))
        self.view.event(when, text)

    def _snapshot(self, phase: str, progress: Progress | None) -> Snapshot:
        states = self.watch.states
        elapsed = time.monotonic() - self.t0 if self.t0 else None
        return Snapshot(
            run_id=self.run_id,
            queue=self.queue,
            jobs=self.cfg.jobs,
            duration=self.cfg.duration,
            elapsed=max(0.0, elapsed) if elapsed is not None else None,
            phase=phase,
            progress=progress,
            replicas=[
                ProcessLine(c.name, states[c.name]) for c in self.children.by_role("scheduler")
            ],
            workers=[ProcessLine(c.name, states[c.name]) for c in self.children.by_role("worker")],
            events=list(self.watch.events),
            cron_note=self._cron_note() if progress is not None else None,
        )

    async def _delete_queue(self) -> None:
        """Best effort: the run's broker queues, the job queue and the staged queue its
        workers declared (DESIGN §14), are of no use to anyone after the run; left
        behind, every run would add one to the broker."""
        with contextlib.suppress(Exception):
            async with asyncio.timeout(10):
                conn = await broker.connect(self.settings.amqp_url, timeout=5, name="duetime-demo")
                try:
                    channel = await conn.channel()
                    for name in broker.job_queue_names(self.queue):
                        await channel.queue_delete(name)
                finally:
                    await conn.close()


def _shown(path: Path) -> Path:
    """A path relative to the current directory when it is inside it."""
    with contextlib.suppress(ValueError):
        return path.resolve().relative_to(Path.cwd())
    return path


def _dashboard_listen() -> str:
    """``DASHBOARD_LISTEN`` when that port is free, else a free loopback port."""
    host, port = DASHBOARD_LISTEN
    for candidate in (port, 0):
        with socket.socket() as sock:
            try:
                sock.bind((host, candidate))
            except OSError:
                continue
            return f"{host}:{sock.getsockname()[1]}"
    raise ServiceUnavailable(f"no free port on {host} for the dashboard")  # pragma: no cover
