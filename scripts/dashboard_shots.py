"""``make dashboard-shots``: screenshots of every dashboard page for docs/dashboard.md.

Seeds a demo database (``duetime_demo_dashboard_shots`` on the configured server, dropped
and re-created): an hour of finished history with its ledger rows (so the lag and
throughput charts have something to draw), pending, dead and cancelled jobs on three
queues, and schedules including one whose next fire times cross DST changes. Then
runs a real cluster on it — one ``duetime scheduler``, one ``duetime worker``
(``demo.tasks``), ``duetime dashboard`` on a free loopback port — lets it
run real jobs for a few seconds, and takes a 1280×800 PNG of each page (and the
overview at 390 px wide) with Playwright driving Debian's chromium. Everything it
started is stopped and the database dropped at the end.

Uses the DUETIME_* settings of the environment for the services (defaults: loopback).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import sys
import tempfile
import time
import urllib.request
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from demo.children import Children  # noqa: E402
from demo.store import DemoStore, recreate_database, with_database  # noqa: E402
from demo.tasks import JOB_TASK  # noqa: E402
from scheduler import db  # noqa: E402
from scheduler.config import load_settings  # noqa: E402
from scheduler.jobspec import JobSpec  # noqa: E402
from scheduler.migrate import migrate  # noqa: E402
from scheduler.planning import ScheduleSpec  # noqa: E402
from scheduler.store import JobStore, ScheduleStore  # noqa: E402

DATABASE = "duetime_demo_dashboard_shots"
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
    "--disable-dev-shm-usage",
]  # fmt: skip
QUEUES = ("default", "emails", "reports")
TASKS = {"default": "invoice.charge", "emails": "email.send", "reports": "report.build"}

# An hour of finished history: the jobs were due over the last hour, dispatched 2-60 ms
# late (a few much later), finished by one of three workers; the ledger row is what the
# worker writes in the same transaction.
HISTORY = """
WITH done AS (
    UPDATE duetime.jobs
       SET status = 'succeeded',
           dispatched_at = due_at + (2 + (id % 37) + CASE WHEN id % 97 = 0 THEN 400 ELSE 0 END)
                                    * interval '1 millisecond',
           finished_at = due_at + interval '80 milliseconds'
     WHERE status = 'pending' AND due_at < now() AND payload ? 'history'
    RETURNING id, task, finished_at
)
INSERT INTO duetime.job_ledger (idempotency_key, job_id, attempt, task, worker, completed_at)
SELECT 'job:' || id, id, 1, task, 'worker-' || (id % 3 + 1), finished_at FROM done
"""
KILL = """
UPDATE duetime.jobs SET status = 'dead', attempt = max_attempts, finished_at = now() - $2::interval,
       dispatched_at = due_at, last_error = $3
 WHERE id = $1
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def seed(url: str, queue_prefix: str) -> list[int]:
    pool = await db.create_pool(url, max_size=2)
    try:
        jobs, schedules = JobStore(pool), ScheduleStore(pool)
        await DemoStore(pool, queue=queue_prefix, job_task=JOB_TASK).create_effects_table()
        now = datetime.now(UTC)
        history = [
            JobSpec(
                task=TASKS[QUEUES[i % 3]],
                payload={"history": True, "n": i},
                due_at=now - timedelta(seconds=3600 * (i / 3000) ** 1.3 + 1),
                queue=QUEUES[i % 3],
            )
            for i in range(3000)
        ]
        await jobs.bulk_enqueue(history)
        await pool.execute(HISTORY)
        later = [
            JobSpec(task=TASKS[q], payload={"to": f"user{i}@example.com"}, queue=q,
                    due_at=now + timedelta(minutes=5 + i))
            for i, q in enumerate(QUEUES * 12)
        ]  # fmt: skip
        await jobs.bulk_enqueue(later)
        dead: list[int] = []
        errors = [
            ("email.send", "emails", "SMTPServerDisconnected: Connection unexpectedly closed"),
            ("invoice.charge", "default", "CardDeclined: insufficient funds (card ending 4242)"),
            ("report.build", "reports", "TimeoutError: task exceeded its 300 s timeout"),
        ]
        for n, (task, queue, error) in enumerate(errors * 2):
            job = await jobs.enqueue(
                task, {"customer": 1000 + n, "note": "<b>not bold</b>"}, queue=queue,
                due_at=now - timedelta(minutes=20 + n),
            )  # fmt: skip
            await pool.execute(KILL, job.id, timedelta(minutes=5 * n), f"{error}\n  (attempt 5)")
            dead.append(job.id)
        for _ in range(3):
            await jobs.cancel((await jobs.enqueue("email.send", queue="emails", delay=7200)).id)
        await schedules.add(
            ScheduleSpec(
                name="nightly-report",
                task="report.build",
                cron="0 3 * * *",
                timezone="Europe/Berlin",
                queue="reports",
                misfire_policy="fire_once",
            )
        )
        await schedules.add(
            ScheduleSpec(
                name="dst-sundays",
                task="report.build",
                cron="30 1,2 * 3,11 0",
                timezone="America/New_York",
                queue="reports",
            )
        )
        await schedules.add(
            ScheduleSpec(
                name="heartbeat",
                task=JOB_TASK,
                interval=timedelta(seconds=30),
                queue=queue_prefix,
                payload={"n": 0},
                overlap_policy="skip",
                jitter=2,
            )
        )
        paused = await schedules.add(ScheduleSpec(name="weekly-digest", task="email.send",
                                                  cron="0 8 * * 1", timezone="UTC",
                                                  queue="emails"))  # fmt: skip
        await schedules.pause(paused.name)
        for n in range(1, 40):  # real work for the worker, due now
            await jobs.enqueue(JOB_TASK, {"n": n}, queue=queue_prefix)
        return dead
    finally:
        await pool.close()


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


async def shoot(base: str, out: Path, dead: int, chromium: str) -> list[Path]:
    from playwright.async_api import async_playwright

    pages = [
        ("overview", "/", 1280),
        ("jobs", "/jobs?status=dead", 1280),
        ("job", f"/jobs/{dead}", 1280),
        ("schedules", "/schedules", 1280),
        ("schedule", "/schedules/dst-sundays", 1280),
        ("cluster", "/cluster", 1280),
        ("overview-narrow", "/", 390),
    ]
    written = []
    async with async_playwright() as p:
        browser = await p.chromium.launch(
            executable_path=chromium, args=CHROMIUM_ARGS, headless=True
        )
        for name, path, width in pages:
            height = 800 if width > 600 else 844
            context = await browser.new_context(viewport={"width": width, "height": height})
            page = await context.new_page()
            await page.goto(base + path, wait_until="networkidle")
            target = out / f"{name}.png"
            await page.screenshot(path=str(target))
            written.append(target)
            await context.close()
        await browser.close()
    return written


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "dashboard")
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    parser.add_argument("--settle", type=float, default=8.0, help="seconds of real work first")
    args = parser.parse_args()
    settings = load_settings()
    server = with_database(settings.database_url, "postgres")
    url = await recreate_database(server, DATABASE, timeout=settings.db_timeout)
    await migrate(url)
    token = uuid.uuid4().hex[:6]
    queue = f"shots-{token}"
    dead = await seed(url, queue)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DUETIME_")}
    env.update(
        DUETIME_DATABASE_URL=url, DUETIME_AMQP_URL=settings.amqp_url,
        DUETIME_ETCD_ENDPOINTS=",".join(settings.etcd_endpoints),
        DUETIME_ETCD_PREFIX=f"duetime-shots/{token}", DUETIME_LOG_FORMAT="json",
        DUETIME_LEASE_TTL="5",
    )  # fmt: skip
    bin_dir = Path(sys.executable).parent
    duetime = str(bin_dir / "duetime")
    port = free_port()
    log_dir = Path(tempfile.mkdtemp(prefix="duetime-shots-"))
    children = Children(log_dir)
    try:
        children.spawn(
            "replica-1",
            "scheduler",
            [duetime, "scheduler"],
            {**env, "DUETIME_NODE_ID": "replica-1"},
        )
        children.spawn(
            "worker-1",
            "worker",
            [
                duetime,
                "worker",
                "--import",
                "demo.tasks",
                "--queue",
                f"{queue},default,emails,reports",
                "--concurrency",
                "8",
            ],
            {**env, "DUETIME_NODE_ID": "worker-1"},
        )
        children.spawn("dashboard", "dashboard",
                       [duetime, "dashboard", "--listen", f"127.0.0.1:{port}"], env)  # fmt: skip
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while not http_ok(base + "/healthz"):
            if time.monotonic() > deadline:
                raise SystemExit("the dashboard did not come up")
            await asyncio.sleep(0.2)
        await asyncio.sleep(args.settle)  # let the leader fence and the worker run jobs
        args.out.mkdir(parents=True, exist_ok=True)
        for path in await shoot(base, args.out, dead[0], args.chromium):
            print(f"wrote {path.relative_to(ROOT)} ({path.stat().st_size // 1024} KiB)")
    finally:
        await children.stop_all(10.0)
        with contextlib.suppress(Exception):
            admin = await db.connect(server)
            await admin.execute(f'DROP DATABASE IF EXISTS "{DATABASE}" WITH (FORCE)')
            await admin.close()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
