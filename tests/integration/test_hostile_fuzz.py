"""Property test: one hostile row among ordinary ones never stops dispatch or planning.

For every column a producer may set on ``duetime.jobs`` (``task``, ``payload``,
``due_at``, ``queue``, ``max_attempts``, ``idempotency_key``, ``unique_key``) and every
column of ``duetime.schedules`` a user may write, hypothesis draws an extreme value — BC and
year-294276 dates, ±infinity, the largest numbers jsonb and integer hold, payloads at
the 1 MiB ceiling, JSON nested deeper than Python parses, NUL and lone surrogates, very
long names — and inserts ONE such row next to ordinary ones while a real dispatcher,
planner and worker run. The property, per example:

- the row is refused: by a named CHECK (the name is one of the schema's), or by
  PostgreSQL's type input (NUL in text, a surrogate or NaN in JSON, an integer out of
  range: values the column's type cannot hold), or by the client's encoder;
- or it is accepted, and then it is parked (a dead job with ``last_error``, a paused
  schedule with ``last_error``), or handled like any row (a job leaves "pending and
  due", a schedule is planned);
- either way the ordinary jobs succeed / the ordinary schedule is planned, and no duty
  pass fails (``duetime_duty_failures_total`` does not move: nothing crash-loops).

Bounded for CI: one dispatcher, planner and worker serve every example (they are
function-scoped fixtures, which hypothesis reuses), a few dozen examples, ~30-60 s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aio_pika
import asyncpg
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY

from scheduler import db
from scheduler.config import Settings
from scheduler.duties.base import LeaderTerm
from scheduler.duties.context import DutyContext
from scheduler.duties.dispatcher import Dispatcher
from scheduler.duties.planner import Planner
from scheduler.store.fence import FenceStore
from tests.fixtures_tasks.jobs import declare
from tests.support.helpers import declare_queues, delete_job_queue
from tests.support.wait import wait_for
from workers import JobContext, Registry, Worker

pytestmark = pytest.mark.timeout(240)

FUZZ = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
ORDINARY = 3  # ordinary jobs inserted beside each hostile one
EPOCH = 1
MIB = 1024 * 1024


@dataclass
class Value:
    """One value for one column: a SQL expression, with ``$`` standing for ``arg``."""

    sql: str
    arg: Any = None
    label: str = ""

    def render(self, index: int) -> tuple[str, list[Any]]:
        if "$" in self.sql:
            return self.sql.replace("$", f"${index}"), [self.arg]
        return self.sql, []


def text(value: str) -> Value:
    return Value("$", value, repr(value)[:40])


def literal(sql: str) -> Value:
    return Value(sql, None, sql[:40])


def json_text(raw: str) -> Value:
    return Value("$::text::jsonb", raw, raw[:40])


def year_date(year: int) -> Value:
    """A timestamp in ``year`` (<= 0 is BC: year 0 is 1 BC), as PostgreSQL spells it."""
    day = f"{1 - year:04d}-06-15 12:00:00+00 BC" if year <= 0 else f"{year:04d}-06-15 12:00:00+00"
    return literal(f"'{day}'::timestamptz")


NASTY_TEXT = ["", "   ", "a\x00b", "\ud800", "x" * 201, "x" * 10_000, "é" * 200, "t\n\r\t"]
DATES = st.one_of(
    st.sampled_from(
        [
            literal("'infinity'::timestamptz"),
            literal("'-infinity'::timestamptz"),
            literal("'4713-01-01 00:00:00+00 BC'::timestamptz"),
            literal("'294276-12-31 23:59:59+00'::timestamptz"),
            literal("'0001-01-01 00:00:00+00'::timestamptz"),
            literal("'0001-01-02 00:00:00+00'::timestamptz"),
            literal("'9999-12-30 23:59:59+00'::timestamptz"),
            literal("'9999-12-31 00:00:00+00'::timestamptz"),
        ]
    ),
    st.integers(min_value=-4712, max_value=294_276).map(year_date),
)
PAYLOADS = st.one_of(
    st.integers(min_value=900, max_value=6000).map(
        lambda depth: json_text('{"a": ' + "[" * depth + "]" * depth + "}")
    ),
    st.sampled_from(
        [
            json_text('{"n": 1' + "0" * 131_071 + "}"),  # jsonb's largest integer part
            json_text('{"n": 1e131071}'),
            json_text('{"n": -9223372036854775809, "m": 1e-16383}'),
            json_text('{"s": "\\u0000"}'),
            json_text('{"s": "\\ud800"}'),
            json_text('{"n": NaN}'),
            json_text("[1]"),
            json_text("null"),
            json_text('"text"'),
            Value("jsonb_build_object('a', repeat('x', $::int))", MIB - 64, "~1 MiB"),
            Value("jsonb_build_object('a', repeat('x', $::int))", MIB + 1, "1 MiB + 1"),
            Value("jsonb_build_object('a', repeat(chr(1), $::int))", 200_000, "control chars"),
        ]
    ),
)
INTEGERS = st.sampled_from(
    [literal(v) for v in ("0", "-1", "1001", "2147483647", "2147483648", "-2147483648")]
    + [literal("9223372036854775807"), literal("1")]
)
JOB_COLUMNS: dict[str, st.SearchStrategy[Value]] = {
    "task": st.sampled_from([text(v) for v in NASTY_TEXT] + [text("os.system")]),
    "payload": PAYLOADS,
    "due_at": DATES,
    "queue": st.sampled_from([text(v) for v in ("", "a b", "../x", "x" * 101, "ąę", "\x00")]),
    "max_attempts": INTEGERS,
    "idempotency_key": st.sampled_from(
        [text(v) for v in ("", "k" * 501, "k" * 500, "\x00", "\ud800", "schedule:1:x")]
    ),
    # only refused values: an accepted key would make a repeated draw a skipped insert
    "unique_key": st.sampled_from(
        [text(v) for v in ("", "k" * 201, "\x00", "\ud800", "a\nb", "\x7f", "\x85")]
    ),
}
SCHEDULE_COLUMNS: dict[str, st.SearchStrategy[Value]] = {
    "name": st.sampled_from([text(v) for v in NASTY_TEXT]),
    "task": st.sampled_from([text(v) for v in NASTY_TEXT]),
    "payload": PAYLOADS,
    "queue": st.sampled_from([text(v) for v in ("", "a b", "x" * 101, "\x00")]),
    "max_attempts": INTEGERS,
    "cron": st.sampled_from(
        [text(v) for v in ("", "* * * * * * *", "99 * * * *", "@never", "x" * 201, "\x00")]
        + [text("0 0 30 2 *"), text("* * * * * 2099")]
    ),
    "interval": st.sampled_from(
        [
            literal(f"interval '{v}'")
            for v in (
                "0",
                "-1 second",
                "1 month",
                "1 microsecond",
                "3652059 days",
                "2000000000 days",
                "2562047788 hours",
            )
        ]
    ),
    "timezone": st.sampled_from(
        [text(v) for v in ("", "Mars/Olympus", "x" * 101, "../../etc/passwd", "\x00")]
    ),
    "start_at": DATES,
    "end_at": DATES,
    "next_fire_at": DATES,
    "plan_at": DATES,
    "misfire_policy": st.sampled_from([text(v) for v in ("", "never", "\x00")]),
    "misfire_cap": INTEGERS,
    "overlap_policy": st.sampled_from([text(v) for v in ("", "queue", "\x00")]),
    "jitter": st.sampled_from(
        [literal(v) for v in ("'NaN'", "'Infinity'", "-1", "86401", "1e308", "86400")]
    ),
    "paused": st.sampled_from([literal("NULL"), literal("true")]),
}
#: Values the type itself cannot hold: refused before any CHECK runs.
TYPE_REFUSALS = (asyncpg.DataError, asyncpg.exceptions.InvalidTextRepresentationError)
CLIENT_REFUSALS = (UnicodeEncodeError, asyncpg.exceptions.InterfaceError)


@dataclass
class Fuzz:
    pool: asyncpg.Pool
    queue: str
    dispatcher: Dispatcher
    planner: Planner
    seen: set[int]
    names: itertools.count[int]

    async def status(self, job_id: int) -> asyncpg.Record:
        row = await self.pool.fetchrow(
            "SELECT status, last_error, coalesce(run_at, due_at) <= now() AS due "
            "FROM duetime.jobs WHERE id = $1",
            job_id,
        )
        assert row is not None
        return row


async def named_checks(pool: asyncpg.Pool) -> set[str]:
    return {
        r["conname"]
        for r in await pool.fetch(
            "SELECT conname FROM pg_constraint WHERE contype = 'c' "
            "AND conrelid IN ('duetime.jobs'::regclass, 'duetime.schedules'::regclass)"
        )
    }


def failures(duty: str) -> float:
    return (
        REGISTRY.get_sample_value("duetime_duty_failures_total", {"shard": "main", "duty": duty})
        or 0.0
    )


@pytest.fixture
async def fuzz(settings: Settings, migrated_dsn: str, unique: str) -> AsyncIterator[Fuzz]:
    queue = f"fuzz-{unique}"
    local = dataclasses.replace(settings, database_url=migrated_dsn)
    pool = await db.create_pool(migrated_dsn, max_size=8)
    await declare_queues(pool, queue)
    seen: set[int] = set()
    registry = Registry()

    @registry.task("t")
    async def t(ctx: JobContext, payload: dict[str, Any]) -> None:
        seen.add(ctx.job_id)

    connection = await aio_pika.connect(settings.amqp_url, timeout=10)
    await declare(await connection.channel(), queue)
    assert await FenceStore(pool).advance(EPOCH, "fuzz")
    dispatcher = Dispatcher(DutyContext.standalone(local, pool))
    planner = Planner(DutyContext.standalone(local, pool))
    worker = Worker(local, queues=[queue], registry=registry, concurrency=8, grace_period=5)
    term = LeaderTerm(epoch=EPOCH, node_id="fuzz")
    await worker.start()
    dispatcher.loop.start(term)
    planner.loop.start(term)
    try:
        yield Fuzz(pool, queue, dispatcher, planner, seen, itertools.count())
    finally:
        await planner.loop.stop()
        await dispatcher.loop.stop()
        await worker.stop()
        channel = await connection.channel()
        with contextlib.suppress(Exception):
            await delete_job_queue(channel, queue)
        await connection.close()
        await pool.close()


async def insert(pool: asyncpg.Pool, table: str, columns: dict[str, Value]) -> int | str:
    """Insert one row; its id, or how it was refused ("check:<name>", "type", "client")."""
    names, exprs, args = [], [], []
    for name, value in columns.items():
        sql, extra = value.render(len(args) + 1)
        names.append(f'"{name}"')
        exprs.append(sql)
        args.extend(extra)
    statement = (
        f"INSERT INTO duetime.{table} ({', '.join(names)}) VALUES ({', '.join(exprs)}) RETURNING id"
    )
    try:
        return int(await pool.fetchval(statement, *args))
    except asyncpg.CheckViolationError as exc:
        return f"check:{exc.constraint_name}"
    except asyncpg.NotNullViolationError:
        return "not-null"
    except TYPE_REFUSALS:
        return "type"
    except CLIENT_REFUSALS:
        return "client"


@FUZZ
@given(data=st.data())
async def test_one_hostile_job_among_ordinary_ones(fuzz: Fuzz, data: st.DataObject) -> None:
    column = data.draw(st.sampled_from(sorted(JOB_COLUMNS)), label="column")
    value = data.draw(JOB_COLUMNS[column], label=column)
    before = failures("dispatcher")
    row: dict[str, Value] = {"task": text("t"), "queue": text(fuzz.queue), column: value}
    outcome = await insert(fuzz.pool, "jobs", row)
    ordinary = [
        r["id"]
        for r in await fuzz.pool.fetch(
            "INSERT INTO duetime.jobs (task, queue) SELECT 't', $1 FROM generate_series(1, $2) "
            "RETURNING id",
            fuzz.queue,
            ORDINARY,
        )
    ]
    if isinstance(outcome, str):
        if outcome.startswith("check:"):
            assert outcome[6:] in await named_checks(fuzz.pool), outcome
    else:

        async def settled() -> bool:
            row = await fuzz.status(outcome)
            return not (row["status"] == "pending" and row["due"])

        await wait_for(settled, timeout=15, message=f"hostile {column}={value.label} settled")
        row_now = await fuzz.status(outcome)
        if row_now["status"] == "dead":
            assert row_now["last_error"], f"dead without a reason: {column}={value.label}"
        outcome = f"accepted, {row_now['status']}"
    event(f"job {column}: {outcome}")

    async def ordinary_done() -> bool:
        return set(ordinary) <= fuzz.seen and ORDINARY == await fuzz.pool.fetchval(
            "SELECT count(*) FROM duetime.jobs WHERE id = ANY($1) AND status = 'succeeded'",
            ordinary,
        )

    await wait_for(ordinary_done, timeout=15, message=f"ordinary jobs next to {column}")
    assert failures("dispatcher") == before, f"dispatcher failed on {column}={value.label}"
    assert fuzz.dispatcher.loop.task is not None and not fuzz.dispatcher.loop.task.done()


@FUZZ
@given(data=st.data())
async def test_one_hostile_schedule_among_ordinary_ones(fuzz: Fuzz, data: st.DataObject) -> None:
    column = data.draw(st.sampled_from(sorted(SCHEDULE_COLUMNS)), label="column")
    value = data.draw(SCHEDULE_COLUMNS[column], label=column)
    before = failures("planner")
    n = next(fuzz.names)
    row: dict[str, Value] = {
        "name": text(f"hostile-{n}"),
        "task": text("t"),
        "queue": text(fuzz.queue),
        "cron": literal("'* * * * * *'"),
    }
    if column == "interval":
        row["cron"] = literal("NULL")
    row[column] = value
    outcome = await insert(fuzz.pool, "schedules", row)
    ordinary = await fuzz.pool.fetchval(
        "INSERT INTO duetime.schedules (name, task, queue, cron) "
        "VALUES ($1, 't', $2, '* * * * * *') RETURNING id",
        f"ordinary-{n}",
        fuzz.queue,
    )
    try:
        if isinstance(outcome, str):
            if outcome.startswith("check:"):
                assert outcome[6:] in await named_checks(fuzz.pool), outcome
        else:

            async def looked_at() -> bool:
                row = await fuzz.pool.fetchrow(
                    "SELECT paused, plan_at IS NOT NULL AS planned FROM duetime.schedules "
                    "WHERE id = $1",
                    outcome,
                )
                return bool(row["paused"] or row["planned"])

            await wait_for(looked_at, timeout=15, message=f"hostile {column}={value.label}")
            state = await fuzz.pool.fetchrow(
                "SELECT paused, last_error FROM duetime.schedules WHERE id = $1", outcome
            )
            if state["last_error"] is not None:
                assert state["paused"], f"an error without a pause: {state['last_error']}"
            event(f"schedule {column}: accepted, {'paused' if state['paused'] else 'planned'}")
        if isinstance(outcome, str):
            event(f"schedule {column}: {outcome}")

        async def planned() -> bool:
            return bool(
                await fuzz.pool.fetchval(
                    "SELECT fired_count > 0 AND NOT paused FROM duetime.schedules WHERE id = $1",
                    ordinary,
                )
            )

        await wait_for(planned, timeout=15, message=f"ordinary schedule next to {column}")
    finally:  # the trigger cancels what they planned ahead
        ids = [ordinary] + ([outcome] if isinstance(outcome, int) else [])
        await fuzz.pool.execute("DELETE FROM duetime.schedules WHERE id = ANY($1)", ids)
    assert failures("planner") == before, f"planner failed on {column}={value.label}"
    assert fuzz.planner.loop.task is not None and not fuzz.planner.loop.task.done()
