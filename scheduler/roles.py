"""Least-privilege PostgreSQL roles: ``duetime migrate --roles`` (SQL in ``sql/roles.sql``).

Three NOLOGIN group roles, ``<prefix>_producer``, ``<prefix>_worker`` and
``<prefix>_scheduler`` (prefix ``duetime`` by default), granted exactly what each
component's statements need; operators create login users ``IN ROLE`` one of them.
Why group roles: roles are cluster-wide and passwords rotate, so the grants live on one
stable role per component and logins come and go (docs/security.md).

Applied under the migrations' advisory lock, in one transaction, after the migrations
(the grants name tables and functions the migrations create). Convergent: every run
revokes and re-grants, so a narrower configuration really narrows.

Like ``scheduler.migrate`` (whose lock it shares) it runs its DDL itself, outside
``scheduler.store``: grants are schema administration, not statements of a component.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import asyncpg

from scheduler import db
from scheduler.errors import InvalidInput
from scheduler.log import get_logger
from scheduler.migrate import ADVISORY_LOCK_KEY
from scheduler.sql import load

log = get_logger(__name__)

DEFAULT_PREFIX = "duetime"
# Lower-case so the name needs no quoting in hand-written SQL; short enough that the
# longest role name ("<prefix>_scheduler") and policy name ("..._insert_schedules")
# stay within PostgreSQL's 63-byte identifiers.
_PREFIX = re.compile(r"^[a-z_][a-z0-9_]{0,39}$")


@dataclass(frozen=True)
class RoleNames:
    producer: str
    worker: str
    scheduler: str

    @classmethod
    def for_prefix(cls, prefix: str = DEFAULT_PREFIX) -> RoleNames:
        if not isinstance(prefix, str) or not _PREFIX.match(prefix):
            raise InvalidInput(
                f"invalid role prefix {prefix!r}: 1-40 characters, lower-case letters, "
                "digits and '_', not starting with a digit"
            )
        return cls(f"{prefix}_producer", f"{prefix}_worker", f"{prefix}_scheduler")

    def render(self, sql: str) -> str:
        return (
            sql.replace("{producer}", self.producer)
            .replace("{worker}", self.worker)
            .replace("{scheduler}", self.scheduler)
        )


def statements(names: RoleNames, *, producer_schedules: bool = False) -> list[str]:
    """The SQL ``apply_roles`` runs, in order (also what ``--roles --print`` shows)."""
    q = load("roles")
    parts = ["create_roles", "revoke_all", "grant_common", "grant_producer"]
    if producer_schedules:
        parts.append("grant_producer_schedules")
    parts += ["grant_worker", "grant_scheduler"]
    return [names.render(q[p]) for p in parts]


async def apply_roles_connection(
    conn: asyncpg.Connection, names: RoleNames, *, producer_schedules: bool = False
) -> None:
    await conn.execute("SELECT pg_advisory_lock($1)", ADVISORY_LOCK_KEY)
    try:
        async with conn.transaction():
            for sql in statements(names, producer_schedules=producer_schedules):
                await conn.execute(sql)
    finally:
        await conn.execute("SELECT pg_advisory_unlock($1)", ADVISORY_LOCK_KEY)
    log.info(
        "roles_applied",
        producer=names.producer,
        worker=names.worker,
        scheduler=names.scheduler,
        producer_schedules=producer_schedules,
    )


async def apply_roles(
    dsn: str,
    *,
    prefix: str = DEFAULT_PREFIX,
    producer_schedules: bool = False,
    timeout: float = 10.0,
) -> RoleNames:
    """Create (if missing) and grant the three group roles in the database of ``dsn``."""
    names = RoleNames.for_prefix(prefix)
    conn = await db.connect(dsn, timeout=timeout, application_name="duetime:roles")
    try:
        await apply_roles_connection(conn, names, producer_schedules=producer_schedules)
    finally:
        await conn.close()
    return names


async def drop_roles_connection(conn: asyncpg.Connection, names: RoleNames) -> None:
    """Revoke everything the roles hold in this database, drop their policies, drop them.

    Roles are cluster-wide: a role still granted something in another database cannot
    be dropped (PostgreSQL says where); run this there first.
    """
    async with conn.transaction():
        await conn.execute(names.render(load("roles")["drop_roles"]))
