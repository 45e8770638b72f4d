"""Workflows (migration 0025): what a fan-in costs per member completion, and whether it
stays flat as the members finish; docs/benchmarks.md, "Workflows".

Usage::

    .venv/bin/python bench/workflows.py [--dsn postgresql://postgres@127.0.0.1:5432/postgres]
        [--members 10000] [--connections 1,4]

In a scratch database of its own: ``--members`` jobs marked ``dispatched`` are settled
one per transaction by the worker's own settling function (``duetime.worker_complete``,
autocommit, as the worker's batched completion does), from ``--connections`` concurrent
sessions. Two groups are measured alternately in the same run:

- ``plain``: members nobody waits for (the release trigger's WHEN is false: the cost of
  the feature for jobs without dependents);
- ``fan_in``: the same number of members and one callback waiting for all of them
  (``depends_on`` of 10,000 ids); each completion deletes its edge and probes for a
  remaining one (the three cases of migration 0025's header).

- ``counter``: the design not chosen, emulated: the plain group's completions, each
  also decrementing one shared counter row in the same statement (what a "remaining
  dependencies" counter on the callback would do).

Reported per group and concurrency: completions/s, the mean latency of a completion in
each tenth of the run (flat = the last tenth costs what the first did), and, for
``fan_in``, that the callback ended ``pending`` exactly once with no edge left.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import asyncpg

from bench.harness import scratch_database

SETTLE = (
    "SELECT duetime.worker_complete(ARRAY[$1::bigint], ARRAY[$2::timestamptz], ARRAY[1], "
    "'bench', ARRAY[NULL::jsonb])"
)
#: the design not chosen, emulated: every completion also decrements one counter row of
#: the callback, in the same statement (so in the same transaction, no extra round trip)
SETTLE_COUNTER = (
    "WITH s AS (" + SETTLE + " AS done) UPDATE bench_counter SET n = n - 1 FROM s WHERE id = 1"
)


async def _group(conn: asyncpg.Connection, n: int, callback: bool) -> tuple[list[Any], int | None]:
    rows = await conn.fetch(
        "INSERT INTO duetime.jobs (task, queue) SELECT 'bench.member', 'bench' "
        "FROM generate_series(1, $1) RETURNING id, due_at",
        n,
    )
    await conn.execute(
        "UPDATE duetime.jobs SET status = 'dispatched', dispatched_at = now(), "
        "dispatch_epoch = 0 WHERE id = ANY($1)",
        [r["id"] for r in rows],
    )
    cb = None
    if callback:
        cb = await conn.fetchval(
            "INSERT INTO duetime.jobs (task, queue, depends_on) "
            "VALUES ('bench.callback', 'bench', $1) RETURNING id",
            [r["id"] for r in rows],
        )
    return list(rows), cb


async def _settle(
    pool: asyncpg.Pool, rows: list[Any], connections: int, sql: str = SETTLE
) -> tuple[float, list[float]]:
    """Settle ``rows`` from ``connections`` sessions; (seconds, latency per completion in
    row order, ms)."""
    lat = [0.0] * len(rows)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(rows)):
        queue.put_nowait(i)

    async def session() -> None:
        async with pool.acquire() as c:
            while not queue.empty():
                i = queue.get_nowait()
                t0 = time.perf_counter()
                await c.fetchval(sql, rows[i]["id"], rows[i]["due_at"])
                lat[i] = (time.perf_counter() - t0) * 1000

    started = time.perf_counter()
    await asyncio.gather(*(session() for _ in range(connections)))
    return time.perf_counter() - started, lat


def _tenths(lat: list[float]) -> list[float]:
    size = max(1, len(lat) // 10)
    return [round(statistics.fmean(lat[k : k + size]), 3) for k in range(0, size * 10, size)]


async def run(dsn: str, members: int, connections: list[int], async_commit: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"members": members, "async_commit": async_commit, "runs": []}
    settings = {"synchronous_commit": "off"} if async_commit else {}
    async with scratch_database(dsn) as (url, head):
        out.update(head)
        pool = await asyncpg.create_pool(
            url, min_size=1, max_size=max(connections) + 1, server_settings=settings
        )
        try:
            await pool.execute("CREATE TABLE bench_counter (id int PRIMARY KEY, n int)")
            for c in connections:
                for kind in ("plain", "fan_in", "counter") * 2:  # alternate
                    async with pool.acquire() as conn:
                        rows, cb = await _group(conn, members, kind == "fan_in")
                        await conn.execute(
                            "INSERT INTO bench_counter VALUES (1, $1) "
                            "ON CONFLICT (id) DO UPDATE SET n = $1",
                            members,
                        )
                        await conn.execute("ANALYZE duetime.jobs")
                        await conn.execute("ANALYZE duetime.job_dependencies")
                    sql = SETTLE_COUNTER if kind == "counter" else SETTLE
                    took, lat = await _settle(pool, rows, c, sql)
                    entry: dict[str, Any] = {
                        "group": kind,
                        "connections": c,
                        "completions_per_s": round(members / took),
                        "mean_ms_by_tenth": _tenths(lat),
                        "p99_ms": round(statistics.quantiles(lat, n=100)[98], 3),
                    }
                    if cb is not None:
                        async with pool.acquire() as conn:
                            entry["callback_status"] = await conn.fetchval(
                                "SELECT status FROM duetime.jobs WHERE id = $1", cb
                            )
                            entry["edges_left"] = await conn.fetchval(
                                "SELECT count(*) FROM duetime.job_dependencies"
                            )
                    out["runs"].append(entry)
                    print(json.dumps(entry), flush=True)
        finally:
            await pool.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--dsn", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--members", type=int, default=10_000)
    parser.add_argument("--connections", default="1,4")
    parser.add_argument(
        "--async-commit",
        action="store_true",
        help="synchronous_commit=off: the statements' cost without the WAL flush",
    )
    args = parser.parse_args()
    conns = [int(x) for x in args.connections.split(",")]
    result = asyncio.run(run(args.dsn, args.members, conns, args.async_commit))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
