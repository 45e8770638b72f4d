"""The demo database: create it afresh, and read what the run did.

Statements live in ``demo.sql`` beside this module (read with
``scheduler.sql.named_statements``, as duetime reads its own); they read the product
schema and write only the demo's own table. ``DemoStore`` runs them, except
``record_effect``: the demo's handlers (``demo.tasks``) run that one on their
``ctx.db``, as any user's handler runs its own writes. ``recreate_database`` drops and
creates the demo database on the configured server, which is why its name must say
"demo".
"""

from __future__ import annotations

import re
from datetime import datetime
from importlib import resources
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from demo.rows import CronEffects, JobCounts, JobEffects, Lag, Progress
from scheduler import db
from scheduler.errors import InvalidInput
from scheduler.sql import named_statements
from scheduler.store.rows import FenceView

_DATABASE_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


Q = named_statements(
    resources.files(__package__).joinpath("demo.sql").read_text("utf-8"), "demo/demo.sql"
)


def validate_database_name(name: str) -> str:
    """The demo drops this database at start: refuse anything that is not clearly a
    demo database, so a slip of the flag cannot drop real data."""
    if not _DATABASE_NAME.match(name):
        raise InvalidInput(
            f"--database-name {name!r}: use lower-case letters, digits and '_' (max 63)"
        )
    if "demo" not in name:
        raise InvalidInput(
            f"--database-name {name!r}: the demo drops and re-creates this database, so "
            "its name must contain 'demo' (e.g. duetime_demo)"
        )
    return name


def with_database(url: str, name: str) -> str:
    """``url`` pointing at database ``name`` on the same server."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + name, parts.query, ""))


async def recreate_database(server_url: str, name: str, *, timeout: float) -> str:
    """Drop ``name`` (closing its connections) and create it empty; return its URL.

    The DDL runs on the server's ``postgres`` maintenance database.
    """
    validate_database_name(name)
    conn = await db.connect(
        with_database(server_url, "postgres"), timeout=timeout, application_name="duetime-demo"
    )
    try:
        await conn.execute(Q["drop_database"].format(database=name))
        await conn.execute(Q["create_database"].format(database=name))
    finally:
        await conn.close()
    return with_database(server_url, name)


class DemoStore:
    def __init__(self, pool: asyncpg.Pool, *, queue: str, job_task: str) -> None:
        self._pool = pool
        self._queue = queue
        self._task = job_task

    async def create_effects_table(self) -> None:
        async with self._pool.acquire() as conn:
            await conn.execute(Q["create_effects"])

    async def now(self) -> datetime:
        async with self._pool.acquire() as conn:
            value: datetime = await conn.fetchval(Q["now"])
        return value

    async def fence(self) -> FenceView:
        async with self._pool.acquire() as conn:
            return FenceView.from_record(await conn.fetchrow(Q["fence"]))

    async def progress(self) -> Progress:
        async with (
            self._pool.acquire() as conn,
            conn.transaction(isolation="repeatable_read", readonly=True),
        ):
            fence = FenceView.from_record(await conn.fetchrow(Q["fence"]))
            counts = await conn.fetchrow(Q["job_counts"], self._queue, self._task)
            effects = await conn.fetchrow(Q["job_effects"], None, None)
            workers = await conn.fetch(Q["effects_by_worker"])
            cron = await conn.fetch(Q["cron_effects"])
        return Progress(
            fence=fence,
            jobs=JobCounts(**dict(counts)) if counts else JobCounts(),
            effects=JobEffects.from_record(effects),
            by_worker={r["worker"]: r["effects"] for r in workers},
            cron=tuple(
                CronEffects(r["schedule"], r["effects"], r["distinct_fires"], Lag.from_record(r))
                for r in cron
            ),
        )

    async def steady_lag(self, gap_from: datetime, gap_to: datetime) -> Lag:
        """Lag of the jobs that did not wait for the failover: not (due before
        ``gap_to`` and started after ``gap_from``)."""
        async with self._pool.acquire() as conn:
            return JobEffects.from_record(
                await conn.fetchrow(Q["job_effects"], gap_from, gap_to)
            ).lag

    async def first_dispatch(self, epoch: int) -> datetime | None:
        async with self._pool.acquire() as conn:
            value: datetime | None = await conn.fetchval(Q["first_dispatch"], epoch, self._queue)
        return value
