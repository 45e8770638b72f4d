"""The examples of docs/api.md run, as written, and do what the page says.

Each ```sql block runs on the test's database; each ```python block is a program run in
order (``python block.py``) with the ``DUETIME_*`` environment pointing at this test's
own database, RabbitMQ vhost and etcd prefix, except a block whose first line names a
module (``# receipts_tasks.py``), which is written as that module for the later ones to
import. A ``duetime scheduler`` of the test's own leads, so jobs reach the worker of the
last example. Then the effects are checked in the database: the rows the examples
created, the outcomes of the handler (succeeded, dead, retried) and the receipts it
wrote, once per order whatever the duplicates. The "Several shards" program runs a
second time with two shards configured, unchanged, and its jobs are looked for in each.

A block fenced ```` ```python django6 ```` is not run here: it needs Django 6, hence
Python >= 3.12, and this suite runs on 3.11. Those blocks only have to compile here;
tests/integration/test_django_tasks.py runs the same code (tests/django6_project) on
Django 6.
"""

from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from scheduler import db
from scheduler.shards.router import shard_for_key, shard_for_unique_key
from tests.conftest import _rabbitmqctl, own_database
from tests.support.procs import REPO_ROOT, Processes, duetime_argv
from tests.support.wait import wait_for

DOC = REPO_ROOT / "docs" / "api.md"
FENCE = re.compile(r"^```(python|sql)\n(.*?)^```$", re.M | re.S)
DJANGO6_FENCE = re.compile(r"^```python django6\n(.*?)^```$", re.M | re.S)
MODULE_LINE = re.compile(r"^# (\w+)\.py\n")


def doc_blocks() -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(DOC.read_text())]


def test_the_django6_blocks_are_left_out_and_compile() -> None:
    text = DOC.read_text()
    blocks = DJANGO6_FENCE.findall(text)
    assert len(blocks) >= 3, "docs/api.md's Django Tasks section lost its examples"
    run_here = "\n".join(code for _, code in doc_blocks())
    for code in blocks:
        assert code not in run_here
        compile(code, "docs/api.md (python django6)", "exec")
    joined = "\n".join(blocks)
    for needle in ("duetime.contrib.django.DuetimeBackend", ".enqueue(", "transaction.atomic()",
                   "result.refresh()", "return_value", "run_after="):  # fmt: skip
        assert needle in joined, f"the Django Tasks examples do not use {needle}"


def test_the_page_has_the_examples_it_promises() -> None:
    python = [code for kind, code in doc_blocks() if kind == "python"]
    text = "\n".join(python)
    for needle in (
        "idempotency_key=",
        "unique_key=",
        'on_conflict="replace"',
        'on_conflict="error"',
        "unique_for=",
        "due_at=",
        "delay=",
        "conn=conn",
        "bulk_enqueue",
        "schedules.add(",
        "schedules.pause(",
        "schedules.apply(",
        "ctx.state",
        "registry.on_startup",
        "ctx.db",
        "raise Retry(",
        "raise Fail(",
        "def archive_receipt(ctx: SyncJobContext",
        "from duetime.testing import run_task",
        "run_task(",
        "ShardRouter.open(settings",
        "limit_key=",
        "Worker(",
        "duetime.enqueue(conn,",
        "duetime.enqueue(session,",
        "duetime.enqueue(task=",
        "duetime.bulk_enqueue(session,",
        "jobs.result(",
        "jobs.cancel(",
        "raise Snooze(",
        "ctx.progress(",
        "tags=",
        "meta=",
        "JobFilter(tags=",
        "cancel_matching(",
        "retry_matching(",
        "enqueue_workflow(",
        "chord(",
        "ctx.dependencies",
    ):
        assert needle in text, f"docs/api.md has no example using {needle}"


async def run_program(path: Path, env: dict[str, str], cwd: Path) -> str:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(path),
        cwd=cwd,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout=120)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise AssertionError(f"{path.name} did not finish within 120 s") from None
    text = out.decode(errors="replace")
    assert proc.returncode == 0, f"{path.name} exited {proc.returncode}:\n{text}"
    return text


@pytest.fixture
def own_vhost(amqp_url: str, unique: str) -> Any:
    """A RabbitMQ vhost of this test's own: the examples use the queue ``default``,
    which no other test's dispatcher or worker may share."""
    parts = urlsplit(amqp_url)
    vhost = f"duetime_api_{unique}"
    if not (
        _rabbitmqctl("add_vhost", vhost)
        and _rabbitmqctl(
            "set_permissions", "-p", vhost, parts.username or "guest", ".*", ".*", ".*"
        )
    ):
        pytest.fail("rabbitmqctl could not create a vhost for the docs/api.md examples")
    yield urlunsplit((parts.scheme, parts.netloc, "/" + vhost, parts.query, ""))
    _rabbitmqctl("delete_vhost", vhost)


async def test_every_example_runs_and_has_its_effect(
    server_dsn: str,
    own_vhost: str,
    test_env: dict[str, str],
    procs: Processes,
    tmp_path: Path,
    unique: str,
) -> None:
    async with own_database(server_dsn, f"api_{unique}") as url:
        env = {**test_env, "DUETIME_DATABASE_URL": url, "DUETIME_AMQP_URL": own_vhost}
        scheduler = procs.spawn(
            duetime_argv("scheduler"), name="scheduler", env={**env, "DUETIME_NODE_ID": unique}
        )
        await wait_for(
            lambda: '"leading"' in scheduler.output(), timeout=30, message=scheduler.tail()
        )
        conn = await db.connect(url)
        try:
            outputs = await run_blocks(conn, env, tmp_path)
            await check_effects(conn)
        finally:
            await conn.close()
            await procs.stop_all()
    assert any("handler test passed" in out for out in outputs), outputs
    assert any("plain def handler test passed" in out for out in outputs), outputs
    assert any("converted 10.8" in out for out in outputs), outputs
    assert any("canvas: 6 words" in out and "cancelled 2" in out for out in outputs), outputs
    (control,) = [out for out in outputs if "result {'total': 205}" in out]
    assert "was cancelled by docs-example" in control, control
    assert "snoozed pending 1 1" in control, control
    # without DUETIME_SHARDS the router's one shard is the database itself
    assert any("on shard main" in out and "bulk {'main': 4}" in out for out in outputs), outputs


async def test_the_shard_example_routes_across_shards_unchanged(
    server_dsn: str, test_env: dict[str, str], tmp_path: Path, unique: str
) -> None:
    """The "Several shards" program, as written, with two shards configured: the key
    picks its shard, keyless jobs alternate, ``shard=`` pins."""
    (code,) = [code for kind, code in doc_blocks() if "ShardRouter.open(" in code]
    program = tmp_path / "shards_example.py"
    program.write_text(code)
    async with (
        own_database(server_dsn, f"api_a_{unique}") as url_a,
        own_database(server_dsn, f"api_b_{unique}") as url_b,
    ):
        env = {**test_env, "DUETIME_SHARDS": f"a={url_a},b={url_b}"}
        output = await run_program(program, env, tmp_path)
        assert "shards ('a', 'b')" in output and "bulk {'a': 2, 'b': 2}" in output, output
        keyed = shard_for_key("report:2026-12", ("a", "b"))
        assert f"on shard {keyed}" in output and "pinned a" in output, output
        held = shard_for_unique_key("default", "dashboard:sales", ("a", "b"))
        assert f"on shard {held}" in output, output
        for name, url in (("a", url_a), ("b", url_b)):
            conn = await db.connect(url)
            try:
                rows = await conn.fetch(
                    "SELECT payload, idempotency_key FROM duetime.jobs"
                    " WHERE task = 'build_report' AND status = 'pending'"
                )
                boards = await conn.fetch(
                    "SELECT unique_key, priority FROM duetime.jobs WHERE task = 'refresh_dashboard'"
                )
            finally:
                await conn.close()
            expected = [("dashboard:sales", 5)] if name == held else []
            assert [(r["unique_key"], r["priority"]) for r in boards] == expected, boards
            keys = [r["idempotency_key"] for r in rows if r["idempotency_key"]]
            assert keys == (["report:2026-12"] if name == keyed else []), (name, rows)
            teams = sorted(str(r["payload"]["team"]) for r in rows if "team" in r["payload"])
            assert teams == (["0", "2", "all"] if name == "a" else ["1", "3"]), (name, rows)


async def run_blocks(conn: asyncpg.Connection, env: dict[str, str], where: Path) -> list[str]:
    outputs: list[str] = []
    for number, (kind, code) in enumerate(doc_blocks()):
        if kind == "sql":
            await conn.execute(code)
            continue
        module = MODULE_LINE.match(code)
        if module is not None:
            (where / f"{module.group(1)}.py").write_text(code)
            continue
        program = where / f"example_{number}.py"
        program.write_text(code)
        outputs.append(await run_program(program, env, where))
    return outputs


async def check_effects(conn: asyncpg.Connection) -> None:
    # enqueueing
    jobs = await conn.fetch("SELECT * FROM duetime.jobs ORDER BY id")
    receipt_jobs = [j for j in jobs if j["task"] == "send_receipt"]
    by_order: dict[int, list[asyncpg.Record]] = {}
    for job in receipt_jobs:
        by_order.setdefault(job["payload"]["order_id"], []).append(job)
    assert [j["idempotency_key"] for j in by_order[2]] == ["receipt:2", "receipt:2"]
    reminders = [j for j in jobs if j["task"] == "send_reminder"]
    assert len(reminders) == 12  # one at a time, one after a delay (cancelled), ten in bulk
    assert [j["status"] for j in reminders].count("cancelled") == 1
    assert all(j["due_at"] > j["created_at"] for j in reminders)
    assert await conn.fetchval("SELECT count(*) FROM orders WHERE id = 6") == 1
    reports = [j for j in jobs if j["task"] == "build_report"]
    assert len(reports) == 6  # keyed, four in bulk, one pinned (none due yet)
    boards = [(j["unique_key"], j["priority"]) for j in jobs if j["task"] == "refresh_dashboard"]
    assert boards == [("dashboard:sales", 5)]  # enqueued twice through the router, one job
    assert {j["status"] for j in reports} == {"pending"}
    assert [j["idempotency_key"] for j in reports if j["idempotency_key"]] == ["report:2026-12"]

    # unique jobs: one reindex job, debounced to the last payload; the digest's key
    # held by its window after it was cancelled; the plain-SQL duplicate skipped
    reindex = [j for j in jobs if j["task"] == "reindex_document"]
    assert [(j["payload"]["rev"], j["status"]) for j in reindex] == [(3, "pending")]
    assert reindex[0]["run_at"] > reindex[0]["due_at"]
    digests = [j for j in jobs if j["task"] == "send_digest"]
    assert [(j["unique_key"], j["status"]) for j in digests] == [("digest:42", "cancelled")]
    synced = [j for j in jobs if j["task"] == "sync_customer"]
    assert [j["unique_key"] for j in synced] == ["customer:7"]

    # limits: two calls of each host dispatched, the limit holds the other two of each
    calls = [(j["limit_key"], j["status"]) for j in jobs if j["task"] == "call_api"]
    assert sorted(calls) == sorted(
        [(host, status) for host in ("api.example.com", "api.example.org")
         for status in ("dispatched", "dispatched", "pending", "pending")]
    )  # fmt: skip

    # job control: results, a cancelled export (its write rolled back), a snooze
    sums = [j for j in jobs if j["task"] == "sum_invoices"]
    assert sorted((j["status"], j["result"]["total"]) for j in sums) == [
        ("succeeded", 3),
        ("succeeded", 205),
    ]
    assert [j["timeout_s"] for j in sums if j["result"]["total"] == 3] == [30.0]
    assert sorted(j["progress_note"] for j in sums) == ["summed 2 invoices", "summed 3 invoices"]
    (export,) = [j for j in jobs if j["task"] == "export_everything" and not j["tags"]]
    assert (export["status"], export["cancelled_by"]) == ("cancelled", "docs-example")
    assert await conn.fetchval("SELECT count(*) FROM exports") == 0
    (later,) = [j for j in jobs if j["task"] == "wait_for_upstream"]
    assert (later["status"], later["attempt"], later["snoozes"]) == ("pending", 1, 1)

    # tags and metadata: set by the API, bulk and plain SQL; a tag's running jobs cancelled
    letters = [j for j in jobs if j["task"] == "send_newsletter"]
    assert sorted(tuple(j["tags"]) for j in letters) == [
        ("campaign:winter",), ("campaign:winter",), ("campaign:winter",),
        ("campaign:winter", "customer:1"), ("campaign:winter", "plain-sql"),
    ]  # fmt: skip
    assert sorted(str(j["meta"]) for j in letters if j["meta"]) == [
        "{'requested_by': 'ada@example.com'}", "{'source': 'crm'}",
    ]  # fmt: skip
    tagged = [j for j in jobs if j["task"] == "export_everything" and j["tags"]]
    assert [(j["status"], j["cancelled_by"], j["tags"]) for j in tagged] == [
        ("cancelled", "docs-example", ["export:eu"])
    ] * 3

    # schedules
    nightly = await conn.fetchrow("SELECT * FROM duetime.schedules WHERE name = 'nightly-report'")
    assert nightly["paused"] and nightly["timezone"] == "Europe/Berlin"
    assert nightly["misfire_policy"] == "fire_once"
    hourly = await conn.fetchrow("SELECT * FROM duetime.schedules WHERE name = 'sync-prices'")
    assert hourly["paused"] and hourly["interval"].total_seconds() == 3600
    declared = await conn.fetch(
        "SELECT name, paused FROM duetime.schedules WHERE managed_by = 'billing' ORDER BY name"
    )
    assert [tuple(r) for r in declared] == [("invoice-retries", True), ("nightly-invoices", False)]

    # the worker ran the jobs of the first example too; the duplicate key was settled by
    # the ledger without a second receipt
    # (and those enqueued from psycopg, SQLAlchemy and Django: order 8's rolled back)
    done = await conn.fetch(
        "SELECT id, status, payload, attempt FROM duetime.jobs WHERE task = 'send_receipt'"
        " AND (payload->>'order_id')::int IN (1, 2, 6, 7, 9, 10)"
    )
    assert {r["status"] for r in done} == {"succeeded"}, [dict(r) for r in done]
    assert len(done) == 7, [dict(r) for r in done]
    assert await conn.fetchval("SELECT count(*) FROM orders WHERE id = 8") == 0
    assert not [j for j in receipt_jobs if j["payload"]["order_id"] == 8]
    receipts = await conn.fetch("SELECT order_id, sent_with FROM receipts ORDER BY order_id")
    assert [r["order_id"] for r in receipts] == [1, 2, 6, 7, 9, 10]
    # the producer's key scoped by the role that inserted it (migration 0007)
    scoped = await conn.fetchval(
        "SELECT 'key:' || length(current_user) || ':' || current_user || ':receipt:2'"
    )
    assert receipts[1]["sent_with"] == scoped
    assert receipts[0]["sent_with"] == f"job:{by_order[1][0]['id']}"
    ledger = await conn.fetchval(
        "SELECT count(*) FROM duetime.job_ledger WHERE idempotency_key = $1", scoped
    )
    assert ledger == 1
    (missing,) = by_order[404]
    missing = await conn.fetchrow("SELECT * FROM duetime.jobs WHERE id = $1", missing["id"])
    assert (missing["status"], missing["attempt"]) == ("dead", 1)
    assert "no order 404" in missing["last_error"]
    (no_email,) = by_order[3]
    no_email = await conn.fetchrow("SELECT * FROM duetime.jobs WHERE id = $1", no_email["id"])
    assert (no_email["status"], no_email["attempt"]) == ("pending", 2)
    assert await conn.fetchval(
        "SELECT $1::timestamptz > now() + interval '50 seconds'", no_email["run_at"]
    )
