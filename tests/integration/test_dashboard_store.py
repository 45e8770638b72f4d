"""The stores behind the dashboard: bulk cancel/retry by filter (preview, the id bound
taken at preview time, batches through the single-job transition), run-now, the
newest-first keyset page, and the overview's read model (exact and estimated counts,
lag sampled from the ledger, workers).

Runs in a database of its own per test: the overview's figures are whole-table counts.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from scheduler import db
from scheduler.errors import InvalidInput, InvalidTransition
from scheduler.jobspec import JobSpec
from scheduler.store import DashboardStore, JobFilter, JobStore
from scheduler.store import jobs as jobs_module


@pytest.fixture
async def pool(migrated_dsn: str) -> AsyncIterator[asyncpg.Pool]:
    p = await db.create_pool(migrated_dsn, max_size=4)
    yield p
    await p.close()


LATER = datetime.now(UTC) + timedelta(days=1)


async def _kill(pool: asyncpg.Pool, ids: list[int], error: str = "boom") -> None:
    await pool.execute(
        "UPDATE duetime.jobs SET status = 'dead', finished_at = now(), last_error = $2 "
        "WHERE id = ANY($1::bigint[])",
        ids,
        error,
    )


async def test_bulk_cancel_by_filter_touches_only_matches_up_to_the_preview(
    pool: asyncpg.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(jobs_module, "BULK_BATCH", 3)  # several batches
    store = JobStore(pool)
    await store.bulk_enqueue([JobSpec(task="a", payload={}, due_at=LATER) for _ in range(8)])
    await store.bulk_enqueue([JobSpec(task="b", payload={}, due_at=LATER) for _ in range(2)])
    preview = await store.preview_matching("cancel", JobFilter(task="a"))
    assert preview.count == 8
    newer = await store.enqueue("a", due_at=LATER)
    changed = await store.cancel_matching(JobFilter(task="a"), preview=preview)
    assert changed == 8
    counts = await pool.fetch(
        "SELECT task, status, count(*) AS n FROM duetime.jobs GROUP BY 1, 2 ORDER BY 1, 2"
    )
    assert [tuple(r) for r in counts] == [("a", "cancelled", 8), ("a", "pending", 1),
                                          ("b", "pending", 2)]  # fmt: skip
    assert (await store.get(newer.id)).status == "pending"


async def test_bulk_retry_by_error_text_and_wrong_state_is_refused(pool: asyncpg.Pool) -> None:
    store = JobStore(pool)
    jobs = [await store.enqueue("t", due_at=LATER) for _ in range(4)]
    await _kill(pool, [j.id for j in jobs[:3]], "ConnectionError: DB gone")
    await _kill(pool, [jobs[3].id], "ValueError: bad input")
    where = JobFilter(error="connectionerror")
    preview = await store.preview_matching("retry", where)
    assert preview.count == 3
    assert await store.retry_matching(where, preview=preview) == 3
    statuses = {j.id: (await store.get(j.id)).status for j in jobs}
    assert list(statuses.values()) == ["pending", "pending", "pending", "dead"]
    with pytest.raises(InvalidInput, match="dead jobs, not pending"):
        await store.preview_matching("retry", JobFilter(status="pending"))
    with pytest.raises(InvalidInput, match="unknown bulk action"):
        await store.preview_matching("delete", JobFilter())


async def test_bulk_retry_confirms_exactly_the_previewed_set(
    pool: asyncpg.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A confirmation changes only the jobs its preview counted, each at most once: jobs
    with older ids that die after the preview are left dead, and a job retried by this
    confirmation that dies again before the next batch is not retried a second time."""
    monkeypatch.setattr(jobs_module, "BULK_BATCH", 2)  # several batches
    store = JobStore(pool)
    jobs = [await store.enqueue("t", {"again": True}, due_at=LATER) for _ in range(6)]
    previewed = [jobs[0].id, jobs[1].id, jobs[2].id, jobs[5].id]
    await _kill(pool, previewed)
    preview = await store.preview_matching("retry", JobFilter(task="t"))
    assert (preview.count, preview.up_to_id) == (4, jobs[5].id)
    later = [jobs[3].id, jobs[4].id]  # ids <= up_to_id, dead only after the preview
    await _kill(pool, later)
    # Every retried batch dies again at once (a worker failing it within the confirm);
    # each job only once, so the old loop would pick it up again rather than spin.
    again = dict(jobs_module.Q)
    again["notify"] = (
        "UPDATE duetime.jobs SET status = 'dead', finished_at = clock_timestamp(), "
        "payload = '{}' WHERE status = 'pending' AND payload ? 'again'"
    )
    monkeypatch.setattr(jobs_module, "Q", again)
    changed = await store.retry_matching(JobFilter(task="t"), preview=preview)
    assert changed == preview.count == 4
    rows = await pool.fetch("SELECT id FROM duetime.jobs WHERE NOT payload ? 'again' ORDER BY id")
    retried = [r["id"] for r in rows]
    assert retried == previewed  # the later deaths were never touched
    with pytest.raises(InvalidInput, match="preview was for retry"):
        await store.cancel_matching(JobFilter(task="t"), preview=preview)


async def test_run_now_only_for_a_job_in_retry_back_off(pool: asyncpg.Pool) -> None:
    store = JobStore(pool)
    job = await store.enqueue("t", delay=0)
    await pool.execute(
        "UPDATE duetime.jobs SET attempt = 2, run_at = now() + interval '1 hour' WHERE id = $1",
        job.id,
    )
    ran = await store.run_now(job.id)
    assert ran.run_at is not None and ran.run_at <= datetime.now(UTC)
    future = await store.enqueue("t", due_at=LATER)
    with pytest.raises(InvalidTransition, match="never before its due time"):
        await store.run_now(future.id)


async def test_jobs_page_is_newest_first_and_keyset_complete(pool: asyncpg.Pool) -> None:
    store = JobStore(pool)
    await store.bulk_enqueue([JobSpec(task="p", payload={}, due_at=LATER) for _ in range(25)])
    views = DashboardStore(pool)

    async def every(where: JobFilter) -> list[int]:
        seen: list[int] = []
        cursor = None
        while True:
            page = await views.jobs_page(where, cursor=cursor, limit=10)
            seen += [j.id for j in page.jobs]
            if page.next_cursor is None:
                return seen
            cursor = page.next_cursor

    newest_first = await every(JobFilter(task="p"))
    assert len(newest_first) == 25 and newest_first == sorted(newest_first, reverse=True)
    # pending: soonest runnable first, ties broken by id, none lost across pages
    await pool.execute(
        "UPDATE duetime.jobs SET run_at = due_at + (id % 4) * interval '1 minute' WHERE task = 'p'"
    )
    by_run = await every(JobFilter(task="p", status="pending"))
    rows = await pool.fetch(
        "SELECT id FROM duetime.jobs WHERE task = 'p' ORDER BY coalesce(run_at, due_at), id"
    )
    assert by_run == [r["id"] for r in rows]
    # dead: most recently dead first
    await pool.execute(
        "UPDATE duetime.jobs SET status = 'dead', "
        "finished_at = now() - (id % 5) * interval '1 minute' WHERE task = 'p'"
    )
    by_death = await every(JobFilter(task="p", status="dead"))
    rows = await pool.fetch(
        "SELECT id FROM duetime.jobs WHERE task = 'p' ORDER BY finished_at DESC, id DESC"
    )
    assert by_death == [r["id"] for r in rows]


async def test_overview_counts_lag_and_workers(pool: asyncpg.Pool) -> None:
    store = JobStore(pool)
    done = await store.enqueue("t", delay=0, queue="q1")
    await pool.execute(
        "UPDATE duetime.jobs SET status = 'succeeded', finished_at = now(), "
        "dispatched_at = due_at + interval '250 milliseconds' WHERE id = $1",
        done.id,
    )
    await pool.execute(
        "INSERT INTO duetime.job_ledger (idempotency_key, job_id, attempt, task, worker) "
        "VALUES ($1, $2, 1, 't', 'worker-7')",
        done.effective_key,
        done.id,
    )
    dead = await store.enqueue("t", due_at=LATER, queue="q1")
    await _kill(pool, [dead.id])
    overdue = await store.enqueue("t", due_at=datetime.now(UTC) - timedelta(minutes=3))
    data = await DashboardStore(pool).overview()
    assert data.terminal_exact
    assert data.terminal == {("q1", "succeeded"): 1, ("q1", "dead"): 1}
    assert data.oldest_overdue is not None and data.oldest_overdue.id == overdue.id
    assert data.oldest_late is not None and data.oldest_late >= 170
    assert [j.id for j in data.latest_dead] == [dead.id]
    assert [(m.minutes_ago, m.sampled) for m in data.minutes] == [(0, 1)]
    assert len(data.lag_samples) == 1 and abs(data.lag_samples[0][1] - 0.25) < 0.01
    assert [(w.worker, w.completed) for w in data.workers] == [("worker-7", 1)]
    detail = await DashboardStore(pool).job_detail(await store.get(done.id))
    assert detail.ledger is not None and detail.ledger.worker == "worker-7"


async def test_minute_samples_bound_the_rate_and_estimate_busy_minutes(
    pool: asyncpg.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from scheduler.dashboard.present import completions_per_minute
    from scheduler.store import dashboard

    monkeypatch.setattr(dashboard, "MINUTE_SAMPLE", 20)
    # 120 completions 0.25 s apart in the last 30 s of minute 0; 5 in minute 3
    await pool.execute(
        "INSERT INTO duetime.job_ledger (idempotency_key, job_id, attempt, task, completed_at) "
        "SELECT 'k' || i, i, 1, 't', now() - interval '1 second' - i * interval '250 ms' "
        "FROM generate_series(1, 120) AS i "
        "UNION ALL SELECT 'm' || i, 1000 + i, 1, 't', now() - interval '190 seconds' "
        "FROM generate_series(1, 5) AS i"
    )
    data = await DashboardStore(pool).overview()
    by_minute = {m.minutes_ago: m for m in data.minutes}
    assert by_minute[0].sampled == 20 and by_minute[3].sampled == 5
    rate = completions_per_minute(data.minutes, cap=20)
    assert rate.per_minute[3] == 5 and 3 not in rate.estimated
    assert 0 in rate.estimated and rate.per_minute[0] == pytest.approx(240, rel=0.01)


async def test_overview_stops_counting_a_large_backlog(
    pool: asyncpg.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from scheduler.dashboard.present import queue_counts
    from scheduler.store import dashboard

    store = JobStore(pool)
    await store.bulk_enqueue([JobSpec(task="b", payload={}, due_at=LATER) for _ in range(3)])
    data = await DashboardStore(pool).overview()
    assert data.pending_at_least is None
    assert [(q.queue, q.pending) for q in data.snapshot.queues] == [("default", 3)]
    monkeypatch.setattr(dashboard, "PENDING_EXACT_LIMIT", 3)
    data = await DashboardStore(pool).overview()
    assert data.pending_at_least == 3
    rows, totals = queue_counts(data.snapshot.queues, data.terminal, exact=True,
                                pending_counted=False)  # fmt: skip
    assert totals["pending"] is None and all(r["pending"] is None for r in rows)


async def test_overview_estimates_terminal_counts_for_a_large_table(
    pool: asyncpg.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from scheduler.store import dashboard

    monkeypatch.setattr(dashboard, "EXACT_COUNT_BYTES", 0)
    store = JobStore(pool)
    await store.bulk_enqueue([JobSpec(task="e", payload={}, due_at=LATER) for _ in range(200)])
    await pool.execute("UPDATE duetime.jobs SET status = 'cancelled', finished_at = now()")
    await pool.execute("ANALYZE duetime.jobs")
    data = await DashboardStore(pool).overview()
    assert not data.terminal_exact
    assert data.terminal == {("*", "cancelled"): 200}
