"""Cancel and retry by tag (DESIGN §12; docs/api.md "Tags and metadata") against real
PostgreSQL and RabbitMQ: running jobs are cancelled through the cancel channel of
workers/cancel.py (100 running handlers, all stopped within 2 s), pending ones with
them; dead ones are retried; the CLI does both with ``--tag``.

Like tests/integration/test_job_control.py, the worker test plays the dispatcher by
hand (``tests.fixtures_tasks.jobs``) and runs an in-process ``Worker``.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import asyncpg
import pytest
from aio_pika.abc import AbstractChannel
from prometheus_client import REGISTRY

import workers.worker
from scheduler.config import Settings
from scheduler.errors import InvalidInput
from scheduler.store.jobs import JobFilter, JobStore
from tests.fixtures_tasks.jobs import dispatched_job, publish
from tests.support.cli import run_duetime
from tests.support.helpers import running_worker
from tests.support.wait import wait_for
from workers import JobContext, Registry
from workers.shards import PoolSizes, pool_sizes

pytestmark = pytest.mark.timeout(90)
RUNNING = 100


def _cancelled(task: str) -> float:
    labels = {"shard": "main", "task": task, "outcome": "cancelled"}
    return REGISTRY.get_sample_value("duetime_jobs_finished_total", labels) or 0.0


def _few_connections(shards: int, concurrency: int) -> PoolSizes:
    """The worker's pools without opening one handler connection per slot at start: the
    test's handlers never use ``ctx.db``, and 110 open connections would take more than
    the test server's ``max_connections`` (100, shared)."""
    sizes = pool_sizes(shards, concurrency)
    return dataclasses.replace(sizes, handler_min=1, handler_init=1)


async def test_cancel_by_tag_stops_100_running_handlers_within_2_s(
    settings: Settings,
    db_pool: asyncpg.Pool,
    channel: AbstractChannel,
    queue: str,
    unique: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """100 handlers of a tag run (sleeping 30 s); ``cancel_matching`` by that tag cancels
    them and the tag's pending jobs in one batch, and every handler has stopped and its
    attempt settled ``cancelled`` within 2 s of the call. Jobs without the tag, and a
    running job of another tag, are left alone."""
    monkeypatch.setattr(workers.worker, "pool_sizes", _few_connections)
    tag, other = f"batch:{unique}", f"keep:{unique}"
    registry = Registry()
    started: set[int] = set()
    all_started = asyncio.Event()
    stopped: list[float] = []
    loop = asyncio.get_running_loop()

    @registry.task("tc.sleep")
    async def sleep(ctx: JobContext, payload: dict[str, Any]) -> None:
        started.add(ctx.job_id)
        if len(started) >= RUNNING + 1:
            all_started.set()
        try:
            await asyncio.sleep(payload.get("s", 30))
        except asyncio.CancelledError:
            stopped.append(loop.time())
            raise

    store = JobStore(db_pool)
    running = [await dispatched_job(db_pool, "tc.sleep", queue=queue) for _ in range(RUNNING)]
    kept = await dispatched_job(db_pool, "tc.sleep", {"s": 1.0}, queue=queue)
    await db_pool.execute(
        "UPDATE duetime.jobs SET tags = ARRAY[$2, 'shared'] WHERE id = ANY($1::bigint[])",
        [j.id for j in running],
        tag,
    )
    await db_pool.execute("UPDATE duetime.jobs SET tags = ARRAY[$2] WHERE id = $1", kept.id, other)
    waiting = [
        await store.enqueue("tc.sleep", queue=queue, delay=3600, tags=[tag]) for _ in range(2)
    ]
    untagged = await store.enqueue("tc.sleep", queue=queue, delay=3600)
    before = _cancelled("tc.sleep")
    for job in [*running, kept]:
        await publish(channel, queue, job.message(1))
    async with running_worker(settings, registry, queue, concurrency=RUNNING + 10) as worker:
        await asyncio.wait_for(all_started.wait(), 30)
        where = JobFilter(tags=[tag, "shared"])
        with pytest.raises(InvalidInput, match="cancel applies to pending or dispatched"):
            await store.preview_matching("cancel", JobFilter(status="dead", tags=[tag]))
        preview = await store.preview_matching("cancel", JobFilter(tags=[tag]))
        assert preview.count == RUNNING + 2
        asked = loop.time()
        changed = await store.cancel_matching(JobFilter(tags=[tag]), preview=preview, by="ops")
        assert changed == RUNNING + 2
        await wait_for(lambda: _cancelled("tc.sleep") >= before + RUNNING, timeout=10)
        took = loop.time() - asked
        assert worker.consumer is not None
        await wait_for(lambda: worker.consumer.in_flight == 0, timeout=10)
    assert took < 2.0, f"the 100 handlers had stopped {took:.2f}s after the cancel"
    assert len(stopped) == RUNNING and max(stopped) - asked < 2.0
    rows = await db_pool.fetch(
        "SELECT status, cancelled_by, count(*) AS n FROM duetime.jobs "
        "WHERE id = ANY($1::bigint[]) GROUP BY 1, 2",
        [j.id for j in running] + [j.id for j in waiting],
    )
    assert [tuple(r) for r in rows] == [("cancelled", "ops", RUNNING + 2)]
    assert (await store.get(kept.id)).status == "succeeded"
    assert (await store.get(untagged.id)).status == "pending"
    assert await store.cancel_matching(where) == 0  # nothing left to cancel


async def test_retry_by_tag_sends_the_dead_jobs_back(db_pool: asyncpg.Pool, unique: str) -> None:
    tag = f"dead:{unique}"
    store = JobStore(db_pool)
    jobs = [
        await store.enqueue("tc.dead", queue=f"q-{unique}", delay=3600, tags=[tag])
        for _ in range(3)
    ]
    await db_pool.execute(
        "UPDATE duetime.jobs SET status = 'dead', attempt = 5, finished_at = now(), "
        "last_error = 'boom' WHERE id = ANY($1::bigint[])",
        [j.id for j in jobs[:2]],
    )
    assert await store.retry_matching(JobFilter(tags=[tag])) == 2
    rows = await db_pool.fetch(
        "SELECT id, status, attempt FROM duetime.jobs WHERE id = ANY($1::bigint[]) ORDER BY id",
        [j.id for j in jobs],
    )
    assert [(r["status"], r["attempt"]) for r in rows] == [("pending", 1)] * 3


async def test_the_cli_adds_lists_shows_cancels_and_retries_by_tag(
    test_env: dict[str, str], db_pool: asyncpg.Pool, unique: str
) -> None:
    tag = f"cli:{unique}"
    env = dict(test_env)
    add = await run_duetime(
        env, "jobs", "add", "tc.cli", "--in", "1h", "--queue", f"cli-{unique}",
        "--tag", tag, "--tag", "nightly", "--meta", '{"asked_by": "ada"}', "--json",
    )  # fmt: skip
    assert add.code == 0, add
    job = add.json()
    assert isinstance(job, dict)
    assert (job["tags"], job["meta"]) == ([tag, "nightly"], {"asked_by": "ada"})
    other = await JobStore(db_pool).enqueue("tc.cli", delay=3600, tags=[tag])
    listed = await run_duetime(env, "jobs", "list", "--tag", tag, "--tag", "nightly")
    assert listed.code == 0, listed
    lines = listed.out.strip().splitlines()
    assert "TAGS" in lines[0] and len(lines) == 2 and f"{tag},nightly" in lines[1]
    shown = await run_duetime(env, "jobs", "show", str(job["id"]))
    assert f'tags             ["{tag}", "nightly"]' in shown.out, shown.out
    assert 'meta             {"asked_by": "ada"}' in shown.out, shown.out

    dry = await run_duetime(env, "jobs", "cancel", "--tag", tag, "--dry-run")
    states = "pending, waiting or running"
    assert dry.out.strip() == f"would cancel 2 {states} job(s) tagged {tag} (dry run)"
    done = await run_duetime(env, "jobs", "cancel", "--tag", tag)
    assert done.out.strip() == f"cancelled 2 of 2 {states} job(s) tagged {tag}"
    row = await db_pool.fetchrow(
        "SELECT status, cancelled_by FROM duetime.jobs WHERE id = $1", other.id
    )
    assert row["status"] == "cancelled" and row["cancelled_by"].startswith("cli")
    await db_pool.execute(
        "UPDATE duetime.jobs SET status = 'dead' WHERE id = ANY($1::bigint[])",
        [job["id"], other.id],
    )
    retried = await run_duetime(env, "jobs", "retry", "--tag", tag, "--json")
    assert retried.json() == {
        "action": "retry", "tags": [tag], "matched": 2, "changed": 2, "dry_run": False,
    }  # fmt: skip
    assert (await JobStore(db_pool).get(other.id)).status == "pending"
