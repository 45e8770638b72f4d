"""``tag_filter``: what a tag filter costs at scale (target: under 100 ms over 10M stored
jobs; issue "Job control", migration 0022).

    .venv/bin/python -m bench.tag_filter --jobs 1000000 [--repeat 10] [--server URL]

Creates a private database (``duetime_bench_tags_<random>`` on ``--server``, default
``DUETIME_TEST_DATABASE_URL`` or the loopback server), migrates it, and fills it with
``--jobs`` rows server-side (INSERT ... SELECT, in slices of a million): 97 % finished
over the last 30 days (one bucket a day), 3 % pending over the next 14; 30 % of all
carry a tag ``tenant:K`` (1,000 tenants, 300 of them used), 10 % also ``nightly``,
exactly 100 ``rare``.
Then ``VACUUM ANALYZE`` and, on one pooled connection as the CLI and dashboard use,
``--repeat`` runs of each read: ``JobStore.list`` (first page of 100, by id) and the
dashboard's first page (newest first, and pending soonest first) for a rare tag, a
tenant, the common ``nightly``, two tags together and a tag nobody has; and the bulk
cancel preview of a tenant. Prints p50 and max per read in ms, the planning and
execution time of each ``JobStore.list`` statement and the plan of the tenant's, as
JSON. The database is dropped at the end, whatever happened, unless ``--keep NAME``
names it: then a database of that name is filled once, kept, and measured again as it is
by the next run with the same name (two trees compared on one fill; drop it by hand).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from scheduler import db
from scheduler.migrate import migrate
from scheduler.store.dashboard import DashboardStore
from scheduler.store.jobs import LIST, JobFilter, JobStore

TARGET_MS = 100.0
SLICE = 1_000_000

FILL = """
INSERT INTO duetime.jobs (task, queue, due_at, status, finished_at, tags, payload)
SELECT 'bench.tags', 'q' || (i % 4),
       CASE WHEN i % 100 < 3 THEN now() + (i % 1209600) * interval '1 second'
            ELSE now() - interval '1 minute' - (i % 2588000) * interval '1 second' END,
       CASE WHEN i % 100 < 3 THEN 'pending' ELSE 'succeeded' END,
       CASE WHEN i % 100 < 3 THEN NULL ELSE now() END,
       CASE WHEN i % ($3::bigint / 100) = 7 THEN ARRAY['rare', 'tenant:' || (i % 1000)]
            WHEN i % 10 = 0 THEN ARRAY['tenant:' || (i % 1000), 'nightly']
            WHEN i % 10 < 3 THEN ARRAY['tenant:' || (i % 1000)]
            ELSE '{}' END,
       '{}'
  FROM generate_series($1::bigint, $2::bigint) AS i
"""


def _with_db(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + name, parts.query, ""))


async def _timed(fn: Callable[[], Awaitable[Any]], repeat: int) -> dict[str, float]:
    took = []
    for _ in range(repeat):
        start = time.perf_counter()
        await fn()
        took.append((time.perf_counter() - start) * 1000)
    return {"p50_ms": round(statistics.median(took), 2), "max_ms": round(max(took), 2)}


async def run(server: str, jobs: int, repeat: int, keep: str | None = None) -> dict[str, Any]:
    name = keep or f"duetime_bench_tags_{uuid.uuid4().hex[:8]}"
    admin = await db.connect(server)
    fill = not await admin.fetchval("SELECT count(*) FROM pg_database WHERE datname = $1", name)
    if fill:
        await admin.execute(f'CREATE DATABASE "{name}"')
    url = _with_db(server, name)
    try:
        if fill:
            await migrate(url)
        pool = await db.create_pool(url, min_size=1, max_size=1, timeout=600)
        try:
            return await _measure(pool, jobs, repeat, fill)
        finally:
            await pool.close()
    finally:
        if keep is None:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


async def _measure(pool: Any, jobs: int, repeat: int, fill: bool) -> dict[str, Any]:
    started = time.perf_counter()
    async with pool.acquire() as c:
        if fill:
            await c.execute("SELECT duetime.ensure_partitions(current_date - 31, 32)")
            for first in range(1, jobs + 1, SLICE):
                await c.execute(FILL, first, min(jobs, first + SLICE - 1), jobs, timeout=3600)
        filled = time.perf_counter() - started
        if fill:
            await c.execute("VACUUM ANALYZE duetime.jobs", timeout=3600)
        size = await c.fetchval(
            "SELECT pg_size_pretty(sum(pg_relation_size(i.indexrelid))) FROM pg_inherits h "
            "JOIN pg_index i ON i.indexrelid = h.inhrelid "
            "WHERE h.inhparent = 'duetime.jobs_tags_idx'::regclass"
        )
        counts = dict(
            await c.fetch(
                "SELECT t, count(*) FROM duetime.jobs, unnest(tags) t "
                "WHERE t IN ('rare', 'tenant:2', 'nightly') GROUP BY t"
            )
        )
    store, views = JobStore(pool), DashboardStore(pool)
    filters = {
        "rare": ["rare"],
        "tenant": ["tenant:2"],
        "common": ["nightly"],
        "tenant+common": ["tenant:2", "nightly"],
        "nobody": ["nobody"],
    }
    results: dict[str, Any] = {}
    for label, tags in filters.items():
        where = JobFilter(tags=tags)
        pending = JobFilter(status="pending", tags=tags)
        results[f"list {label}"] = await _timed(lambda t=tags: store.list(tags=t), repeat)
        results[f"dashboard {label}"] = await _timed(
            lambda w=where: views.jobs_page(w, limit=50), repeat
        )
        results[f"dashboard pending {label}"] = await _timed(
            lambda w=pending: views.jobs_page(w, limit=50), repeat
        )
    results["cancel preview tenant"] = await _timed(
        lambda: store.preview_matching("cancel", JobFilter(tags=["tenant:2"])), repeat
    )
    slowest = max(results, key=lambda k: results[k]["max_ms"])
    split: dict[str, Any] = {}  # JobStore.list's statement: planning and execution apart
    plan: list[str] = []
    async with pool.acquire() as c:
        for label, tags in filters.items():
            rows = [
                r[0]
                for r in await c.fetch(
                    "EXPLAIN (ANALYZE, BUFFERS) " + LIST[True],
                    *JobFilter(tags=tags).params(),
                    None,
                    None,
                    100,
                )
            ]
            split[label] = [r for r in rows if r.startswith(("Planning Time", "Execution Time"))]
            if label == "tenant":
                plan = rows
    return {
        "jobs": jobs,
        "fill_seconds": round(filled, 1),
        "tag_index_size": size,
        "matches": counts,
        "repeat": repeat,
        "target_ms": TARGET_MS,
        "results": results,
        "slowest": slowest,
        "list_planning_execution": split,
        "plan_list_tenant": plan,
        "load_average": os.getloadavg(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument(
        "--server",
        default=os.environ.get(
            "DUETIME_TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
        ),
    )
    parser.add_argument("--keep", metavar="NAME", help="fill database NAME once and keep it")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(run(args.server, args.jobs, args.repeat, args.keep)), indent=2))


if __name__ == "__main__":
    main()
