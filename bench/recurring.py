"""``recurring``: M schedules (cron ``* * * * * *``) each firing every second, for D seconds.

The replica is a plain ``duetime scheduler`` (the planner is one of its duties). Schedules are
inserted with plain SQL; after ``--warmup`` seconds (the first planner pass) the window
of D whole seconds starts. Reported: fires/s delivered (handler starts whose fire time
lies in the window, per second; M is perfect), fires per second of start time, missing
fire times, duplicates, and lag (handler start − fire time).
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness import Sandbox, Services
from bench.lag import summarize
from bench.report import load_average, now_iso, plot_lag, ratio
from bench.tasks import STARTS_TABLE

#: lag p99 against the time the bare pipeline of the same run needs to start M jobs
#: (M / pipeline jobs/s): no design that runs every job can start M of them faster.
TARGETS = {"fires_per_s_ratio": 0.99, "lag_p99_ms": 100.0, "p99_vs_pipeline_burst": 1.5}
CREATE_SCHEDULES = (
    "INSERT INTO duetime.schedules (name, task, cron, queue) "
    "SELECT 'bench-' || i, 'bench.record', '* * * * * *', $2 FROM generate_series(1, $1) i"
)


@dataclass(frozen=True)
class RecurringParams:
    schedules: int = 1000
    duration: float = 10.0
    warmup: float = 3.0
    concurrency: int = 32

    @classmethod
    def quick(cls) -> RecurringParams:
        return cls(schedules=20, duration=2.0, warmup=1.5)


def available() -> str | None:
    """None when schedules and the planner exist, else why not."""
    try:
        import scheduler.duties.planner
        import scheduler.store.schedules  # noqa: F401
    except ImportError as exc:
        return f"not available: schedules/planner missing ({exc})"
    return None


async def run(
    services: Services, params: RecurringParams, plot_path: Path, baseline: dict[str, Any] | None
) -> dict[str, Any]:
    load_start = load_average()
    m, d = params.schedules, int(params.duration)
    async with Sandbox(services, "recurring") as sb:
        await sb.start_scheduler()
        await sb.start_worker(params.concurrency)
        created = time.time()
        await sb.db.execute(CREATE_SCHEDULES, m, sb.queue)
        w0 = math.ceil(created + params.warmup)
        w1 = w0 + d
        await asyncio.sleep(max(0.0, w1 - time.time()))
        await sb.db.execute("UPDATE duetime.schedules SET paused = true")
        expected_jobs = await sb.db.fetchval(
            "SELECT count(*) FROM duetime.jobs WHERE due_at >= to_timestamp($1) "
            "AND due_at < to_timestamp($2)",
            float(w0),
            float(w1),
        )
        deadline = time.monotonic() + 30
        in_window = (
            f"SELECT count(DISTINCT job_id) FROM {STARTS_TABLE} "
            "WHERE due_at >= to_timestamp($1) AND due_at < to_timestamp($2)"
        )
        while time.monotonic() < deadline:
            if await sb.db.fetchval(in_window, float(w0), float(w1)) >= m * d:
                break
            await asyncio.sleep(0.2)
        rows = [r for r in await sb.starts() if w0 <= r["due"] < w1]
        by_start = await sb.db.fetchval(
            f"SELECT count(*) FROM {STARTS_TABLE} WHERE started_at >= $1 AND started_at < $2",
            float(w0),
            float(w1),
        )
    summary = summarize(rows, origin=float(w0))
    fires_per_s = summary.jobs / d
    pipeline = (baseline or {}).get("pipeline", {}).get("jobs_per_s")
    result: dict[str, Any] = {
        "scenario": "recurring",
        "started_at": now_iso(),
        "params": vars(params),
        "window_s": d,
        "expected_fires": m * d,
        "materialized_in_window": expected_jobs,
        "fires_per_s": round(fires_per_s, 1),
        "starts_per_s_by_start_time": round(by_start / d, 1),
        "missing": m * d - summary.jobs,
        **summary.to_dict(),
        "ratio_fires_to_schedules": ratio(fires_per_s, m),
        "baseline_pipeline_jobs_per_s": pipeline,
        "ratio_fires_to_pipeline": ratio(fires_per_s, pipeline),
        "pipeline_burst_ms": round(1000 * m / pipeline, 1) if pipeline else None,
        "load_avg_start": load_start,
        "load_avg_end": load_average(),
    }
    p99 = summary.lag.get("p99_ms")
    result["targets"] = {
        "complete": summary.jobs == m * d and summary.duplicates == 0,
        "fires_ge_0.99_per_schedule": fires_per_s >= TARGETS["fires_per_s_ratio"] * m,
        "lag_p99_le_100ms": p99 is not None and p99 <= TARGETS["lag_p99_ms"],
        "lag_p99_le_1.5x_pipeline_burst": p99 is not None
        and result["pipeline_burst_ms"] is not None
        and p99 <= TARGETS["p99_vs_pipeline_burst"] * result["pipeline_burst_ms"],
    }
    plot = plot_lag(
        plot_path,
        f"recurring: {m} schedules × 1 s for {d} s — {fires_per_s:.0f} fires/s, lag p50 "
        f"{summary.lag['p50_ms']} ms, p99 {p99} ms (load {load_start[0]})",
        summary.points,
        xlabel="fire time since window start (s)",
    )
    result["plot"] = str(plot) if plot else None
    return result
