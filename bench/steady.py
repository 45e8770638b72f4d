"""``steady``: R jobs/s for D seconds, each inserted alone (one INSERT, autocommit) as a
web request would, due ``--lead`` seconds after its insert (0: due at once).

The producer paces itself on an absolute schedule (job i at t0 + i/R), so a slow insert
does not lower the offered rate; the rate actually offered is reported. Lag is handler
start − due; dispatch lag (dispatched_at − due) shows the scheduler's share.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg

from bench.harness import Sandbox, Services
from bench.lag import summarize
from bench.report import load_average, now_iso, plot_lag, ratio
from scheduler.store import JobStore

TARGETS = {"lag_p50_ms": 5.0, "lag_p99_ms": 20.0}


@dataclass(frozen=True)
class SteadyParams:
    rate: float = 200.0
    duration: float = 20.0
    lead: float = 1.0
    concurrency: int = 32

    @classmethod
    def quick(cls) -> SteadyParams:
        return cls(rate=50.0, duration=1.5)


async def _produce(pool: asyncpg.Pool, queue: str, params: SteadyParams) -> tuple[int, float]:
    store = JobStore(pool)
    n = int(params.rate * params.duration)
    t0 = time.time() + 0.2
    async with pool.acquire() as conn:  # one producer connection, like a web worker
        for i in range(n):
            delay = t0 + i / params.rate - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
            await store.enqueue(
                "bench.record",
                {"i": i},
                due_at=datetime.fromtimestamp(time.time() + params.lead, UTC),
                queue=queue,
                conn=conn,
            )
    return n, time.time() - t0


async def run(
    services: Services, params: SteadyParams, plot_path: Path, baseline: dict[str, Any] | None
) -> dict[str, Any]:
    load_start = load_average()
    async with Sandbox(services, "steady") as sb:
        await sb.start_scheduler()
        await sb.start_worker(params.concurrency)
        n, produce_s = await _produce(sb.db, sb.queue, params)
        await sb.wait_started(n, params.lead + 30.0)
        summary = summarize(await sb.starts())
        counts = await sb.status_counts()
    completed = counts.get("succeeded", 0)
    pipeline = (baseline or {}).get("pipeline", {}).get("jobs_per_s")
    offered = n / produce_s
    result: dict[str, Any] = {
        "scenario": "steady",
        "started_at": now_iso(),
        "params": vars(params),
        "jobs": n,
        "offered_jobs_per_s": round(offered, 1),
        "completed": completed,
        "completed_pct": round(100 * completed / n, 2),
        "statuses": counts,
        **summary.to_dict(),
        "baseline_pipeline_jobs_per_s": pipeline,
        "ratio_offered_to_pipeline": ratio(offered, pipeline),
        "load_avg_start": load_start,
        "load_avg_end": load_average(),
    }
    p50, p99 = summary.lag.get("p50_ms"), summary.lag.get("p99_ms")
    result["targets"] = {
        "complete": completed == n and summary.duplicates == 0,
        "lag_p50_le_5ms": p50 is not None and p50 <= TARGETS["lag_p50_ms"],
        "lag_p99_le_20ms": p99 is not None and p99 <= TARGETS["lag_p99_ms"],
    }
    plot = plot_lag(
        plot_path,
        f"steady: {params.rate:g} jobs/s for {params.duration:g} s — lag p50 {p50} ms, "
        f"p99 {p99} ms (load {load_start[0]})",
        summary.points,
    )
    result["plot"] = str(plot) if plot else None
    return result
