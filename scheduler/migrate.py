"""Schema migrations: versioned SQL files shipped in ``scheduler/sql/migrations``.

Safe to run from many processes at once (a session advisory lock serialises them;
the loser finds nothing left to do) and idempotent (``schema_migrations`` records
each applied version with a checksum, and a changed file is refused loudly rather
than silently skipped). Each migration runs in its own transaction.

With shards every shard's database holds the whole schema: ``migrate_shards`` runs the
same migrations on each, one after the other, and an error names the shard it came from
(the shards before it stay migrated; running it again finishes the rest).

This module runs SQL itself, outside ``scheduler.store``, on purpose: it applies the
schema the stores' statements depend on (DDL files, its bookkeeping table, the advisory
lock), before any store can be used.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import asyncpg

from scheduler import db
from scheduler.errors import DuetimeError
from scheduler.log import get_logger
from scheduler.sql import migrations

log = get_logger(__name__)

# Arbitrary constant: "duetime" in ASCII, used as the advisory lock key.
ADVISORY_LOCK_KEY = 0x6475657469_6D65 & 0x7FFFFFFFFFFFFFFF

_BOOTSTRAP = """
CREATE SCHEMA IF NOT EXISTS duetime;
CREATE TABLE IF NOT EXISTS duetime.schema_migrations (
    version    integer     PRIMARY KEY,
    name       text        NOT NULL,
    checksum   text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);
"""


@dataclass(frozen=True)
class MigrationResult:
    applied: list[str]
    current_version: int


class MigrationError(DuetimeError):
    exit_code = 1


def _checksum(sql: str) -> str:
    return hashlib.sha256(sql.encode()).hexdigest()[:16]


async def migrate(dsn: str, *, timeout: float = 10.0) -> MigrationResult:
    conn = await db.connect(dsn, timeout=timeout, application_name="duetime:migrate")
    try:
        return await migrate_connection(conn)
    finally:
        await conn.close()


async def migrate_shards(
    shards: Mapping[str, str],
    *,
    timeout: float = 10.0,
    on_migrated: Callable[[str, MigrationResult], None] | None = None,
) -> dict[str, MigrationResult]:
    """``migrate`` each shard's database (name -> URL), in order, calling
    ``on_migrated(name, result)`` after each. Raises ``MigrationError`` naming the shard
    whose migration failed."""
    results: dict[str, MigrationResult] = {}
    for name, url in shards.items():
        try:
            results[name] = await migrate(url, timeout=timeout)
        except (DuetimeError, asyncpg.PostgresError, OSError) as exc:
            raise MigrationError(f"shard {name!r}: {exc}") from exc
        if on_migrated is not None:
            on_migrated(name, results[name])
    return results


async def migrate_connection(conn: asyncpg.Connection) -> MigrationResult:
    await conn.execute("SELECT pg_advisory_lock($1)", ADVISORY_LOCK_KEY)
    try:
        # CREATE SCHEMA IF NOT EXISTS can still race on the catalog without the lock;
        # under the lock it cannot.
        await conn.execute(_BOOTSTRAP)
        rows = await conn.fetch("SELECT version, name, checksum FROM duetime.schema_migrations")
        done = {r["version"]: r for r in rows}
        applied: list[str] = []
        current = max(done, default=0)
        for version, name, sql in migrations():
            checksum = _checksum(sql)
            if version in done:
                if done[version]["checksum"] != checksum:
                    raise MigrationError(
                        f"migration {version:04d}_{name} was changed after it was applied "
                        f"(checksum {done[version]['checksum']} in the database, {checksum} "
                        f"shipped); write a new migration instead"
                    )
                continue
            async with conn.transaction():
                await conn.execute(sql)
                await conn.execute(
                    "INSERT INTO duetime.schema_migrations (version, name, checksum) "
                    "VALUES ($1, $2, $3)",
                    version,
                    name,
                    checksum,
                )
            log.info("migration_applied", version=version, name=name)
            applied.append(f"{version:04d}_{name}")
            current = max(current, version)
        return MigrationResult(applied=applied, current_version=current)
    finally:
        await conn.execute("SELECT pg_advisory_unlock($1)", ADVISORY_LOCK_KEY)
