"""``worker`` and ``io``: one worker process alone, by handler, against the bare pipeline.

The jobs are made ``dispatched`` and their messages published before the worker starts
(``bench.worker_rate``), so only execution is measured: begin, handler, outcome, ack.
Three handlers, each in a database and queue of its own:

- ``noop``: never touches ``ctx.db`` (completed in batches; target >= 0.85x pipeline);
- ``insert``: one ``ctx.db`` INSERT, each attempt in a transaction of its own (the
  default, DESIGN §15; target >= 0.7x pipeline);
- ``insert_shared``: the same for a task that opted in to shared transactions
  (``share_transaction=True``), what the opt-in buys;
- ``noop`` again at concurrency 10 and at 64, to compare (issue 25: at the asyncio
  peers' default concurrency a short handler should reach >= 0.8x what it reaches tuned);
- ``io`` (its own scenario): an INSERT then a 200 ms await at concurrency 64, the
  I/O-bound case: at most 64 / 0.2 = 320 jobs/s whatever the design, target
  >= 0.9 x 320 (no handler may be serialised behind another; the write keeps its shared
  transaction open across the await, the worst case for grouping).

With ``strace`` on the machine, a fourth and fifth small run count the write syscalls
the worker makes per delivery, by peer (one write is one message to PostgreSQL or one
batch of frames to RabbitMQ: a round trip's request, so this *counts* round trips):
the difference between a run of ``count_jobs + 1`` jobs and a run of one job, divided by
``count_jobs``, so start-up does not count.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness import Sandbox, Services
from bench.report import load_average, now_iso, ratio
from bench.worker_rate import EFFECTS_TABLE, IO_SECONDS, count_writes, measure

TARGETS = {
    "noop_vs_pipeline": 0.85,
    "insert_vs_pipeline": 0.7,
    "io_vs_ideal": 0.9,
    "noop_c10_vs_c64": 0.8,
}
#: The concurrencies of the low-concurrency check (issue 25): the asyncio peers' default
#: and a tuned worker.
LOW, HIGH = 10, 64


@dataclass(frozen=True)
class WorkerParams:
    jobs: int = 20_000
    concurrency: int = 32
    io_concurrency: int = 64
    io_jobs: int = 3200
    count_jobs: int = 2000
    low_high_jobs: int = 4000  # noop at concurrency 10 and 64, alone

    @classmethod
    def quick(cls) -> WorkerParams:
        return cls(jobs=1000, io_jobs=320, count_jobs=0, low_high_jobs=300)


async def _one(services: Services, label: str, task: str, jobs: int, conc: int, **kw: Any) -> Any:
    async with Sandbox(services, f"worker-{label}") as sb:
        await sb.db.execute(f"CREATE TABLE IF NOT EXISTS {EFFECTS_TABLE} (job_id bigint NOT NULL)")
        return await measure(sb.dsn, services.amqp_url, label, task, jobs, conc, **kw)


async def _writes_per_delivery(services: Services, task: str, n: int, conc: int) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix="duetime-bench-strace-"))
    counts = []
    for jobs in (1, n + 1):
        trace = folder / f"{task}-{jobs}.strace"
        await _one(services, f"count-{jobs}", task, jobs, conc, trace_to=trace)
        counts.append(count_writes(trace))
    shutil.rmtree(folder, ignore_errors=True)
    return {peer: round((counts[1][peer] - counts[0][peer]) / n, 2) for peer in counts[0]}


async def run(
    services: Services, params: WorkerParams, baseline: dict[str, Any] | None
) -> dict[str, Any]:
    load_start = load_average()
    pipeline = (baseline or {}).get("pipeline", {}).get("jobs_per_s")
    noop = await _one(services, "noop", "bench.noop", params.jobs, params.concurrency)
    insert = await _one(services, "insert", "bench.insert", params.jobs, params.concurrency)
    shared = await _one(
        services, "insert_shared", "bench.insert_shared", params.jobs, params.concurrency
    )
    low = await _one(services, f"noop-c{LOW}", "bench.noop", params.low_high_jobs, LOW)
    high = await _one(services, f"noop-c{HIGH}", "bench.noop", params.low_high_jobs, HIGH)
    result: dict[str, Any] = {
        "scenario": "worker",
        "started_at": now_iso(),
        "params": vars(params),
        "noop": noop,
        "insert": insert,
        "insert_shared": shared,
        "baseline_pipeline_jobs_per_s": pipeline,
        "ratio_noop_to_pipeline": ratio(noop["jobs_per_s"], pipeline),
        "ratio_insert_to_pipeline": ratio(insert["jobs_per_s"], pipeline),
        "ratio_insert_shared_to_pipeline": ratio(shared["jobs_per_s"], pipeline),
        f"noop_c{LOW}": low,
        f"noop_c{HIGH}": high,
        f"ratio_noop_c{LOW}_to_c{HIGH}": ratio(low["jobs_per_s"], high["jobs_per_s"]),
    }
    if params.count_jobs and shutil.which("strace"):
        result["writes_per_delivery"] = {
            label: await _writes_per_delivery(services, task, params.count_jobs, params.concurrency)
            for label, task in (("noop", "bench.noop"), ("insert", "bench.insert"))
        }
    result["load_avg_start"] = load_start
    result["load_avg_end"] = load_average()
    no_effects = (noop, low, high)  # handlers that write nothing
    complete = all(
        r["effects_rows"] == (0 if any(r is n for n in no_effects) else r["jobs"])
        and r["worker_exit"] == 0
        for r in (noop, insert, shared, low, high)
    )
    result["targets"] = {
        "complete": complete,
        "noop_ge_0.85x_pipeline": (result["ratio_noop_to_pipeline"] or 0)
        >= TARGETS["noop_vs_pipeline"],
        "insert_ge_0.7x_pipeline": (result["ratio_insert_to_pipeline"] or 0)
        >= TARGETS["insert_vs_pipeline"],
        f"noop_c{LOW}_ge_0.8x_c{HIGH}": (result[f"ratio_noop_c{LOW}_to_c{HIGH}"] or 0)
        >= TARGETS["noop_c10_vs_c64"],
    }
    return result


async def run_io(services: Services, params: WorkerParams) -> dict[str, Any]:
    load_start = load_average()
    io = await _one(services, "io", "bench.io", params.io_jobs, params.io_concurrency)
    ideal = params.io_concurrency / IO_SECONDS
    result: dict[str, Any] = {
        "scenario": "io",
        "started_at": now_iso(),
        "params": {"jobs": params.io_jobs, "concurrency": params.io_concurrency,
                   "await_s": IO_SECONDS},
        **io,
        "ideal_jobs_per_s": ideal,
        "ratio_to_ideal": ratio(io["jobs_per_s"], ideal),
        "load_avg_start": load_start,
        "load_avg_end": load_average(),
    }  # fmt: skip
    result["targets"] = {
        "complete": io["effects_rows"] == io["jobs"] and io["worker_exit"] == 0,
        "ge_0.9x_ideal": (result["ratio_to_ideal"] or 0) >= TARGETS["io_vs_ideal"],
    }
    return result
