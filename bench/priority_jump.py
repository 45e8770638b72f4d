"""Priority under a backlog: high-priority jobs overtake a backlog being worked off.

Usage::

    .venv/bin/python -m bench.priority_jump [--backlog 10000] [--high 20] [--concurrency 32]

One ``duetime scheduler`` and one ``duetime worker`` (``bench.record``, one ``ctx.db``
INSERT) on a scratch database and queue (``bench.harness.Sandbox``); ``--backlog``
priority-0 jobs due now, inserted by plain SQL; once 10 % of them started, ``--high``
jobs of priority 10 due now, inserted by plain SQL too (no NOTIFY: found by the
dispatcher's probe). Reported, from the handlers' own start records: each high job's
start − its insert (max = p99 for 20 jobs), and how many of the backlog still waiting at
that insert started before the last high job did (the issue's target: under 5 %).
Prints one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from bench.harness import Sandbox, Services
from bench.report import load_average, machine, now_iso
from bench.tasks import STARTS_TABLE
from scheduler.config import load_settings

INSERT = """
INSERT INTO duetime.jobs (task, payload, queue, priority)
SELECT 'bench.record', jsonb_build_object('i', i), $1, $2 FROM generate_series(1, $3) AS i
RETURNING id
"""


async def run(backlog: int, high: int, concurrency: int, buffer: int | None) -> dict[str, Any]:
    services = Services.from_settings(load_settings())
    load_start = load_average()
    async with Sandbox(services, "prio") as sb:
        extra = {"DUETIME_DISPATCH_BUFFER": str(buffer)} if buffer else {}
        await sb.start_scheduler(**extra)
        await sb.start_worker(concurrency)
        await sb.db.fetch(INSERT, sb.queue, 0, backlog)
        await sb.wait_started(backlog // 10, 120)
        started_before = await sb.started_count()
        inserted_at = time.time()
        ids = [r["id"] for r in await sb.db.fetch(INSERT, sb.queue, 10, high)]
        deadline = time.monotonic() + 60
        starts: dict[int, float] = {}
        while len(starts) < high and time.monotonic() < deadline:
            rows = await sb.db.fetch(
                f"SELECT job_id, min(started_at) AS s FROM {STARTS_TABLE} "
                "WHERE job_id = ANY($1::bigint[]) GROUP BY job_id",
                ids,
            )
            starts = {r["job_id"]: float(r["s"]) for r in rows}
            await asyncio.sleep(0.05)
        last_high = max(starts.values(), default=None)
        overtaken = (
            await sb.db.fetchval(
                f"SELECT count(DISTINCT job_id) FROM {STARTS_TABLE} "
                "WHERE started_at > $1 AND started_at <= $2 AND NOT job_id = ANY($3::bigint[])",
                inserted_at,
                last_high,
                ids,
            )
            if last_high is not None
            else None
        )
    waiting = backlog - started_before
    lags = sorted(s - inserted_at for s in starts.values())
    return {
        "scenario": "priority_jump",
        "started_at": now_iso(),
        "machine": machine(),
        "params": {
            "backlog": backlog,
            "high": high,
            "concurrency": concurrency,
            "dispatch_buffer": buffer,
        },
        "backlog_waiting_at_insert": waiting,
        "high_started": len(starts),
        "high_lag_ms": {
            "p50": round(lags[len(lags) // 2] * 1000, 1) if lags else None,
            "max": round(lags[-1] * 1000, 1) if lags else None,
        },
        "backlog_started_before_last_high": overtaken,
        "share_of_waiting_backlog": round(overtaken / waiting, 4) if overtaken else overtaken,
        "load_avg_start": load_start,
        "load_avg_end": load_average(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backlog", type=int, default=10_000)
    parser.add_argument("--high", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--dispatch-buffer", type=int, help="the scheduler's dispatch_buffer")
    args = parser.parse_args()
    result = run(args.backlog, args.high, args.concurrency, args.dispatch_buffer)
    print(json.dumps(asyncio.run(result)))


if __name__ == "__main__":
    main()
