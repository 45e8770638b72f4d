"""``coldstart``: the first second after a worker is ready, against the seconds after.

A scheduler and a worker start; as soon as the worker reports ready, ``rate`` x
``duration`` jobs are inserted in one COPY, due evenly from ``lead`` seconds later. The
lag (handler start − due) of the jobs due in the first second is compared with the rest:
target p99(first second) <= 2x p99(steady). Measured before the worker opened its pools
full and prepared its statements on connect: the first 1.5 s of jobs started 300-400 ms
late, later ones 6-7 ms.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.harness import Sandbox, Services
from bench.lag import summarize
from bench.report import load_average, now_iso, percentiles_ms, plot_lag, ratio
from scheduler.jobspec import JobSpec
from scheduler.store import JobStore

TARGETS = {"first_second_p99_vs_steady": 2.0}


@dataclass(frozen=True)
class ColdStartParams:
    rate: float = 200.0
    duration: float = 5.0
    lead: float = 2.0
    concurrency: int = 32

    @classmethod
    def quick(cls) -> ColdStartParams:
        return cls(rate=50.0, duration=2.0, lead=1.0)


async def run(
    services: Services, params: ColdStartParams, plot_path: Path, baseline: dict[str, Any] | None
) -> dict[str, Any]:
    load_start = load_average()
    async with Sandbox(services, "coldstart") as sb:
        await sb.start_scheduler()
        await sb.start_worker(params.concurrency)
        n = int(params.rate * params.duration)
        first_due = time.time() + params.lead
        specs = [
            JobSpec(
                "bench.record",
                {"i": i},
                due_at=datetime.fromtimestamp(first_due + i / params.rate, UTC),
                queue=sb.queue,
            )
            for i in range(n)
        ]
        await JobStore(sb.db).bulk_enqueue(specs)
        await sb.wait_started(n, params.lead + params.duration + 30.0)
        rows = await sb.starts()
        counts = await sb.status_counts()
    summary = summarize(rows, origin=first_due)
    first = [r["started"] - r["due"] for r in rows if r["due"] < first_due + 1.0]
    rest = [r["started"] - r["due"] for r in rows if r["due"] >= first_due + 1.0]
    first_pct, rest_pct = percentiles_ms(first), percentiles_ms(rest)
    completed = counts.get("succeeded", 0)
    result: dict[str, Any] = {
        "scenario": "coldstart",
        "started_at": now_iso(),
        "params": vars(params),
        "jobs": n,
        "completed": completed,
        "first_second": first_pct,
        "steady": rest_pct,
        "ratio_first_p99_to_steady_p99": ratio(first_pct.get("p99_ms"), rest_pct.get("p99_ms")),
        "load_avg_start": load_start,
        "load_avg_end": load_average(),
    }
    r = result["ratio_first_p99_to_steady_p99"]
    result["targets"] = {
        "complete": completed == n and summary.duplicates == 0,
        "first_second_p99_le_2x_steady": r is not None
        and r <= TARGETS["first_second_p99_vs_steady"],
    }
    plot = plot_lag(
        plot_path,
        f"coldstart: {params.rate:g} jobs/s from {params.lead:g} s after READY — first-second "
        f"p99 {first_pct.get('p99_ms')} ms, steady p99 {rest_pct.get('p99_ms')} ms",
        summary.points,
    )
    result["plot"] = str(plot) if plot else None
    return result
