"""What concurrency limits cost the dispatcher's claim, on N pending due rows.

Usage::

    .venv/bin/python bench/limits_claim.py --dsn postgresql://postgres@127.0.0.1:5432/postgres

Creates a scratch database, migrates it, declares one queue and inserts ``--rows``
(default 200,000) pending jobs of task ``bench.noop`` due over the last 20 hours, of
which every tenth is of task ``bench.limited`` with one of 100 ``limit_key`` values,
plus 1,000 dispatched ``bench.limited`` jobs; ``ANALYZE``; then times each statement
a claim pass runs, in a transaction that is rolled back:

- ``before``: the claim as migration 0015 left it (no task filter);
- ``no_limits``: this tree's general claim with no limit (an empty ``skip_tasks``);
- ``general_skipping_limited``: the general claim skipping the limited task (its due
  rows are stepped over);
- ``counts``: the grouped count of dispatched jobs of the limited task;
- ``limited_claim``: the limited claim (limits.sql ``claim``), nothing closed;
- ``limited_claim_keys_closed``: the same with 50 of the 100 keys closed (per key);
- ``fair_claim_ranking``: the fair claim's ranking over the queue (limits.sql
  ``claim_fair``: 100 keys and the keyless jobs, round-robin), before its lock by id;
- ``limited_claim_room_3``: the limited claim locking at most 3 (a ``--max-running``
  with 3 slots free), as PostgreSQL plans it by itself (a custom plan on every
  execution: the generic one, costed for a tenth of the rows, looks dearer);
- ``*_generic``: ``counts``, ``limited_claim`` and ``limited_claim_room_3`` with
  ``plan_cache_mode = force_generic_plan``, as the dispatcher runs them
  (``LimitStore.generic_plans``).

Prints (and with ``--out`` writes) one JSON document: per variant the median and p95
milliseconds over ``--runs``.
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
from scheduler.sql import load
from scheduler.store.dispatch import claim_sql

QUEUE = "bench"
LIMITED = "bench.limited"
L = load("limits")

BEFORE = """
WITH aged AS MATERIALIZED (
 SELECT id, task, queue, due_at, run_at, attempt
   FROM duetime.jobs AS j
  WHERE status = 'pending'
    AND coalesce(run_at, due_at) <= now() - make_interval(secs => 300.0)
    AND due_at <= now()
    AND queue <> ALL(ARRAY[]::text[])
    AND EXISTS (SELECT 1 FROM duetime.queues AS q WHERE q.name = j.queue)
  ORDER BY coalesce(run_at, due_at)
  LIMIT {limit}
    FOR UPDATE SKIP LOCKED)
SELECT * FROM aged
UNION ALL
SELECT * FROM (
 SELECT id, task, queue, due_at, run_at, attempt
   FROM duetime.jobs AS j
  WHERE status = 'pending'
    AND coalesce(run_at, due_at) <= now()
    AND due_at <= now()
    AND queue <> ALL(ARRAY[]::text[])
    AND EXISTS (SELECT 1 FROM duetime.queues AS q WHERE q.name = j.queue)
    AND j.id <> ALL (ARRAY(SELECT aged.id FROM aged))
  ORDER BY priority DESC, coalesce(run_at, due_at)
  LIMIT {limit}
    FOR UPDATE SKIP LOCKED) AS fresh
 LIMIT {limit}
"""

DUE = """
INSERT INTO duetime.jobs (task, payload, due_at, queue, limit_key)
SELECT CASE WHEN i % 10 = 0 THEN $3 ELSE 'bench.noop' END, '{}'::jsonb,
       now() - make_interval(secs => 72000.0 * i / $1),
       $2,
       CASE WHEN i % 10 = 0 THEN 'k' || (i / 10) % 100 END
  FROM generate_series(1, $1) AS i
"""

DISPATCHED = """
UPDATE duetime.jobs SET status = 'dispatched', dispatched_at = now(), dispatch_epoch = 0
 WHERE id IN (SELECT id FROM duetime.jobs WHERE task = $1 ORDER BY id LIMIT 1000)
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
            await conn.execute(DUE, rows, QUEUE, LIMITED)
            await conn.execute(DISPATCHED, LIMITED)
            await conn.execute("ANALYZE duetime.jobs")
            keys = [f"k{i}" for i in range(0, 100, 2)]
            claim_args = [[LIMITED], [], [], [], [], [], [], [], limit]
            closed_args = [[LIMITED], [], [], [], [LIMITED] * len(keys), keys, [], [], limit]
            variants: dict[str, tuple[str, list[Any]]] = {
                "before": (BEFORE.format(limit=limit), []),
                "no_limits": (claim_sql(limit, max_wait=300.0), []),
                "general_skipping_limited": (
                    claim_sql(limit, max_wait=300.0, skip_tasks=(LIMITED,)),
                    [],
                ),
                "counts": (L["counts"], [[LIMITED], []]),
                "limited_claim": (L["claim"], claim_args),
                "limited_claim_keys_closed": (L["claim"], closed_args),
                "fair_claim_ranking": (L["claim_fair"], [QUEUE, limit]),
                "limited_claim_room_3": (L["claim"], [*claim_args[:-1], 3]),
            }
            for name in ("counts", "limited_claim", "limited_claim_room_3"):
                variants[f"{name}_generic"] = variants[name]
            out: dict[str, Any] = {**head, "rows": rows, "limit": limit}
            for name, (sql, args) in variants.items():
                # a connection of its own: PostgreSQL's choice of plan for a prepared
                # statement depends on the executions before it
                own = await asyncpg.connect(url, timeout=10)
                try:
                    mode = "force_generic_plan" if name.endswith("_generic") else "auto"
                    await own.execute(f"SET plan_cache_mode = {mode}")
                    await _time(own, sql, args, 5)  # warm the cache and the prepared plan
                    times = sorted(await _time(own, sql, args, runs))
                finally:
                    await own.close()
                out[name] = {
                    "median_ms": round(statistics.median(times), 3),
                    "p95_ms": round(times[int(0.95 * (len(times) - 1))], 3),
                }
            return out
        finally:
            await conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--limit", type=int, default=500)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--out", type=Path, help="also write the JSON document here")
    args = parser.parse_args()
    text = json.dumps(asyncio.run(run(args.dsn, args.rows, args.limit, args.runs)), indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
