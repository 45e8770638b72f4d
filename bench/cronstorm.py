"""``cronstorm``: M schedules on one cron expression, all firing at the same instant.

The top of the minute (``0 * * * * *``, seconds first) is when most crontabs fire: M
schedules are created with plain SQL at least ``lead`` seconds before the next such
instant, the planner inserts their jobs within its horizon, and the scenario waits
until each of the M jobs of that fire time has started. Reported: lag percentiles
(handler start − fire time), duplicates, and the CPU per job of the scheduler, the
worker, PostgreSQL and RabbitMQ from the schedules' creation to the last start.
``--stage-ahead`` sets the scheduler's staging horizon (0: off): with staging, the jobs
reach the worker before the fire time and start from its timer.

Only alone (``duetime bench cronstorm``): it waits for a cron instant, up to a minute.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from croniter import croniter

from bench.cpu import CpuMeter
from bench.harness import Sandbox, Services
from bench.lag import summarize
from bench.report import load_average, now_iso, plot_lag
from bench.tasks import STARTS_TABLE

TARGETS = {"lag_p99_ms": 250.0}
CREATE_SCHEDULES = (
    "INSERT INTO duetime.schedules (name, task, cron, queue) "
    "SELECT 'cron-' || i, 'bench.record', $2, $3 FROM generate_series(1, $1) i"
)


@dataclass(frozen=True)
class CronStormParams:
    schedules: int = 5000
    cron: str = "0 * * * * *"
    lead: float = 12.0  # seconds between the schedules' creation and the fire time, at least
    concurrency: int = 64
    stage_ahead: float | None = None  # the scheduler's DUETIME_STAGE_AHEAD (None: default)

    @classmethod
    def quick(cls) -> CronStormParams:
        return cls(schedules=50, cron="*/5 * * * * *", lead=5.0)


def next_fire(cron: str, after: float) -> float:
    """The first instant of ``cron`` (UTC, seconds first) at or after ``after``."""
    start = datetime.fromtimestamp(after - 1, UTC)
    return float(croniter(cron, start, second_at_beginning=True).get_next(float))


async def run(services: Services, params: CronStormParams, plot_path: Path) -> dict[str, Any]:
    load_start = load_average()
    m = params.schedules
    staging = {} if params.stage_ahead is None else {"DUETIME_STAGE_AHEAD": str(params.stage_ahead)}
    async with Sandbox(services, "cronstorm") as sb:
        scheduler = await sb.start_scheduler(**staging)
        worker = await sb.start_worker(params.concurrency)
        meter = CpuMeter({"scheduler": [scheduler.pid], "workers": [worker.pid]})
        fire = next_fire(params.cron, time.time() + params.lead)
        meter.start()
        began = time.perf_counter()
        await sb.db.execute(CREATE_SCHEDULES, m, params.cron, sb.queue)
        started = (
            f"SELECT count(DISTINCT job_id) FROM {STARTS_TABLE} WHERE due_at = to_timestamp($1)"
        )
        deadline = fire + 60 + m / 200
        while time.time() < deadline:
            if time.time() > fire and await sb.db.fetchval(started, fire) >= m:
                break
            await asyncio.sleep(0.1)
        cores = meter.stop()
        wall = time.perf_counter() - began
        await sb.db.execute("UPDATE duetime.schedules SET paused = true")
        rows = [r for r in await sb.starts() if abs(r["due"] - fire) < 0.0005]
    summary = summarize(rows, origin=fire)
    result: dict[str, Any] = {
        "scenario": "cronstorm",
        "started_at": now_iso(),
        "params": vars(params),
        "fire_time": datetime.fromtimestamp(fire, UTC).isoformat(),
        "expected": m,
        "missing": m - summary.jobs,
        **summary.to_dict(),
        "cpu_ms_per_job": {
            group: round(cores[f"{group}_cores"] * wall * 1000 / m, 3)
            for group in ("scheduler", "workers", "postgres", "rabbitmq")
        },
        "cpu": cores,
        "load_avg_start": load_start,
        "load_avg_end": load_average(),
    }
    p99 = summary.lag.get("p99_ms")
    result["targets"] = {
        "complete": summary.jobs == m and summary.duplicates == 0,
        "lag_p99_le_250ms": p99 is not None and p99 <= TARGETS["lag_p99_ms"],
    }
    plot = plot_lag(
        plot_path,
        f"cronstorm: {m} schedules on {params.cron!r} — lag p50 {summary.lag['p50_ms']} ms, "
        f"p99 {p99} ms (load {load_start[0]})",
        summary.points,
        xlabel="fire time (s)",
    )
    result["plot"] = str(plot) if plot else None
    return result
