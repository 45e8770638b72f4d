"""Bulk schedule pause: one ``UPDATE duetime.schedules SET paused = ...`` over N schedules.

Usage::

    .venv/bin/python bench/schedule_pause.py --dsn postgresql://postgres@127.0.0.1:5432/postgres

Creates a scratch database, migrates it, inserts ``--schedules`` (default 10,000)
schedules firing every second, each with the ``--planned`` (default 10) jobs and fire
times the planner keeps ahead of it (as the planner writes them: pending, due within
the horizon) and ``--history-days`` (default 90) daily job buckets behind today, as a
scheduler that keeps three months of history has them, then times, on the same rows,
with the pause trigger of migration 0006 (per row, ``before``) and of migration 0011 (per
statement, ``after``):

- ``pause``: ``UPDATE duetime.schedules SET paused = true`` (cancels the planned jobs);
- ``resume``: ``UPDATE duetime.schedules SET paused = false``.

Each variant runs in a transaction that is rolled back, so both see the same data; the
``before`` one first swaps the 0006 row trigger back in. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import asyncpg

from bench.harness import scratch_database

# The triggers as migration 0006 created them (per row), under a name of their own.
ROW_TRIGGERS_0006 = """
CREATE FUNCTION duetime.cancel_planned_jobs_0006() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    cancelled bigint;
BEGIN
    WITH done AS (
        UPDATE duetime.jobs
           SET status = 'cancelled', finished_at = now()
         WHERE schedule_id = OLD.id AND status = 'pending' AND due_at > now()
        RETURNING id
    ), forgotten AS (
        DELETE FROM duetime.schedule_fires f
         USING done d
         WHERE f.schedule_id = OLD.id AND f.job_id = d.id
    )
    SELECT count(*) INTO cancelled FROM done;
    PERFORM set_config('duetime.planned_jobs_cancelled', cancelled::text, true);
    RETURN CASE WHEN TG_OP = 'DELETE' THEN OLD ELSE NULL END;
END $$;
DROP TRIGGER schedules_paused_cancel_planned ON duetime.schedules;
CREATE TRIGGER schedules_paused_cancel_planned AFTER UPDATE OF paused ON duetime.schedules
    FOR EACH ROW WHEN (NEW.paused AND NOT OLD.paused)
    EXECUTE FUNCTION duetime.cancel_planned_jobs_0006();
"""

SEED = """
INSERT INTO duetime.schedules (name, task, interval)
SELECT 'every-second-' || i, 'bench.noop', interval '1 second'
  FROM generate_series(1, $1) AS i;
WITH planned AS (
    INSERT INTO duetime.jobs (task, due_at, schedule_id, idempotency_key)
    SELECT 'bench.noop', date_trunc('second', now()) + (30 + k) * interval '1 second', s.id,
           'schedule:' || s.id || ':' || k
      FROM duetime.schedules s, generate_series(1, $2) AS k
    RETURNING id, schedule_id, due_at
)
INSERT INTO duetime.schedule_fires (schedule_id, fire_time, job_id, due_at)
SELECT schedule_id, due_at, id, due_at FROM planned;
"""


async def _timed(conn: asyncpg.Connection, sql: str) -> tuple[float, str]:
    began = time.perf_counter()
    status = await conn.execute(sql)
    return time.perf_counter() - began, status


async def measure(conn: asyncpg.Connection, variant: str) -> dict[str, Any]:
    """Pause then resume every schedule, in a transaction rolled back at the end."""
    tr = conn.transaction()
    await tr.start()
    try:
        if variant == "before":
            await conn.execute(ROW_TRIGGERS_0006)
        pause, status = await _timed(conn, "UPDATE duetime.schedules SET paused = true")
        cancelled = await conn.fetchval(
            "SELECT count(*) FROM duetime.jobs WHERE status = 'cancelled'"
        )
        resume, _ = await _timed(conn, "UPDATE duetime.schedules SET paused = false")
        return {
            "pause_seconds": round(pause, 3),
            "paused": int(status.split()[-1]),
            "jobs_cancelled": cancelled,
            "resume_seconds": round(resume, 3),
        }
    finally:
        await tr.rollback()


async def main(args: argparse.Namespace) -> dict[str, Any]:
    async with scratch_database(args.dsn) as (url, result):
        result.update(
            schedules=args.schedules,
            planned_jobs_per_schedule=args.planned,
            history_days=args.history_days,
        )
        conn = await asyncpg.connect(url, timeout=10)
        try:
            await conn.execute(
                "SELECT count(duetime.ensure_partition(current_date - i))"
                " FROM generate_series(1, $1) AS i",
                args.history_days,
            )
            await conn.execute(
                SEED.replace("$1", str(args.schedules)).replace("$2", str(args.planned))
            )
            await conn.execute("VACUUM ANALYZE duetime.schedules, duetime.schedule_fires")
            await conn.execute("ANALYZE duetime.jobs")
            for variant in ("before", "after"):
                result[variant] = await measure(conn, variant)
        finally:
            await conn.close()
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dsn",
        default="postgresql://postgres@127.0.0.1:5432/postgres",
        help="server to use (a scratch database is created and dropped on it)",
    )
    parser.add_argument("--schedules", type=int, default=10_000)
    parser.add_argument("--planned", type=int, default=10, help="planned jobs per schedule")
    parser.add_argument("--history-days", type=int, default=90, help="daily buckets before today")
    return parser.parse_args(argv)


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(parse_args())), indent=2))
