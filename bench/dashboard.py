"""``dashboard``: what one dashboard page costs the database at scale (target: every
overview statement under 50 ms at 10M stored jobs).

Loads ``--jobs`` rows with ``JobStore.bulk_enqueue`` (COPY), then shapes them like a
busy system's day: ~93 % succeeded (``--rate`` per second of them in the last hour,
the rest over the previous 23 h, each with its ledger row), 4 % pending in the future,
2 % dead (a tenth of them in the last hour), 1 % cancelled; ``VACUUM ANALYZE`` and a
``CHECKPOINT``. Then times, on one connection like the dashboard's pool, each
statement the overview runs (``StatusStore.snapshot``'s and ``DashboardStore``'s; the
per-queue pending count only runs below ``PENDING_EXACT_LIMIT`` pending jobs) and
the job list's first page under common filters: ``--repeat`` runs each, p50/p99/max.
``EXPLAIN ANALYZE`` of the slowest job-list filter is kept in the result.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg

from bench.harness import Sandbox, Services
from bench.report import load_average, now_iso
from scheduler.jobspec import JobSpec
from scheduler.sql import load
from scheduler.store import JobStore, QueueStore
from scheduler.store.dashboard import (
    DEAD_WINDOW,
    LAG_SAMPLE,
    LATEST_DEAD,
    MINUTE_SAMPLE,
    PAGES,
    PENDING_EXACT_LIMIT,
    SAMPLE_MINUTES,
    WORKER_WINDOW,
)

TARGET_MS = 50.0
CHUNK = 50_000

SHAPE = """
UPDATE duetime.jobs
   SET status = 'succeeded', dispatched_at = due_at + (id % 50) * interval '1 millisecond',
       finished_at = due_at + interval '20 milliseconds' + (id % 50) * interval '1 millisecond'
 WHERE task = 'bench.ok';
UPDATE duetime.jobs
   SET status = 'dead', finished_at = due_at + interval '1 second', last_error =
       CASE WHEN id % 3 = 0 THEN 'ConnectionError: upstream refused' ELSE 'ValueError: bad' END
 WHERE task = 'bench.dead';
UPDATE duetime.jobs SET status = 'cancelled', finished_at = now() WHERE task = 'bench.cancel';
INSERT INTO duetime.job_ledger (idempotency_key, job_id, attempt, task, worker, completed_at)
SELECT 'job:' || id, id, 1, task, 'bench-worker-' || (id % 4), finished_at
  FROM duetime.jobs WHERE task = 'bench.ok';
"""


@dataclass(frozen=True)
class DashboardParams:
    jobs: int = 1_000_000
    rate: float = 100.0  # completions per second during the last hour
    repeat: int = 20

    @classmethod
    def quick(cls) -> DashboardParams:
        return cls(jobs=20_000, rate=2.0, repeat=3)


def _specs(params: DashboardParams, now: datetime) -> list[JobSpec]:
    recent = max(1, min(int(params.rate * 3600), int(params.jobs * 0.5)))
    out: list[JobSpec] = []
    ok = 0
    for i in range(params.jobs):
        kind = i % 100
        if kind < 4:
            task, due = "bench.pending", now + timedelta(hours=1, seconds=i % 864_000)
        elif kind < 6:
            back = i % 3500 if (i // 100) % 10 == 0 else 3600 + i % 82_800
            task, due = "bench.dead", now - timedelta(seconds=back + 2)
        elif kind < 7:
            task, due = "bench.cancel", now + timedelta(hours=2)
        else:
            back = 1 + ok * 3600 / recent if ok < recent else 3600 + i % 82_800
            task, due = "bench.ok", now - timedelta(seconds=back)
            ok += 1
        out.append(JobSpec(task=task, payload={"i": i}, due_at=due, queue=f"q{i % 3}"))
    return out


async def _time(conn: asyncpg.Connection, sql: str, args: tuple[Any, ...], n: int) -> dict:
    took = []
    for _ in range(n + 1):  # the first run plans and warms; not counted
        began = time.perf_counter()
        await conn.fetch(sql, *args)
        took.append((time.perf_counter() - began) * 1000)
    took = took[1:]
    took.sort()
    return {
        "p50_ms": round(statistics.median(took), 2),
        "p99_ms": round(took[min(len(took) - 1, round(0.99 * (len(took) - 1)))], 2),
        "max_ms": round(took[-1], 2),
    }


async def run(services: Services, params: DashboardParams) -> dict[str, Any]:
    started = now_iso()
    async with Sandbox(services, "dashboard") as sb:
        now = datetime.now(UTC)
        store = JobStore(sb.db)
        for queue in ("q0", "q1", "q2"):  # declared, as a real cluster's queues are
            await QueueStore(sb.db).add(queue)
        began = time.perf_counter()
        specs = _specs(params, now)
        for start in range(0, len(specs), CHUNK):
            await store.bulk_enqueue(specs[start : start + CHUNK])
        del specs
        copy_s = time.perf_counter() - began
        began = time.perf_counter()
        await sb.db.execute(SHAPE, timeout=3600)
        await sb.db.execute("VACUUM ANALYZE duetime.jobs", timeout=3600)
        await sb.db.execute("VACUUM ANALYZE duetime.job_ledger", timeout=3600)
        await sb.db.execute("CHECKPOINT", timeout=3600)
        shape_s = time.perf_counter() - began
        last_hour = await sb.db.fetchval(
            "SELECT count(*) FROM duetime.job_ledger WHERE completed_at > now() - interval '1h'"
        )
        d, s = load("dashboard"), load("status")
        overview = {
            "status.fence": (s["fence"], ()),
            "status.pending_by_queue": (s["pending_by_queue"], ()),
            "status.dispatched_by_queue": (s["dispatched_by_queue"], ()),
            "status.dead_by_queue": (s["dead_by_queue"], (DEAD_WINDOW,)),
            "pending_probe": (d["pending_probe"], (PENDING_EXACT_LIMIT,)),
            "table_bytes": (d["table_bytes"], ()),
            "terminal_estimates": (d["terminal_estimates"], ()),
            "oldest_overdue": (d["oldest_overdue"], ()),
            "latest_dead": (d["latest_dead"], (DEAD_WINDOW, LATEST_DEAD)),
            "minute_samples": (d["minute_samples"], (SAMPLE_MINUTES, MINUTE_SAMPLE, LAG_SAMPLE)),
            "workers": (d["workers"], (WORKER_WINDOW,)),
        }
        # the filter's $1..$6 (queue, task, due window, error, tags): none of them here
        page, no = PAGES[None, False], (None,) * 6
        jobs_page = {  # the statement DashboardStore.jobs_page picks for each filter
            "no filter": (page, (*no, None, None, 50)),
            "status=pending": (PAGES["pending", False], (*no, None, None, 50)),
            "status=dead": (PAGES["dead", False], (*no, None, None, 50)),
            "status=dead&error~connectionerror": (
                PAGES["dead", False],
                (*no[:4], "connectionerror", None, None, None, 50),
            ),
            "status=succeeded&queue=q1": (page, ("q1", *no[1:], "succeeded", None, 50)),
            "queue=q1": (page, ("q1", *no[1:], None, None, 50)),
            "task=bench.cancel": (page, (None, "bench.cancel", *no[2:], None, None, 50)),
            "error~connectionerror": (page, (*no[:4], "connectionerror", None, None, None, 50)),
        }
        async with sb.db.acquire() as conn:
            timings = {k: await _time(conn, q, a, params.repeat) for k, (q, a) in overview.items()}
            pages = {k: await _time(conn, q, a, params.repeat) for k, (q, a) in jobs_page.items()}
            worst = max(pages, key=lambda k: pages[k]["p50_ms"])
            plan = await conn.fetch(
                "EXPLAIN (ANALYZE, BUFFERS, SUMMARY) " + jobs_page[worst][0], *jobs_page[worst][1]
            )
        pending = await sb.db.fetchval("SELECT count(*) FROM duetime.jobs WHERE status = 'pending'")
        if pending >= PENDING_EXACT_LIMIT:  # the overview does not run it at this size
            timings["status.pending_by_queue"]["run_by_overview"] = False
        slowest = max(v["p50_ms"] for v in timings.values() if v.get("run_by_overview", True))
        return {
            "scenario": "dashboard",
            "started_at": started,
            "load_avg_start": load_average(),
            "stored_jobs": params.jobs,
            "ledger_rows_last_hour": last_hour,
            "pending_jobs": pending,
            "load": {"copy_s": round(copy_s, 1), "shape_vacuum_checkpoint_s": round(shape_s, 1)},
            "overview_statements": timings,
            "jobs_page_first_page": pages,
            "slowest_jobs_page_plan": [r[0] for r in plan][-12:],
            "targets": {
                "overview_statement_ms": TARGET_MS,
                "slowest_overview_p50_ms": slowest,
                "met": slowest < TARGET_MS,
                "complete": True,
            },
        }
