"""Claim latency with and without the maintainer's partition DDL running.

Usage::

    .venv/bin/python bench/maintainer_claim_latency.py [--dsn postgresql://postgres@127.0.0.1:5432/postgres]
        [--seconds 10] [--jobs 20000] [--hold-ms 5] [--lock-timeout 0.5]

``--dsn`` names a server; the script creates a scratch database, migrates it, measures,
drops it and prints one JSON document.

A *claimer* runs the dispatcher's claim back to back: a fenced transaction, the claim
statement (100 rows ``FOR UPDATE SKIP LOCKED``), ``--hold-ms`` of holding the locks (the
confirms the real dispatcher waits for), rollback (so the backlog never drains). Each
transaction's wall time is one sample. Two phases of ``--seconds`` each:

- ``baseline``: the claimer alone;
- ``maintainer``: the claimer while partition DDL runs back to back, far harsher than
  production (one bucket a day): each iteration makes work for the maintainer — a bucket
  30+ days old filled with terminal rows, and the furthest bucket ahead taken away —
  through the same fenced, lock-timeout-guarded store calls, then runs
  ``Maintainer.run_once`` (which creates the missing bucket and drops the old one).

Reports p50/p99/max claim latency per phase, the ratios, and the DDL done and deferred.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time
import uuid
from datetime import date, timedelta
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from scheduler import db
from scheduler.config import load_settings
from scheduler.duties.base import LeaderTerm
from scheduler.duties.context import DutyContext
from scheduler.duties.knobs import config_from_settings
from scheduler.duties.maintainer import Maintainer, MaintainerConfig
from scheduler.log import configure_logging
from scheduler.migrate import migrate
from scheduler.store.dispatch import DispatchStore
from scheduler.store.fence import FenceStore
from scheduler.store.fenced import fenced_transaction

EPOCH = 1
DAYS_AHEAD = 14


class _Rollback(Exception):
    """Ends a claim transaction without committing (the backlog stays as it is)."""


def _with_db(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + name, parts.query, ""))


def _percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    q = statistics.quantiles(ordered, n=100, method="inclusive")
    return {
        "claims": len(ordered),
        "p50_ms": round(q[49] * 1000, 3),
        "p99_ms": round(q[98] * 1000, 3),
        "max_ms": round(ordered[-1] * 1000, 3),
    }


async def claimer(pool: asyncpg.Pool, stop: asyncio.Event, hold: float) -> list[float]:
    store = DispatchStore(pool)
    samples: list[float] = []
    async with pool.acquire() as conn:
        while not stop.is_set():
            started = time.perf_counter()
            try:
                async with fenced_transaction(conn, EPOCH):
                    await store.claim(conn, 100)
                    await asyncio.sleep(hold)
                    raise _Rollback
            except _Rollback:
                pass
            samples.append(time.perf_counter() - started)
    return samples


async def churn(maintainer: Maintainer, stop: asyncio.Event) -> dict[str, Any]:
    """Maintainer passes back to back, each with one bucket to create and one to drop."""
    store, pool = maintainer.store, maintainer.writes.pool
    today: date = await pool.fetchval("SELECT (now() AT TIME ZONE 'UTC')::date")
    totals = {"passes": 0, "created": 0, "dropped": 0, "deferred": 0, "setup_deferred": 0}
    pass_ms: list[float] = []
    i = 0
    while not stop.is_set():
        i += 1
        old = today - timedelta(days=30 + i)
        far = today + timedelta(days=DAYS_AHEAD)
        try:
            async with pool.acquire() as conn, fenced_transaction(conn, EPOCH):
                await store.set_limits(conn, lock_timeout=0.5, statement_timeout=5)
                await store.create_bucket(conn, old)
                await conn.execute(
                    "INSERT INTO duetime.jobs (task, due_at, status, finished_at) "
                    "SELECT 'old', ($1::date + time '12:00') AT TIME ZONE 'UTC', "
                    "       'succeeded', now() FROM generate_series(1, 200)",
                    old,
                )
            async with pool.acquire() as conn, fenced_transaction(conn, EPOCH):
                await store.set_limits(conn, lock_timeout=0.5, statement_timeout=2)
                if await store.detach_bucket(conn, far) == "detached":
                    await store.drop_detached(conn, f"jobs_p{far:%Y%m%d}_detached")
        except (asyncpg.LockNotAvailableError, asyncpg.QueryCanceledError):
            totals["setup_deferred"] += 1
        started = time.perf_counter()
        await maintainer.run_once()
        pass_ms.append((time.perf_counter() - started) * 1000)
        report = maintainer.last_report
        assert report is not None
        totals["passes"] += 1
        totals["created"] += len(report.created)
        totals["dropped"] += len(report.dropped)
        totals["deferred"] += report.deferred
    totals["pass_ms_p50"] = round(statistics.median(pass_ms), 2) if pass_ms else None
    return totals


async def phase(pool: asyncpg.Pool, seconds: float, hold: float, maintainer: Maintainer | None):
    stop = asyncio.Event()
    claims = asyncio.create_task(claimer(pool, stop, hold))
    ddl = asyncio.create_task(churn(maintainer, stop)) if maintainer else None
    try:
        await asyncio.sleep(seconds)
    finally:
        stop.set()
    samples = await claims
    out: dict[str, Any] = _percentiles(samples)
    if ddl is not None:
        out["maintenance"] = await ddl
    return out


async def main(args: argparse.Namespace) -> dict[str, Any]:
    name = f"duetime_bench_maint_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(args.dsn, timeout=10)
    await admin.execute(f'CREATE DATABASE "{name}"')
    url = _with_db(args.dsn, name)
    try:
        await migrate(url)
        pool = await db.create_pool(url, max_size=4)
        try:
            await FenceStore(pool).advance(EPOCH, "bench")
            await pool.execute(
                "INSERT INTO duetime.jobs (task, due_at) "
                "SELECT 'b', now() - random() * interval '20 hours' FROM generate_series(1, $1)",
                args.jobs,
            )
            await pool.execute("ANALYZE duetime.jobs")
            settings = load_settings(env={}, overrides={"database_url": url})
            config = config_from_settings(
                MaintainerConfig, settings, days_ahead=DAYS_AHEAD, lock_timeout=args.lock_timeout
            )
            maintainer = Maintainer(DutyContext.standalone(settings, pool), config=config)
            maintainer.loop.bind(LeaderTerm(EPOCH, "bench"))
            hold = args.hold_ms / 1000
            await phase(pool, 1.0, hold, None)  # warm-up: prepared statements, caches
            baseline = await phase(pool, args.seconds, hold, None)
            loaded = await phase(pool, args.seconds, hold, maintainer)
        finally:
            await pool.close()
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()
    return {
        "bench": "maintainer_claim_latency",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "params": {
            "seconds": args.seconds,
            "jobs": args.jobs,
            "hold_ms": args.hold_ms,
            "lock_timeout_s": args.lock_timeout,
        },
        "baseline": baseline,
        "maintainer": loaded,
        "ratio_p50": round(loaded["p50_ms"] / baseline["p50_ms"], 3),
        "ratio_p99": round(loaded["p99_ms"] / baseline["p99_ms"], 3),
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--hold-ms", type=float, default=5.0)
    parser.add_argument("--lock-timeout", type=float, default=0.5)
    return parser.parse_args()


if __name__ == "__main__":
    configure_logging("warning", "console")
    print(json.dumps(asyncio.run(main(parse_args()))))
