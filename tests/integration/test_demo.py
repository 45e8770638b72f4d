"""``duetime demo`` end to end, as CI runs it: a real cluster of child processes
(2 replicas, 2 workers, the dashboard) against the test services, 500 jobs over 10 s,
the leader SIGKILLed half way. The demo must exit 0, report 0 lost and 0 duplicates, show a
failover, and leave no process behind — checked from outside, by looking for any
process whose environment names the demo's (unique) database — and no broker queue:
neither its job queue nor the staged queue its workers declared.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import urllib.request
from pathlib import Path

import aio_pika
import pytest

from scheduler import broker
from tests.conftest import drop_database
from tests.support.helpers import delete_job_queue
from tests.support.procs import ChildProcess, duetime_argv
from tests.support.wait import wait_for

pytestmark = pytest.mark.slow

DEMO_TIMEOUT = 120.0
DASHBOARD_URL = re.compile(r"dashboard  (http://127\.0\.0\.1:\d+/)")


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


async def broker_queues_left(amqp_url: str, queue: str) -> list[str]:
    """Which of the broker queues of job queue ``queue`` (its own and its staged one)
    exist."""
    left = []
    connection = await aio_pika.connect(amqp_url, timeout=10)
    async with connection:
        for name in broker.job_queue_names(queue):
            channel = await connection.channel()
            try:
                await channel.declare_queue(name, passive=True)
            except aio_pika.exceptions.ChannelNotFoundEntity:
                continue
            left.append(name)
    return left


def processes_mentioning(marker: str) -> list[int]:
    """Pids of live processes whose environment contains ``marker`` (ours only)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:  # gone, or not ours to read
            continue
        if marker.encode() in environ and state != "Z":
            found.append(int(entry.name))
    return found


async def test_demo_runs_to_completion_with_nothing_lost(
    server_dsn: str, amqp_url: str, etcd_endpoints: str, unique: str, tmp_path: Path
) -> None:
    database = f"duetime_demo_test_{unique}"
    summary_path = tmp_path / "summary.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DUETIME_")}
    argv = duetime_argv(
        "demo", "--duration", "10", "--jobs", "500", "--plain",
        "--database-url", server_dsn, "--database-name", database,
        "--amqp-url", amqp_url, "--etcd-endpoints", etcd_endpoints,
        "--log-dir", str(tmp_path / "logs"), "--summary-json", str(summary_path),
    )  # fmt: skip
    demo = ChildProcess(argv, name="demo", env=env, inherit_env=False, log_dir=tmp_path)
    try:
        demo.start()
        # the plan names the dashboard, and it serves while the demo runs
        url = await wait_for(lambda: DASHBOARD_URL.search(demo.output()), timeout=60)
        await wait_for(
            lambda: asyncio.to_thread(http_ok, url.group(1) + "healthz"),
            timeout=30,
            message=f"the demo's dashboard at {url.group(1)}",
        )
        try:
            code = await demo.wait(timeout=DEMO_TIMEOUT)
        except AssertionError:
            demo.send(signal.SIGTERM, group=False)  # the demo stops its children itself
            code = await demo.wait(timeout=30)
            pytest.fail(f"demo did not finish within {DEMO_TIMEOUT:g}s:\n{demo.tail(60)}")
        output = demo.output()
        assert code == 0, f"demo exited {code}:\n{demo.tail(60)}"
        assert "RESULT: OK" in output, output
        summary = json.loads(summary_path.read_text())
        assert summary["ok"] is True
        assert summary["lost"] == 0, summary
        assert summary["duplicates"] == 0, summary
        assert summary["cron_duplicates"] == 0, summary
        assert summary["published"] == 500
        assert summary["succeeded"] == 500, summary
        assert summary["drained_in"] is not None, summary
        failover = summary["failover"]
        assert failover is not None and failover["new_epoch"] is not None, summary
        assert failover["new_epoch"] > failover["killed_epoch"]
        assert failover["new_leader"] != failover["killed"]
        assert failover["first_dispatch_after"] is not None, summary
        # 2 replicas + 2 workers + the dashboard, the killed replica started again (and
        # maybe a restart after a crash, e.g. a PostgreSQL shared with other tests out
        # of connections)
        pids = [pid for child in summary["children"].values() for pid in child]
        assert len(summary["children"]) == 5 and len(pids) >= 6, summary["children"]
        assert not await asyncio.to_thread(http_ok, url.group(1) + "healthz")  # stopped
        assert summary["needed_sigkill"] == [], summary
        assert processes_mentioning(database) == [], "demo left child processes running"
        queue = summary["queue"]
        assert await broker_queues_left(amqp_url, queue) == [], "demo left broker queues"
    finally:
        demo.kill()
        for pid in processes_mentioning(database):  # never leak, even when failing
            os.kill(pid, signal.SIGKILL)
        if summary_path.exists():
            async with await aio_pika.connect(amqp_url, timeout=10) as connection:
                queue = json.loads(summary_path.read_text())["queue"]
                await delete_job_queue(await connection.channel(), queue)
        await drop_database(server_dsn, database)
