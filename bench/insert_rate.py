"""Insert throughput into duetime.jobs, and what insert triggers cost.

Usage::

    .venv/bin/python -m bench.insert_rate --dsn postgresql://postgres@127.0.0.1:5432/postgres

``--dsn`` names a server (any database on it we may connect to); the script creates a
scratch database of its own, migrates it, measures, drops it, and prints one JSON
document. What it measures:

- ``single_insert_loop``: ``JobStore.enqueue`` one job at a time (one round trip, one
  autocommit transaction per job), the way a web request publishes;
- ``executemany``: asyncpg ``executemany`` of a plain three-column INSERT;
- ``bulk_copy``: ``JobStore.bulk_enqueue`` (one COPY) of 100k and 500k jobs;
- ``trigger_variants`` (``--variants``): the NOTIFY triggers DESIGN §5 weighed, a
  row-level trigger with a WHEN horizon and a statement trigger with a transition table,
  each created for the run and measured enabled vs disabled (``ALTER TABLE ... DISABLE
  TRIGGER``), repeated and interleaved, median and ratio, next to an A/A noise floor;
- ``unique`` (``--only unique``): what migration 0014's unique-key claim costs. Jobs
  without a key, with the BEFORE INSERT trigger ``jobs_unique_claim`` enabled vs
  disabled (paired, as above; disabled is the table as it was before 0014, plus a NULL
  column); then jobs that each carry a distinct key (every insert claims one), and
  duplicates of one key (every insert is skipped), against the keyless rate.

There is no ``trigger`` section any more: it measured the shipped statement trigger
``jobs_notify_insert``, which migration 0004 replaced by the client's NOTIFY (and
dropped), so the section had nothing left to switch off; its numbers stay in
docs/foundation-measurements.md.

Jobs are spread over the next seven days (several daily partitions), with a small
payload, as producers would send them. The table is truncated before every run so each
run starts from the same state.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg

from bench.harness import scratch_database
from scheduler import db
from scheduler.jobspec import JobSpec
from scheduler.log import configure_logging
from scheduler.store import JobStore
from scheduler.store.conn import Conn

WEEK = 7 * 86_400
INSERT = "INSERT INTO duetime.jobs (task, payload, due_at) VALUES ($1, $2, $3)"
UNIQUE_TRIGGER = "jobs_unique_claim"
INSERT_KEYED = (
    "INSERT INTO duetime.jobs (task, payload, due_at, unique_key) VALUES ($1, $2, $3, $4)"
)
WORKLOADS = (
    "copy",
    "single_insert_loop",
    "single_insert_loop_synchronous_commit_off",
    "concurrent_single_inserts",
)

# NOTIFY triggers the design weighed (none ships since migration 0004), for --variants.
VARIANTS: dict[str, list[str]] = {
    # A/A: a trigger that never fires on INSERT. Its "cost" is the machine's noise floor.
    "noise_floor_update_trigger": [
        "CREATE FUNCTION duetime.bench_noop() RETURNS trigger LANGUAGE plpgsql AS "
        "$$ BEGIN RETURN NULL; END $$",
        "CREATE TRIGGER bench_variant AFTER UPDATE ON duetime.jobs FOR EACH STATEMENT "
        "EXECUTE FUNCTION duetime.bench_noop()",
    ],
    "row_when_due_within_5s": [
        "CREATE FUNCTION duetime.bench_notify_row() RETURNS trigger LANGUAGE plpgsql AS "
        "$$ BEGIN PERFORM pg_notify('duetime_jobs', ''); RETURN NULL; END $$",
        "CREATE TRIGGER bench_variant AFTER INSERT ON duetime.jobs FOR EACH ROW "
        "WHEN (NEW.due_at < now() + interval '5 seconds') "
        "EXECUTE FUNCTION duetime.bench_notify_row()",
    ],
    "statement_transition_table_within_5s": [
        "CREATE FUNCTION duetime.bench_notify_stmt() RETURNS trigger LANGUAGE plpgsql AS "
        "$$ BEGIN IF EXISTS (SELECT 1 FROM new_rows WHERE due_at < now() + interval "
        "'5 seconds') THEN PERFORM pg_notify('duetime_jobs', ''); END IF; RETURN NULL; END $$",
        "CREATE TRIGGER bench_variant AFTER INSERT ON duetime.jobs "
        "REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT "
        "EXECUTE FUNCTION duetime.bench_notify_stmt()",
    ],
}
DROP_VARIANT = [
    "DROP TRIGGER IF EXISTS bench_variant ON duetime.jobs",
    "DROP FUNCTION IF EXISTS duetime.bench_notify_row()",
    "DROP FUNCTION IF EXISTS duetime.bench_notify_stmt()",
    "DROP FUNCTION IF EXISTS duetime.bench_noop()",
]


def _specs(n: int, start: datetime, task: str = "bench") -> list[JobSpec]:
    return [
        JobSpec(task, {"i": i, "to": "user@example.com"}, due_at=start + timedelta(seconds=s))
        for i, s in ((i, i % WEEK) for i in range(n))
    ]


def _rate(n: int, seconds: float) -> dict[str, float]:
    return {"jobs": n, "seconds": round(seconds, 3), "jobs_per_s": round(n / seconds)}


class Bench:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool
        self.store = JobStore(pool)

    async def reset(self) -> None:
        """Same starting state for every run: empty table, nothing dirty to flush."""
        # unique_keys too: TRUNCATE fires no trigger, so the keys would stay held
        await self.pool.execute("TRUNCATE duetime.jobs, duetime.unique_keys")
        try:
            await self.pool.execute("CHECKPOINT")
        except asyncpg.PostgresError:
            pass  # not a superuser: runs are a little noisier, nothing else changes

    async def set_trigger(self, name: str, enabled: bool) -> None:
        action = "ENABLE" if enabled else "DISABLE"
        await self.pool.execute(f"ALTER TABLE duetime.jobs {action} TRIGGER {name}")

    async def timed(self, run: Callable[[], Awaitable[Any]]) -> float:
        await self.reset()
        started = time.perf_counter()
        await run()
        return time.perf_counter() - started

    async def _enqueue_many(
        self,
        conn: Conn,
        first: int,
        n: int,
        *,
        due_now: bool = False,
        key: Callable[[int], str | None] = lambda i: None,
    ) -> None:
        start = datetime.now(UTC)
        for i in range(first, first + n):
            await self.store.enqueue(
                "bench",
                {"i": i, "to": "user@example.com"},
                due_at=None if due_now else start + timedelta(seconds=i % WEEK),
                unique_key=key(i),
                conn=conn,
            )

    async def single_loop(self, n: int, *, synchronous_commit: bool = True) -> float:
        """One autocommit INSERT per job. With ``synchronous_commit`` off the WAL flush
        leaves the loop, which isolates the CPU cost of the insert (and of a trigger)."""

        async def run() -> None:
            async with self.pool.acquire() as conn:
                if not synchronous_commit:
                    await conn.execute("SET synchronous_commit = off")
                try:
                    await self._enqueue_many(conn, 0, n)
                finally:
                    await conn.execute("RESET synchronous_commit")

        return await self.timed(run)

    async def keyed_loop(
        self, n: int, key: Callable[[int], str | None], *, synchronous_commit: bool = True
    ) -> float:
        """``single_loop`` with ``unique_key=key(i)``; without ``synchronous_commit`` the
        WAL flush, which dominates and varies with the machine's load, leaves the loop."""

        async def run() -> None:
            async with self.pool.acquire() as conn:
                if not synchronous_commit:
                    await conn.execute("SET synchronous_commit = off")
                try:
                    await self._enqueue_many(conn, 0, n, key=key)
                finally:
                    await conn.execute("RESET synchronous_commit")

        return await self.timed(run)

    async def keyed_executemany(self, n: int, key: Callable[[int], str | None]) -> float:
        start = datetime.now(UTC)
        rows = [("bench", {"i": i}, start + timedelta(seconds=i % WEEK), key(i)) for i in range(n)]

        async def run() -> None:
            async with self.pool.acquire() as conn:
                await conn.executemany(INSERT_KEYED, rows)

        return await self.timed(run)

    async def unique_cost(self, args: argparse.Namespace) -> dict[str, Any]:
        single_n, many_n, copy_n = args.trigger_single, args.many, args.trigger_copy
        out: dict[str, Any] = {
            "null_key_trigger_on_vs_off": {
                "single_insert_loop": await self.paired(
                    UNIQUE_TRIGGER, lambda: self.single_loop(single_n), single_n, args.repeat
                ),
                "executemany": await self.paired(
                    UNIQUE_TRIGGER, lambda: self.executemany(many_n), many_n, args.repeat
                ),
                "copy": await self.paired(
                    UNIQUE_TRIGGER, lambda: self.copy(copy_n), copy_n, args.repeat
                ),
            }
        }
        distinct: Callable[[int], str | None] = lambda i: f"key:{i}"  # noqa: E731
        same: Callable[[int], str | None] = lambda i: "one-key"  # noqa: E731
        none: Callable[[int], str | None] = lambda i: None  # noqa: E731
        loops: dict[str, list[float]] = {"no_key": [], "distinct_keys": [], "one_key_skipped": []}
        quick: dict[str, list[float]] = {"no_key": [], "distinct_keys": [], "one_key_skipped": []}
        many: dict[str, list[float]] = {"no_key": [], "distinct_keys": [], "one_key_skipped": []}
        for _ in range(args.repeat):
            for name, key in (
                ("no_key", none),
                ("distinct_keys", distinct),
                ("one_key_skipped", same),
            ):
                loops[name].append(await self.keyed_loop(single_n, key))
                quick[name].append(await self.keyed_loop(single_n, key, synchronous_commit=False))
                many[name].append(await self.keyed_executemany(many_n, key))
        out["enqueue_loop_jobs_per_s"] = {
            k: round(single_n / statistics.median(v)) for k, v in loops.items()
        }
        out["enqueue_loop_synchronous_commit_off_jobs_per_s"] = {
            k: round(single_n / statistics.median(v)) for k, v in quick.items()
        }
        out["executemany_jobs_per_s"] = {
            k: round(many_n / statistics.median(v)) for k, v in many.items()
        }
        out["enqueue_loop_jobs"] = single_n
        out["executemany_jobs"] = many_n
        out["repeat"] = args.repeat
        return out

    async def concurrent_loop(self, n: int, producers: int) -> float:
        """``producers`` connections inserting one job per transaction at once, due now
        (fire-and-forget producers): every commit that carries a NOTIFY takes
        PostgreSQL's global notify lock, held through the commit's WAL flush."""
        share = n // producers

        async def one(k: int) -> None:
            async with self.pool.acquire() as conn:
                await self._enqueue_many(conn, k * share, share, due_now=True)

        async def run() -> None:
            await asyncio.gather(*(one(k) for k in range(producers)))

        return await self.timed(run)

    async def executemany(self, n: int) -> float:
        start = datetime.now(UTC)
        rows = [
            ("bench", {"i": i, "to": "user@example.com"}, start + timedelta(seconds=i % WEEK))
            for i in range(n)
        ]

        async def run() -> None:
            async with self.pool.acquire() as conn:
                await conn.executemany(INSERT, rows)

        return await self.timed(run)

    async def copy(self, n: int) -> float:
        specs = _specs(n, datetime.now(UTC))

        async def run() -> None:
            assert await self.store.bulk_enqueue(specs) == n

        return await self.timed(run)

    async def paired(
        self, trigger: str, measure: Callable[[], Awaitable[float]], n: int, repeat: int
    ) -> dict[str, Any]:
        """Runs with and without ``trigger`` in adjacent pairs (order alternating), so
        load from other processes on the machine hits both sides of each pair alike; the
        cost is the median of the per-pair time ratios."""
        await measure()  # warm-up: connections, prepared statements, caches
        on: list[float] = []
        off: list[float] = []
        for rep in range(repeat):
            for enabled in (True, False) if rep % 2 == 0 else (False, True):
                await self.set_trigger(trigger, enabled)
                (on if enabled else off).append(await measure())
        await self.set_trigger(trigger, True)
        ratios = [a / b for a, b in zip(on, off, strict=True)]
        ratio = statistics.median(ratios)
        return {
            "jobs": n,
            "repeat": repeat,
            "enabled_seconds": [round(t, 3) for t in on],
            "disabled_seconds": [round(t, 3) for t in off],
            "median_enabled_jobs_per_s": round(n / statistics.median(on)),
            "median_disabled_jobs_per_s": round(n / statistics.median(off)),
            "pair_ratios": [round(r, 3) for r in ratios],
            "median_time_ratio_enabled_over_disabled": round(ratio, 3),
            "cost_percent": round((ratio - 1) * 100, 1),
        }

    async def trigger_cost(self, trigger: str, args: argparse.Namespace) -> dict[str, Any]:
        copy_n, single_n, producers = args.trigger_copy, args.trigger_single, args.producers
        runs: dict[str, tuple[Callable[[], Awaitable[float]], int]] = {
            "copy": (lambda: self.copy(copy_n), copy_n),
            "single_insert_loop": (lambda: self.single_loop(single_n), single_n),
            "single_insert_loop_synchronous_commit_off": (
                lambda: self.single_loop(single_n, synchronous_commit=False),
                single_n,
            ),
            "concurrent_single_inserts": (
                lambda: self.concurrent_loop(single_n, producers),
                single_n,
            ),
        }
        out: dict[str, Any] = {}
        for name in WORKLOADS:
            if name in args.workloads:
                measure, n = runs[name]
                out[name] = await self.paired(trigger, measure, n, args.repeat)
                if name == "concurrent_single_inserts":
                    out[name]["producers"] = producers
        return out

    async def variant(self, name: str, args: argparse.Namespace) -> dict[str, Any]:
        """A NOTIFY trigger vs no trigger at all (the table as migrated has none)."""
        for sql in VARIANTS[name]:
            await self.pool.execute(sql)
        try:
            return await self.trigger_cost("bench_variant", args)
        finally:
            for sql in DROP_VARIANT:
                await self.pool.execute(sql)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    async with scratch_database(args.dsn) as (url, result):
        pool = await db.create_pool(url, min_size=1, max_size=args.producers, timeout=30)
        try:
            bench = Bench(pool)
            if "throughput" in args.only:
                await bench.single_loop(min(args.single, 500))  # warm-up
                result["single_insert_loop"] = _rate(
                    args.single, await bench.single_loop(args.single)
                )
                result["executemany"] = _rate(args.many, await bench.executemany(args.many))
                result["bulk_copy"] = [_rate(n, await bench.copy(n)) for n in args.bulk]
            if "unique" in args.only:
                result["unique"] = await bench.unique_cost(args)
            if args.variants:
                result["trigger_variants"] = {v: await bench.variant(v, args) for v in VARIANTS}
        finally:
            await pool.close()
    return result


SECTIONS = ("throughput", "unique")


def sections(text: str) -> set[str]:
    """``--only``: a comma-separated subset of ``SECTIONS``."""
    chosen = set(text.split(","))
    if "trigger" in chosen:
        raise argparse.ArgumentTypeError(
            "the trigger section was removed with jobs_notify_insert (migration 0004); "
            "--variants measures NOTIFY triggers against none"
        )
    unknown = chosen - set(SECTIONS)
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown section(s) {', '.join(sorted(unknown))} (one of {', '.join(SECTIONS)})"
        )
    return chosen


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dsn",
        default="postgresql://postgres@127.0.0.1:5432/postgres",
        help="server to use (a scratch database is created and dropped on it)",
    )
    parser.add_argument("--single", type=int, default=5000, help="jobs in the enqueue loop")
    parser.add_argument("--many", type=int, default=50_000, help="jobs in the executemany")
    parser.add_argument(
        "--bulk",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[100_000, 500_000],
        help="comma-separated COPY sizes",
    )
    parser.add_argument("--trigger-copy", type=int, default=200_000)
    parser.add_argument("--trigger-single", type=int, default=2000)
    parser.add_argument("--producers", type=int, default=8, help="concurrent inserters")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument(
        "--variants", action="store_true", help="also measure alternatives and the noise floor"
    )
    parser.add_argument(
        "--only",
        type=sections,
        default={"throughput"},
        help=f"sections to run: {','.join(SECTIONS)} (default throughput)",
    )
    parser.add_argument(
        "--workloads",
        type=lambda v: set(v.split(",")),
        default=set(WORKLOADS),
        help=f"--variants workloads (default all): {','.join(WORKLOADS)}",
    )
    return parser.parse_args(argv)


if __name__ == "__main__":
    configure_logging("warning", "json")  # logs to stderr; stdout is the JSON result
    print(json.dumps(asyncio.run(main(parse_args())), indent=2))
