"""Planner throughput: fire times materialized per second, and round trips per batch.

Usage::

    .venv/bin/python bench/planner_rate.py --dsn postgresql://postgres@127.0.0.1:5432/postgres

``--dsn`` names a server; the script creates a scratch database of its own, migrates it,
measures, drops it, and prints one JSON document (issue 6, "Done means"). For each size
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
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from scheduler import db
from scheduler.clock import ManualClock
from scheduler.config import load_settings
from scheduler.duties.planner import Planner, PlannerConfig, PlanReport
from scheduler.duty import LeaderTerm
from scheduler.fence import FenceStore
from scheduler.log import configure_logging
from scheduler.migrate import migrate

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


def _with_db(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + name, parts.query, ""))


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
    planner = Planner(settings, pool, config=config, clock=clock)
    planner.bind(LeaderTerm(EPOCH, "bench"))
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


async def main(args: argparse.Namespace) -> dict[str, Any]:
    name = f"duetime_bench_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(args.dsn, timeout=10)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        version = await admin.fetchval("SHOW server_version")
    finally:
        await admin.close()
    url = _with_db(args.dsn, name)
    result: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "postgresql": version,
            "python": platform.python_version(),
            "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        },
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "horizon_seconds": args.horizon,
        "batch_size": args.batch,
    }
    try:
        await migrate(url)
        counter = StatementCounter()
        pool = await db.create_pool(url, min_size=1, max_size=2, timeout=60, setup=counter.setup)
        try:
            assert await FenceStore(pool).advance(EPOCH, "bench")
            result["runs"] = [
                await run_size(pool, counter, url, kind, n, args)
                for kind in args.kinds
                for n in args.sizes
            ]
        finally:
            await pool.close()
    finally:
        admin = await asyncpg.connect(args.dsn, timeout=10)
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()
    result["machine"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
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
    return parser.parse_args(argv)


if __name__ == "__main__":
    configure_logging("warning", "json")  # logs to stderr; stdout is the JSON result
    print(json.dumps(asyncio.run(main(parse_args())), indent=2))
