"""Planner throughput: fire times materialized per second, and round trips per batch.

Usage::

    .venv/bin/python bench/planner_rate.py --dsn postgresql://postgres@127.0.0.1:5432/postgres

``--dsn`` names a server; the script creates a scratch database of its own, migrates it,
measures, drops it, and prints one JSON document. For each size
(default 1k, 10k, 100k schedules firing every second — the worst case for the planner —
as identical cron schedules, as cron schedules that share nothing, or as intervals; see
``KINDS``):

- ``initial``: one planner pass over the fresh schedules at a fixed instant (``ManualClock``):
  each gets ``horizon + 1`` fire times (11 by default) materialized;
- ``steady``: the clock moved to the schedules' ``plan_at`` (``horizon - lead`` later):
  every schedule is due again and gets its next ``lead + 1`` fire times — the pass a live
  planner runs every ``lead`` seconds;
- per pass: fire times/s, schedules/s, batches, the split between claiming, deciding
  (pure Python cron math) and writing (one ``apply_plan`` statement + COMMIT), and the
  statements sent per batch counted by an asyncpg query logger (BEGIN, fence, claim,
  apply, COMMIT: 5 whatever the batch size — not one per schedule).

``--recurring 1000`` runs the end-to-end recurring benchmark instead (the issue's "1,000
schedules every second for 20 s"): real time, one leader replica running its default
duties plus the planner (in this process, etcd at ``--etcd``, a unique prefix), one
``duetime worker`` process running ``bench.noop`` (from bench/worker_rate.py) on a queue
of its own. For the fire times of a ``--seconds`` window it reports the jobs delivered
(``succeeded``) per second and the lag from the fire time to ``dispatched_at`` (published
and confirmed) and to ``finished_at`` (handler done, ledger committed): p50, p99, max.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import sys
import time
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg

from bench.harness import scratch_database
from scheduler import db
from scheduler.clock import ManualClock
from scheduler.config import load_settings
from scheduler.duties import default_duties
from scheduler.duties.base import Duty, LeaderTerm
from scheduler.duties.context import DutyContext
from scheduler.duties.plan_report import PlanReport
from scheduler.duties.planner import Planner, PlannerConfig
from scheduler.leadership.replica import Replica
from scheduler.log import configure_logging
from scheduler.store.fence import FenceStore

REPO = Path(__file__).resolve().parents[1]

EPOCH = 1
#: How the schedules are made. ``cron``: all ``* * * * * *`` (they share one enumeration
#: of fire times per batch, as thousands of ``0 * * * *`` would); ``cron-distinct``: the
#: same expression but each with its own ``end_at`` (far away), so none shares: the cost
#: of the cron math per schedule; ``interval``: every 1 s as an interval.
KINDS = {
    "cron": "INSERT INTO duetime.schedules (name, task, cron) "
    "SELECT 'bench-' || i, 'tick', '* * * * * *' FROM generate_series(1, $1) i",
    "cron-distinct": "INSERT INTO duetime.schedules (name, task, cron, end_at) "
    "SELECT 'bench-' || i, 'tick', '* * * * * *', "
    "timestamptz '2100-01-01' + i * interval '1 second' FROM generate_series(1, $1) i",
    "interval": "INSERT INTO duetime.schedules (name, task, interval) "
    "SELECT 'bench-' || i, 'tick', interval '1 second' FROM generate_series(1, $1) i",
}


class StatementCounter:
    """Counts statements sent on every pool connection (asyncpg query logger)."""

    def __init__(self) -> None:
        self.count = 0
        self._hooked: set[int] = set()

    async def setup(self, conn: Any) -> None:  # asyncpg pool ``setup``: on every acquire
        raw = conn._con if hasattr(conn, "_con") else conn
        if id(raw) not in self._hooked:
            self._hooked.add(id(raw))
            raw.add_query_logger(self._logged)

    def _logged(self, _record: Any) -> None:
        self.count += 1


def _pass(report: PlanReport, seconds: float, statements: int) -> dict[str, Any]:
    return {
        "schedules": report.claimed,
        "fire_times": report.fired,
        "seconds": round(seconds, 3),
        "fire_times_per_second": round(report.fired / seconds) if seconds else None,
        "schedules_per_second": round(report.claimed / seconds) if seconds else None,
        "batches": report.batches,
        "statements_per_batch": round(statements / max(report.batches, 1), 2),
        "claim_seconds": round(report.claim_seconds, 3),
        "decide_seconds": round(report.decide_seconds, 3),
        "write_seconds": round(report.write_seconds, 3),
    }


async def run_size(
    pool: asyncpg.Pool,
    counter: StatementCounter,
    url: str,
    kind: str,
    n: int,
    args: argparse.Namespace,
) -> dict[str, Any]:
    async with pool.acquire() as conn:
        await conn.execute("TRUNCATE duetime.schedules, duetime.schedule_fires")
        await conn.execute("TRUNCATE duetime.jobs")
        await conn.execute(KINDS[kind], n)
        await conn.execute("VACUUM ANALYZE duetime.schedules")
    # tomorrow 00:00 UTC: inside the daily partitions the migration created
    start = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    clock = ManualClock(start + timedelta(days=1))
    settings = load_settings(env={}, overrides={"database_url": url})
    config = PlannerConfig(horizon=args.horizon, batch_size=args.batch)
    planner = Planner(DutyContext.standalone(settings, pool, clock=clock), config=config)
    planner.loop.bind(LeaderTerm(EPOCH, "bench"))
    out: dict[str, Any] = {"schedules": n, "kind": kind}
    for phase in ("initial", "steady"):
        if phase == "steady":
            clock.advance(args.horizon - args.horizon / 2 + 1)
        await asyncio.sleep(0.05)  # let pending query-logger callbacks run
        before = counter.count
        began = time.perf_counter()
        report = await planner.plan_pass()
        elapsed = time.perf_counter() - began
        await asyncio.sleep(0.05)
        out[phase] = _pass(report, elapsed, counter.count - before)
    async with pool.acquire() as conn:
        out["jobs_in_table"] = await conn.fetchval("SELECT count(*) FROM duetime.jobs")
    return out


async def throughput(url: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    counter = StatementCounter()
    pool = await db.create_pool(url, min_size=1, max_size=2, timeout=60, setup=counter.setup)
    try:
        assert await FenceStore(pool).advance(EPOCH, "bench")
        return [
            await run_size(pool, counter, url, kind, n, args)
            for kind in args.kinds
            for n in args.sizes
        ]
    finally:
        await pool.close()


# -- end to end: recurring schedules delivered by a worker ------------------------------


def duties_with_planner(ctx: DutyContext) -> Sequence[Duty]:
    """The default duties, plus the planner until ``default_duties`` lists it."""
    duties = list(default_duties(ctx))
    if not any(duty.name == Planner.name for duty in duties):
        duties.append(Planner(ctx))
    return duties


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "max": None}
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)], 4)

    return {"p50": at(0.50), "p99": at(0.99), "max": round(ordered[-1], 4)}


async def recurring(url: str, args: argparse.Namespace) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:8]
    queue = f"brec-{tag}"
    conn = await asyncpg.connect(url, timeout=10)
    try:
        await conn.execute(  # declare the queue: only declared queues are dispatched
            "INSERT INTO duetime.queues (name) VALUES ($1) ON CONFLICT DO NOTHING", queue
        )
        await conn.execute(
            "INSERT INTO duetime.schedules (name, task, queue, cron) "
            "SELECT 'rec-' || i, 'bench.noop', $1, '* * * * * *' FROM generate_series(1, $2) i",
            queue,
            args.recurring,
        )
    finally:
        await conn.close()
    settings = load_settings(
        env={},
        overrides={
            "database_url": url,
            "amqp_url": args.amqp_url,
            "etcd_endpoints": args.etcd,
            "etcd_prefix": f"duetime-bench/{tag}",
            "node_id": f"bench-{tag}",
            "log_level": "warning",
        },
    )
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("DUETIME_")},
        "DUETIME_DATABASE_URL": url,
        "DUETIME_AMQP_URL": args.amqp_url,
        "DUETIME_LOG_LEVEL": "warning",
        "DUETIME_NODE_ID": f"bench-worker-{tag}",
        "PYTHONPATH": str(REPO),
    }
    workers = [
        await asyncio.create_subprocess_exec(
            str(Path(sys.executable).parent / "duetime"), "worker", "--import",
            "bench.worker_rate", "--queue", queue, "--concurrency", str(args.concurrency),
            env={**env, "DUETIME_NODE_ID": f"bench-worker-{tag}-{i}"}, cwd=REPO,
            stdout=asyncio.subprocess.DEVNULL,
        )
        for i in range(args.workers)
    ]  # fmt: skip
    stop = asyncio.Event()
    replica = asyncio.create_task(Replica(settings, duties_with_planner).run_until_stopped(stop))
    probe = await asyncpg.connect(url, timeout=10)
    try:
        deadline = time.monotonic() + 60
        while not await probe.fetchval(
            "SELECT count(*) FROM duetime.jobs WHERE status = 'succeeded'"
        ):
            crashed = any(w.returncode is not None for w in workers)
            if time.monotonic() > deadline or replica.done() or crashed:
                raise RuntimeError("no scheduled job ran within 60 s (replica or worker down?)")
            await asyncio.sleep(0.2)
        start = datetime.fromtimestamp(math.ceil(time.time()) + 2, UTC)
        end = start + timedelta(seconds=args.seconds)
        # the window is wall-clock time: wait for it to pass, plus time to finish its jobs
        await asyncio.sleep(end.timestamp() - time.time() + args.settle)
        rows = await probe.fetch(
            "SELECT status, extract(epoch FROM dispatched_at - due_at)::float8 AS dispatch_lag,"
            "       extract(epoch FROM finished_at - due_at)::float8 AS finish_lag"
            "  FROM duetime.jobs WHERE schedule_id IS NOT NULL AND due_at >= $1 AND due_at < $2",
            start,
            end,
        )
    finally:
        stop.set()
        await asyncio.wait_for(replica, 30)
        for worker in workers:
            if worker.returncode is None:
                worker.send_signal(signal.SIGTERM)
        for worker in workers:
            try:
                await asyncio.wait_for(worker.wait(), 30)
            except TimeoutError:
                worker.kill()
                await worker.wait()
        await probe.close()
        await _delete_queue(args.amqp_url, queue)
    wanted = args.recurring * args.seconds
    succeeded = [r for r in rows if r["status"] == "succeeded"]
    return {
        "schedules": args.recurring,
        "window_seconds": args.seconds,
        "fire_times_wanted": wanted,
        "jobs_materialized": len(rows),
        "jobs_succeeded": len(succeeded),
        "delivered_per_second": round(len(succeeded) / args.seconds, 1),
        "wanted_per_second": args.recurring,
        "lag_to_dispatched_s": _percentiles(
            [r["dispatch_lag"] for r in rows if r["dispatch_lag"] is not None]
        ),
        "lag_to_finished_s": _percentiles([r["finish_lag"] for r in succeeded]),
        "workers": args.workers,
        "worker_concurrency": args.concurrency,
    }


async def _delete_queue(amqp_url: str, queue: str) -> None:
    import aio_pika

    from scheduler.broker import job_queue_names

    connection = await aio_pika.connect(amqp_url, timeout=10)
    try:
        channel = await connection.channel()
        for name in job_queue_names(queue):
            await channel.queue_delete(name)
    finally:
        await connection.close()


async def main(args: argparse.Namespace) -> dict[str, Any]:
    async with scratch_database(args.dsn) as (url, result):
        result.update(horizon_seconds=args.horizon, batch_size=args.batch)
        if args.recurring:
            result["recurring"] = await recurring(url, args)
        else:
            result["runs"] = await throughput(url, args)
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dsn",
        default="postgresql://postgres@127.0.0.1:5432/postgres",
        help="server to use (a scratch database is created and dropped on it)",
    )
    parser.add_argument(
        "--sizes",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1000, 10_000, 100_000],
        help="comma-separated schedule counts",
    )
    parser.add_argument(
        "--kinds",
        type=lambda s: s.split(","),
        default=["cron", "cron-distinct"],
        help=f"comma-separated, of: {', '.join(KINDS)}",
    )
    parser.add_argument("--horizon", type=float, default=10.0, help="planner horizon, seconds")
    parser.add_argument("--batch", type=int, default=1000, help="schedules per transaction")
    parser.add_argument(
        "--recurring",
        type=int,
        default=0,
        metavar="N",
        help="run the end-to-end benchmark with N every-second schedules instead",
    )
    parser.add_argument("--seconds", type=int, default=20, help="--recurring: window length")
    parser.add_argument("--settle", type=float, default=5.0, help="--recurring: drain time")
    parser.add_argument("--workers", type=int, default=1, help="--recurring: processes")
    parser.add_argument("--concurrency", type=int, default=64, help="--recurring: per worker")
    parser.add_argument("--amqp-url", default="amqp://guest:guest@127.0.0.1:5672/")
    parser.add_argument("--etcd", default="127.0.0.1:2379", help="--recurring: etcd endpoint")
    return parser.parse_args(argv)


if __name__ == "__main__":
    configure_logging("warning", "json")  # logs to stderr; stdout is the JSON result
    print(json.dumps(asyncio.run(main(parse_args())), indent=2))
