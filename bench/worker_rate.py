"""Jobs per second through one ``duetime worker`` process.

For each handler (a no-op, one INSERT through ``ctx.db``, and an I/O-bound one that
writes then awaits 200 ms): create N jobs in a database of our own, mark them
``dispatched`` and publish their messages (playing the dispatcher, so only the worker is
measured), then start one worker process and time the drain until every job is
``succeeded``. Prints JSON. ``duetime bench worker`` runs the same measurement
(``measure``) against the baseline of the same run.

The rate is taken between the first and the last ``finished_at`` (database clock), so
process start-up and imports are not counted; ``wall_s`` includes them.

    .venv/bin/python bench/worker_rate.py --jobs 20000 --concurrency 32

This module is also the worker's ``--import`` (``bench.worker_rate``): importing it
registers the two handlers and does nothing else.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from workers import JobContext, SyncJobContext, task

REPO = Path(__file__).resolve().parents[1]
EFFECTS_TABLE = "bench_worker_effects"


@task("bench.noop")
async def noop(ctx: JobContext, payload: dict[str, Any]) -> None:
    return None


@task("bench.insert")
async def insert_one(ctx: JobContext, payload: dict[str, Any]) -> None:
    await ctx.db.execute(f"INSERT INTO {EFFECTS_TABLE} (job_id) VALUES ($1)", ctx.job_id)


@task("bench.insert_shared", share_transaction=True)
async def insert_shared(ctx: JobContext, payload: dict[str, Any]) -> None:
    """``bench.insert`` for a task that opted in to shared transactions."""
    await ctx.db.execute(f"INSERT INTO {EFFECTS_TABLE} (job_id) VALUES ($1)", ctx.job_id)


IO_SECONDS = 0.2
#: The handlers measured by ``main`` and ``duetime bench worker``: label, task.
HANDLERS = (
    ("noop", "bench.noop"),
    ("insert", "bench.insert"),
    ("insert_shared", "bench.insert_shared"),
)


@task("bench.sync_sleep")
def sync_sleep(ctx: SyncJobContext, payload: dict[str, Any]) -> None:
    """A plain def handler blocked 200 ms (a synchronous API call): runs on a thread."""
    time.sleep(IO_SECONDS)


@task("bench.sync_insert")
def sync_insert(ctx: SyncJobContext, payload: dict[str, Any]) -> None:
    """``bench.insert`` as a plain def: the INSERT through the synchronous ctx.db."""
    ctx.db.execute(f"INSERT INTO {EFFECTS_TABLE} (job_id) VALUES ($1)", ctx.job_id)


#: Iterations of ``burn``: about 40-60 ms of one core in CPython 3.11.
CPU_ITERATIONS = 1_000_000


def burn(iterations: int = CPU_ITERATIONS) -> int:
    total = 0
    for i in range(iterations):
        total += i * i
    return total


@task("bench.cpu")
def cpu_bound(ctx: SyncJobContext, payload: dict[str, Any]) -> None:
    """CPU-bound pure Python (holds the GIL): only more processes make it faster."""
    burn()


@task("bench.io")
async def io_bound(ctx: JobContext, payload: dict[str, Any]) -> None:
    """The worst case for shared transactions: a write, then a slow await (an API call)
    while the transaction stays open."""
    await ctx.db.execute(f"INSERT INTO {EFFECTS_TABLE} (job_id) VALUES ($1)", ctx.job_id)
    await asyncio.sleep(IO_SECONDS)


# -- the benchmark (not run on import) -------------------------------------------------


def _with_db(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + name, parts.query, ""))


async def _prepare(dsn: str, amqp_url: str, queue: str, task_name: str, jobs: int) -> None:
    import aio_pika

    from scheduler import db
    from scheduler.broker import declare_job_queue, queue_name
    from scheduler.messages import CONTENT_TYPE, JobMessage

    conn = await db.connect(dsn)
    try:
        await conn.execute(f"CREATE TABLE IF NOT EXISTS {EFFECTS_TABLE} (job_id bigint NOT NULL)")
        # declared like an operator would (duetime queues add), so the worker does not warn
        await conn.execute(
            "INSERT INTO duetime.queues (name) VALUES ($1) ON CONFLICT DO NOTHING", queue
        )
        await conn.copy_records_to_table(
            "jobs",
            schema_name="duetime",
            columns=["task", "queue"],
            records=[(task_name, queue)] * jobs,
        )
        rows = await conn.fetch(
            "UPDATE duetime.jobs SET status = 'dispatched', dispatched_at = now(), "
            "dispatch_epoch = (SELECT epoch FROM duetime.leader_fence WHERE shard = 0) "
            "WHERE task = $1 AND status = 'pending' "
            "RETURNING id, due_at, dispatch_epoch",
            task_name,
        )
    finally:
        await conn.close()
    connection = await aio_pika.connect(amqp_url, timeout=10)
    try:
        channel = await connection.channel(publisher_confirms=True)
        await declare_job_queue(channel, queue, delivery_limit=20)
        routing_key = queue_name(queue)
        chunk = 1000
        for start in range(0, len(rows), chunk):
            publishes = []
            for row in rows[start : start + chunk]:
                # the full (pre-pointer) body: older workers need it, newer ones ignore
                # payload and key, so before/after comparisons run the same preparation
                msg = JobMessage(
                    job_id=row["id"],
                    due_at=row["due_at"],
                    attempt=1,
                    epoch=row["dispatch_epoch"],  # a message of another epoch is stale
                    task=task_name,
                    payload={},
                    idempotency_key=f"job:{row['id']}",
                )
                publishes.append(
                    channel.default_exchange.publish(
                        aio_pika.Message(
                            msg.encode(),
                            message_id=msg.message_id,
                            content_type=CONTENT_TYPE,
                            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                        ),
                        routing_key=routing_key,
                        timeout=30,
                    )
                )
            await asyncio.gather(*publishes)
    finally:
        await connection.close()


async def _drain(
    dsn: str,
    amqp_url: str,
    queue: str,
    task_name: str,
    jobs: int,
    concurrency: int,
    *,
    trace_to: Path | None = None,
    processes: int = 1,
) -> dict[str, Any]:
    from scheduler import db

    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("DUETIME_")},
        "DUETIME_DATABASE_URL": dsn,
        "DUETIME_AMQP_URL": amqp_url,
        "DUETIME_LOG_LEVEL": os.environ.get("BENCH_WORKER_LOG_LEVEL", "warning"),
        "DUETIME_NODE_ID": f"bench-{queue}",
    }
    argv = [
        str(Path(sys.executable).parent / "duetime"), "worker", "--import", "bench.worker_rate",
        "--queue", queue, "--concurrency", str(concurrency),
    ]  # fmt: skip
    if processes > 1:  # the supervisor: the CPU figure below is its own, not the workers'
        argv += ["--processes", str(processes)]
    conn = await db.connect(dsn)
    started = time.monotonic()
    quiet = "BENCH_WORKER_LOG_LEVEL" not in os.environ
    proc = await asyncio.create_subprocess_exec(
        *argv, env=env, cwd=REPO, stdout=asyncio.subprocess.DEVNULL if quiet else None
    )
    tracer = None
    if trace_to is not None:  # every write syscall of the worker, with its socket
        tracer = await asyncio.create_subprocess_exec(
            "strace", "-f", "-qq", "-yy", "-e", "trace=write,writev,sendto,sendmsg",
            "-o", str(trace_to), "-p", str(proc.pid),
            stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
    try:
        cpu_first: tuple[int, float] | None = None  # (jobs done, worker CPU s) at first sight
        while True:
            done = await conn.fetchval(
                "SELECT count(*) FROM duetime.jobs WHERE task = $1 AND status = 'succeeded'",
                task_name,
            )
            if done and cpu_first is None:
                cpu_first = (done, _cpu_seconds(proc.pid))
            if done >= jobs:
                cpu_last = (done, _cpu_seconds(proc.pid))
                break
            if proc.returncode is not None:
                raise RuntimeError(f"worker exited with {proc.returncode}")
            if time.monotonic() - started > 600:
                raise RuntimeError(f"only {done}/{jobs} jobs done after 600 s")
            await asyncio.sleep(0.2)
        wall = time.monotonic() - started
        span = await conn.fetchval(
            "SELECT extract(epoch FROM max(finished_at) - min(finished_at))::float8 "
            "FROM duetime.jobs WHERE task = $1",
            task_name,
        )
        effects = await conn.fetchval(f"SELECT count(*) FROM {EFFECTS_TABLE}")
    finally:
        if tracer is not None and tracer.returncode is None:
            tracer.send_signal(signal.SIGINT)
            await tracer.wait()
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 30)
        except TimeoutError:
            proc.kill()
            await proc.wait()
        await conn.close()
    cpu_ms = None
    if cpu_first is not None and cpu_last[0] > cpu_first[0]:
        cpu_ms = round(1000 * (cpu_last[1] - cpu_first[1]) / (cpu_last[0] - cpu_first[0]), 3)
    return {
        "jobs": jobs,
        "concurrency": concurrency,
        "processes": processes,
        "worker_cpu_ms_per_job": cpu_ms,
        "jobs_per_s": round((jobs - 1) / span, 1) if span else None,
        "drain_s": round(span, 3),
        "wall_s": round(wall, 3),
        "effects_rows": effects,
        "worker_exit": proc.returncode,
    }


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc): what one delivery costs
    the worker, which a loaded machine changes far less than the rate."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(
    dsn: str,
    amqp_url: str,
    label: str,
    task_name: str,
    jobs: int,
    concurrency: int,
    *,
    trace_to: Path | None = None,
    processes: int = 1,
) -> dict[str, Any]:
    """One drain of ``jobs`` pre-published jobs of ``task_name`` by one worker process
    (or ``processes`` under ``duetime worker --processes``), on an already migrated
    database ``dsn``."""
    queue = f"bench-{label}-{uuid.uuid4().hex[:6]}"
    await _prepare(dsn, amqp_url, queue, task_name, jobs)
    try:
        return await _drain(
            dsn,
            amqp_url,
            queue,
            task_name,
            jobs,
            concurrency,
            trace_to=trace_to,
            processes=processes,
        )
    finally:
        await _delete_queue(amqp_url, queue)


def count_writes(trace: Path) -> dict[str, int]:
    """Write syscalls in an strace log, by peer: PostgreSQL (5432), RabbitMQ (5672)."""
    counts = {"postgresql": 0, "rabbitmq": 0, "other": 0}
    for line in trace.read_text(errors="replace").splitlines():
        if "->127.0.0.1:5432]" in line or ":5432->" in line:
            counts["postgresql"] += 1
        elif "->127.0.0.1:5672]" in line or ":5672->" in line:
            counts["rabbitmq"] += 1
        elif "(" in line:
            counts["other"] += 1
    return counts


async def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument(
        "--server-url",
        default=os.environ.get(
            "DUETIME_BENCH_SERVER_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
        ),
        help="PostgreSQL server; the benchmark creates and drops a database of its own",
    )
    parser.add_argument(
        "--amqp-url",
        default=os.environ.get("DUETIME_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/"),
    )
    args = parser.parse_args(argv)

    import asyncpg

    from scheduler.log import configure_logging
    from scheduler.migrate import migrate

    configure_logging("warning", "console")  # stderr: stdout is the JSON result

    name = f"duetime_bench_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(args.server_url, timeout=10)
    await admin.execute(f'CREATE DATABASE "{name}"')
    await admin.close()
    dsn = _with_db(args.server_url, name)
    results: dict[str, Any] = {
        "benchmark": "worker_rate",
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }
    try:
        await migrate(dsn)
        for label, task_name in HANDLERS:
            results[label] = await measure(
                dsn, args.amqp_url, label, task_name, args.jobs, args.concurrency
            )
    finally:
        admin = await asyncpg.connect(args.server_url, timeout=10)
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()
    return results


async def _delete_queue(amqp_url: str, queue: str) -> None:
    import aio_pika

    from scheduler.broker import job_queue_names

    connection = await aio_pika.connect(amqp_url, timeout=10)
    try:
        channel = await connection.channel()
        for name in job_queue_names(queue):
            await channel.queue_delete(name)
    finally:
        await connection.close()


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    print(json.dumps(asyncio.run(main()), indent=2))
