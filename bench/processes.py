"""Plain ``def`` handlers and ``duetime worker --processes N``: jobs per second.

Three measurements, each draining pre-published jobs (``bench.worker_rate.measure``: the
benchmark plays the dispatcher, so only the workers are measured):

- ``cpu``: a CPU-bound plain ``def`` handler (``bench.cpu``, pure Python holding the GIL)
  by 1, 2, … up to the machine's cores worker processes under one ``duetime worker
  --processes N``; the claim is N processes >= 0.8 x N x one process, up to the cores.
  ``cpu_ms_per_job`` is the handler's own CPU time measured here, so the ideal rate of
  N processes is ``N x 1000 / cpu_ms_per_job`` on an otherwise idle machine;
- ``sync_sleep``: a plain ``def`` handler blocked 200 ms, concurrency 32 (ideal 160/s);
- ``sync_insert`` vs ``insert``: one ctx.db INSERT from a plain ``def`` and from an
  ``async def`` handler in the same run.

The machine's busy share *outside* the benchmark (other users of a shared machine) is
measured over each run (``bench.cpu.CpuMeter``) and printed with it: a rate is only
comparable with another taken at the same outside load.

    .venv/bin/python bench/processes.py --cpu-jobs 600 --jobs 3000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def _cpu_ms_per_job(samples: int = 5) -> float:
    from bench.worker_rate import burn

    best = float("inf")
    for _ in range(samples):
        started = time.process_time()
        burn()
        best = min(best, time.process_time() - started)
    return round(best * 1000, 2)


def _machine_busy() -> tuple[float, float]:
    from bench.cpu import machine_cpu

    return machine_cpu()


async def _run(
    server: str, amqp: str, label: str, task: str, jobs: int, **kw: Any
) -> dict[str, Any]:
    """One measurement in a database of its own (the drain counts the task's jobs)."""
    import asyncpg

    from bench.worker_rate import _with_db, measure
    from scheduler.migrate import migrate

    name = f"duetime_bench_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(server, timeout=10)
    await admin.execute(f'CREATE DATABASE "{name}"')
    await admin.close()
    dsn = _with_db(server, name)
    try:
        await migrate(dsn)
        busy0, total0 = _machine_busy()
        result = await measure(dsn, amqp, label, task, jobs, **kw)
        busy1, total1 = _machine_busy()
    finally:
        admin = await asyncpg.connect(server, timeout=10)
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()
    cores = os.cpu_count() or 1
    result["machine_busy_cores"] = round(cores * (busy1 - busy0) / max(1e-9, total1 - total0), 2)
    return result


async def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-jobs", type=int, default=600)
    parser.add_argument("--jobs", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument(
        "--cpu-concurrency",
        type=int,
        default=2,
        help="concurrency (= threads) of each process in the cpu runs: CPU-bound threads "
        "share one GIL with the event loop, so more only delays the loop",
    )
    parser.add_argument("--max-processes", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--only", choices=("cpu", "threads"), default=None)
    parser.add_argument(
        "--server-url",
        default=os.environ.get(
            "DUETIME_BENCH_SERVER_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
        ),
        help="PostgreSQL server; each run creates and drops a database of its own",
    )
    parser.add_argument(
        "--amqp-url",
        default=os.environ.get("DUETIME_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/"),
    )
    args = parser.parse_args(argv)

    from scheduler.log import configure_logging

    configure_logging("warning", "console")
    dsn = args.server_url  # each run creates and drops a database of its own there
    out: dict[str, Any] = {"benchmark": "processes", "cpus": os.cpu_count()}
    if args.only in (None, "cpu"):
        per_job = _cpu_ms_per_job()
        out["cpu_ms_per_job"] = per_job
        runs = {}
        for n in range(1, args.max_processes + 1):
            runs[n] = await _run(
                dsn, args.amqp_url, f"cpu{n}", "bench.cpu", args.cpu_jobs,
                concurrency=args.cpu_concurrency, processes=n,
            )  # fmt: skip
        one = runs[1]["jobs_per_s"]
        out["cpu"] = {
            str(n): {
                **r,
                "ideal_jobs_per_s": round(n * 1000 / per_job, 1),
                "speedup": round(r["jobs_per_s"] / one, 2) if one else None,
            }
            for n, r in runs.items()
        }
    if args.only in (None, "threads"):
        c = args.concurrency
        out["sync_sleep"] = await _run(
            dsn, args.amqp_url, "sleep", "bench.sync_sleep", args.jobs, concurrency=c
        )
        out["sync_sleep"]["ideal_jobs_per_s"] = round(c / 0.2, 1)
        out["insert"] = await _run(
            dsn, args.amqp_url, "ins", "bench.insert", args.jobs, concurrency=c
        )
        out["sync_insert"] = await _run(
            dsn, args.amqp_url, "sins", "bench.sync_insert", args.jobs, concurrency=c
        )
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    print(json.dumps(asyncio.run(main()), indent=2))
