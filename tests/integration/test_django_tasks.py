"""The Django Tasks backend (``duetime.contrib.django``) on Django 6, which needs Python
>= 3.12: both runs use ``.venv-django6`` (``make venv-django6``; ``make test`` makes it)
as subprocesses, against the real PostgreSQL, RabbitMQ and etcd.

1. ``python -m django test`` on tests/django6_project (Django's runner makes and drops
   ``test_duetime_dj6_<id>``): enqueue inside ``transaction.atomic()``, the column
   mapping, results read from the row, tasks outside the installed apps refused.
2. End to end: a migrated database of its own, ``duetime scheduler`` and ``duetime
   worker --django tests.django6_project.settings``; the project enqueues its tasks in
   one atomic block and ``result.refresh()`` gives each one's outcome.

Without a Python >= 3.12 these fail saying so (they do not skip): the backend would
otherwise be untested without anybody noticing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from pathlib import Path

import asyncpg
import pytest
from aio_pika.abc import AbstractChannel

from tests.support.helpers import declare_queues, delete_job_queue
from tests.support.procs import REPO_ROOT, Processes, duetime_argv
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(240)

VENV = REPO_ROOT / ".venv-django6"
SETTINGS = "tests.django6_project.settings"


def django6_python() -> Path:
    python = VENV / "bin" / "python"
    if not python.exists():
        pytest.fail(
            f"{VENV} is missing: the Django Tasks backend needs Django 6, which needs "
            "Python >= 3.12. Run `make venv-django6` (it looks for python3.12+, or set "
            "PY_DJANGO6=/path/to/python3.12); `make test` runs it first.",
            pytrace=False,
        )
    return python


def django_env(database_url: str, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "DJANGO6_DATABASE_URL": database_url,
        "PYTHONPATH": str(REPO_ROOT),
        **extra,
    }


async def run(argv: list[str], env: dict[str, str], timeout: float) -> str:
    """Run to the end; assert exit status 0; return the output."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
        cwd=REPO_ROOT,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout=timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    text = out.decode(errors="replace")
    assert proc.returncode == 0, f"{' '.join(argv)}\n{text}"
    return text


def test_a_missing_django6_venv_fails_saying_what_to_do(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(sys.modules[__name__], "VENV", tmp_path / "none")
    with pytest.raises(pytest.fail.Exception, match=r"Python >= 3\.12.*make venv-django6"):
        django6_python()


async def test_the_backends_own_tests_pass_with_djangos_runner(
    server_dsn: str, unique: str
) -> None:
    python = django6_python()
    base = server_dsn.rsplit("/", 1)[0]
    name = f"duetime_dj6_{unique}"
    try:
        out = await run(
            [str(python), "-m", "django", "test", "tests.django6_project.mailer",
             f"--settings={SETTINGS}", "--noinput"],
            django_env(f"{base}/{name}"),
            timeout=150,
        )  # fmt: skip
    finally:  # the runner drops its database; this is for a runner that was killed
        conn = await asyncpg.connect(server_dsn, timeout=10)
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "test_{name}" WITH (FORCE)')
        finally:
            await conn.close()
    assert "Ran 8 tests" in out and "\nOK" in out, out


async def test_a_real_worker_runs_the_projects_tasks_and_refresh_reads_the_outcome(
    procs: Processes,
    test_env: dict[str, str],
    migrated_dsn: str,
    channel: AbstractChannel,
    unique: str,
) -> None:
    python = django6_python()
    queue = f"dj-{unique}"
    await declare_queues(migrated_dsn, queue)
    env = django_env(migrated_dsn)
    await run([str(python), "-m", "django", "migrate", f"--settings={SETTINGS}"], env, 60)
    cluster_env = {**test_env, "DUETIME_DATABASE_URL": migrated_dsn, "DUETIME_LOG_LEVEL": "info"}
    scheduler = procs.spawn(duetime_argv("scheduler"), name="scheduler", env=cluster_env)
    worker = procs.spawn(
        [str(VENV / "bin" / "duetime"), "worker", "--django", SETTINGS, "--queue", queue,
         "--concurrency", "4"],
        name="worker",
        env={**cluster_env, "DJANGO6_DATABASE_URL": migrated_dsn,
             "PYTHONPATH": str(REPO_ROOT)},
    )  # fmt: skip
    try:
        await wait_for(lambda: "django_tasks_registered" in worker.output(), timeout=30)
        out = await run(
            [str(python), "-m", "tests.django6_project.e2e"],
            django_env(migrated_dsn, DJANGO6_QUEUE=queue),
            timeout=90,
        )
        report = json.loads(out.strip().splitlines()[-1])
        app = "tests.django6_project.mailer.tasks"
        assert report["add"]["status"] == "SUCCESSFUL", (report, worker.tail(), scheduler.tail())
        assert report["add"]["return_value"] == {"sum": 42}
        assert report["add"]["attempts"] == 1 and report["add"]["finished"]
        assert report["attempt"]["return_value"] == [report["attempt"]["id"], 1]
        assert report["fail"]["status"] == "FAILED"
        assert report["fail"]["errors"] == [f"{app}.MailerError"]
        assert report["fail"]["tracebacks"] == [f"{app}.MailerError: no mail today"]
        # only the installed apps' tasks are registered: the stray module is never imported
        assert report["stray"]["status"] == "dead", report
        assert "unknown task 'tests.django6_project.outside.stray'" in report["stray"]["last_error"]
        receipt = report["send_receipt"]["return_value"]
        conn = await asyncpg.connect(migrated_dsn, timeout=10)
        try:  # the task's ORM write, made on the worker's handler thread, committed
            email = await conn.fetchval("SELECT email FROM mailer_receipt WHERE id = $1", receipt)
        finally:
            await conn.close()
        assert email == "c@example.com"
    finally:
        with contextlib.suppress(Exception):
            await delete_job_queue(channel, queue)
