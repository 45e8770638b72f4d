"""``storm``: N one-shot jobs due uniformly over W seconds, S seconds ahead, bulk-enqueued.
``--stage-ahead`` sets the scheduler's staging horizon (0: off; default: the setting's).
``--share-transaction`` runs the jobs as ``bench.record_shared``, the same handler in a task
that opted into transaction groups (default: ``bench.record``, a transaction per attempt).

One replica and one worker (``--workers``/``--concurrency``) start first; then the jobs are
inserted with one COPY (``JobStore.bulk_enqueue``) and the scenario waits until every job
has recorded its handler start. Reported: insert rate, completed, duplicates, lag
p50/p95/p99/max (handler start − due), drain (last start − window end), end-to-end
jobs/s = N / (last start − first due), its ratio to the bare claim→publish→consume
pipeline of the baseline, and the CPU per job of the scheduler, the workers, PostgreSQL
and RabbitMQ (``bench.cpu``: from the insert to the last start).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.cpu import CpuMeter
from bench.harness import Sandbox, Services, set_limits
from bench.lag import summarize
from bench.report import load_average, now_iso, plot_lag, ratio
from scheduler.jobspec import JobSpec
from scheduler.store import JobStore

TARGETS = {"lag_p99_ms": 1000.0, "drain_s": 1.0, "e2e_vs_pipeline": 0.7}


@dataclass(frozen=True)
class StormParams:
    jobs: int = 20_000
    window: float = 10.0
    start_in: float = 3.0
    workers: int = 1
    concurrency: int = 32
    limits: tuple[str, ...] = ()  # ``--limit``: set before the scheduler starts
    stage_ahead: float | None = None  # ``--stage-ahead``: the scheduler's (None: default)
    share_transaction: bool = False  # ``--share-transaction``: bench.record_shared

    @classmethod
    def quick(cls) -> StormParams:
        return cls(jobs=500, window=2.0, start_in=2.0)


async def run(
    services: Services, params: StormParams, plot_path: Path, baseline: dict[str, Any] | None
) -> dict[str, Any]:
    load_start = load_average()
    async with Sandbox(services, "storm") as sb:
        limits = await set_limits(sb.db, params.limits)
        staging = (
            {} if params.stage_ahead is None else {"DUETIME_STAGE_AHEAD": str(params.stage_ahead)}
        )
        scheduler = await sb.start_scheduler(**staging)
        workers = [await sb.start_worker(params.concurrency) for _ in range(params.workers)]
        meter = CpuMeter({"scheduler": [scheduler.pid], "workers": [w.pid for w in workers]})
        n = params.jobs
        window_start = time.time() + params.start_in
        step = params.window / n
        specs = [
            JobSpec(
                "bench.record_shared" if params.share_transaction else "bench.record",
                {"i": i},
                due_at=datetime.fromtimestamp(window_start + i * step, UTC),
                queue=sb.queue,
            )
            for i in range(n)
        ]
        meter.start()
        began = time.perf_counter()
        inserted = await JobStore(sb.db).bulk_enqueue(specs)
        insert_s = time.perf_counter() - began
        window_end = window_start + params.window
        timeout = params.start_in + params.window + max(30.0, n / 500)
        await sb.wait_started(n, timeout)
        cores = meter.stop()
        wall = time.perf_counter() - began
        summary = summarize(await sb.starts(), origin=window_start)
        counts = await sb.status_counts()
    completed = counts.get("succeeded", 0)
    last_start = summary.last_start or window_end
    e2e = n / (last_start - window_start) if summary.jobs == n else None
    pipeline = (baseline or {}).get("pipeline", {}).get("jobs_per_s")
    drain = round(last_start - window_end, 3)
    result: dict[str, Any] = {
        "scenario": "storm",
        "started_at": now_iso(),
        "params": {**vars(params), "limits": limits},
        "insert": {"jobs": inserted, "seconds": round(insert_s, 3),
                   "jobs_per_s": round(inserted / insert_s)},
        "completed": completed,
        "completed_pct": round(100 * completed / n, 2),
        "statuses": counts,
        **summary.to_dict(),
        "drain_s": drain,
        "arrival_jobs_per_s": round(n / params.window),
        "e2e_jobs_per_s": round(e2e) if e2e else None,
        "baseline_pipeline_jobs_per_s": pipeline,
        "ratio_e2e_to_pipeline": ratio(e2e, pipeline),
        "ratio_arrival_to_pipeline": ratio(n / params.window, pipeline),
        "cpu_ms_per_job": {
            group: round(cores[f"{group}_cores"] * wall * 1000 / n, 3)
            for group in ("scheduler", "workers", "postgres", "rabbitmq")
        },
        "cpu": cores,
        "load_avg_start": load_start,
        "load_avg_end": load_average(),
    }  # fmt: skip
    p99 = summary.lag.get("p99_ms")
    result["targets"] = {
        "complete": completed == n and summary.duplicates == 0,
        "lag_p99_le_1s": p99 is not None and p99 <= TARGETS["lag_p99_ms"],
        "drain_le_1s": drain <= TARGETS["drain_s"],
        "e2e_ge_0.7x_pipeline": (result["ratio_e2e_to_pipeline"] or 0) >= 0.7,
    }
    plot = plot_lag(
        plot_path,
        f"storm: {n} jobs over {params.window:g} s — lag p50 {summary.lag['p50_ms']} ms, "
        f"p99 {p99} ms, drain {drain} s (load {load_start[0]})",
        summary.points,
        xlabel="due time since window start (s)",
    )
    result["plot"] = str(plot) if plot else None
    return result
