"""The dispatcher's claim before and after priorities, on N pending due rows.

Usage::

    .venv/bin/python bench/priority_claim.py --dsn postgresql://postgres@127.0.0.1:5432/postgres

Creates a scratch database, migrates it, declares one queue and inserts ``--rows``
(default 200,000) pending jobs due over the last 20 hours (90 % priority 0, 9 % -5..5,
1 % priority 10) plus 50,000 pending jobs due tomorrow, ``ANALYZE``, then on the same
rows times a claim of ``--limit`` (default 500) rows, each in a transaction that is
rolled back:

- ``before``: the claim as it was (run time order only);
- ``after_aged``: this tree's claim with ``priority_max_wait`` 300 s (most rows waited
  longer: the aged branch, oldest first, serves the claim);
- ``after_fresh``: this tree's claim with a wait of two days (no row aged: the priority
  branch serves it).

Prints (and with ``--out`` writes) one JSON document: per variant the median and p95
milliseconds over ``--runs`` and the ``EXPLAIN (ANALYZE, COSTS OFF)`` plan.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

import asyncpg

from bench.harness import scratch_database
from scheduler.store.dispatch import claim_sql

QUEUE = "bench"

BEFORE = """
SELECT id, task, queue, due_at, run_at, attempt
  FROM duetime.jobs AS j
 WHERE status = 'pending'
   AND coalesce(run_at, due_at) <= now()
   AND due_at <= now()
   AND EXISTS (SELECT 1 FROM duetime.queues AS q WHERE q.name = j.queue)
 ORDER BY coalesce(run_at, due_at)
 LIMIT {limit}
   FOR UPDATE SKIP LOCKED
"""

DUE = """
INSERT INTO duetime.jobs (task, payload, due_at, queue, priority)
SELECT 'bench.noop', '{}'::jsonb,
       now() - make_interval(secs => 72000.0 * i / $1),
       $2,
       CASE WHEN i % 100 = 0 THEN 10 WHEN i % 10 = 0 THEN (i / 10) % 11 - 5 ELSE 0 END
  FROM generate_series(1, $1) AS i
"""

FUTURE = """
INSERT INTO duetime.jobs (task, payload, due_at, queue)
SELECT 'bench.noop', '{}'::jsonb, now() + interval '1 day' + make_interval(secs => i), $1
  FROM generate_series(1, 50000) AS i
"""


async def _time(conn: asyncpg.Connection, sql: str, args: list[Any], runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        tr = conn.transaction()
        await tr.start()
        started = time.perf_counter()
        await conn.fetch(sql, *args)
        times.append((time.perf_counter() - started) * 1000)
        await tr.rollback()
    return times


async def run(dsn: str, rows: int, limit: int, runs: int) -> dict[str, Any]:
    async with scratch_database(dsn) as (url, head):
        conn = await asyncpg.connect(url, timeout=10)
        try:
            await conn.execute("INSERT INTO duetime.queues (name) VALUES ($1)", QUEUE)
            started = time.perf_counter()
            await conn.execute(DUE, rows, QUEUE)
            await conn.execute(FUTURE, QUEUE)
            load_s = time.perf_counter() - started
            await conn.execute("ANALYZE duetime.jobs")
            variants: dict[str, tuple[str, list[Any]]] = {
                "before": (BEFORE.format(limit=limit), []),
                "after_aged": (claim_sql(limit, max_wait=300.0), []),
                "after_fresh": (claim_sql(limit, max_wait=2 * 86400.0), []),
            }
            out: dict[str, Any] = {**head, "rows": rows, "limit": limit, "load_s": load_s}
            for name, (sql, args) in variants.items():
                await _time(conn, sql, args, 5)  # warm the cache and the prepared plan
                times = sorted(await _time(conn, sql, args, runs))
                tr = conn.transaction()
                await tr.start()
                plan = await conn.fetch(f"EXPLAIN (ANALYZE, COSTS OFF) {sql}", *args)
                await tr.rollback()
                out[name] = {
                    "median_ms": round(statistics.median(times), 3),
                    "p95_ms": round(times[int(0.95 * (len(times) - 1))], 3),
                    "plan": [r[0] for r in plan],
                }
            return out
        finally:
            await conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--limit", type=int, default=500)
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--out", type=Path, help="also write the JSON document here")
    args = parser.parse_args()
    text = json.dumps(asyncio.run(run(args.dsn, args.rows, args.limit, args.runs)), indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
