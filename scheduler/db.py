"""PostgreSQL connections: one place that sets codecs, timeouts and session settings.

jsonb is decoded to dicts (and encoded from them) on every connection, so the rest of
the code never calls ``json.loads`` on a column. Timeouts: asyncpg's ``timeout`` bounds
connecting; ``command_timeout`` bounds each statement on the client side. What a store
holds of a connection (the ``Conn`` type, its pool) is ``scheduler.store.conn``.

``DB_UNAVAILABLE`` is the one list of errors that mean "the database cannot be used
right now" rather than "this statement or row is wrong"; the start-up retry, the worker's
executor and its transaction groups all classify with it.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg

from scheduler.config import Settings, redact_url
from scheduler.errors import ServiceUnavailable

#: The database cannot be used right now, whatever the statement: nothing reached it,
#: the connection broke, the server refuses connections for the moment, or no host of a
#: multi-host DSN with ``target_session_attrs=read-write`` is writable (a Patroni
#: switchover: asyncpg raises ``TargetServerAttributeNotMatched`` until one is promoted).
#: Waiting fixes these; a row never causes them.
DB_UNAVAILABLE: tuple[type[BaseException], ...] = (
    OSError,
    TimeoutError,
    asyncpg.PostgresConnectionError,
    asyncpg.CannotConnectNowError,
    asyncpg.TooManyConnectionsError,
    asyncpg.TargetServerAttributeNotMatched,
)
#: Refusals that waiting will not fix: the server said "no" to these credentials, or
#: the database does not exist, or its certificate does not verify.
DB_REFUSED: tuple[type[BaseException], ...] = (
    asyncpg.InvalidAuthorizationSpecificationError,  # incl. bad password
    asyncpg.InvalidCatalogNameError,  # database does not exist
    ssl.SSLCertVerificationError,
)
# What connecting may raise: the above, or any other answer of the server.
_CONNECT_ERRORS: tuple[type[BaseException], ...] = (*DB_UNAVAILABLE, asyncpg.PostgresError)


def _big_int(text: str) -> int | float:
    """jsonb keeps numbers exactly; ``{"a": 1e5000}`` comes back as 5001 digits, over
    Python's int-parsing limit (4300). A float (inf) keeps one poisonous row from
    failing every claim that reads it."""
    return int(text) if len(text) <= 4300 else float(text)


def decode_jsonb(text: str) -> Any:
    return json.loads(text, parse_int=_big_int)


async def init_connection(conn: asyncpg.Connection) -> None:
    await conn.set_type_codec(
        "jsonb", encoder=json.dumps, decoder=decode_jsonb, schema="pg_catalog"
    )


async def keep_session(conn: asyncpg.Connection) -> None:
    """A pool ``reset`` that keeps session state: pass ``reset=keep_session``.

    asyncpg's default reset on every release runs ``SELECT pg_advisory_unlock_all();
    CLOSE ALL; UNLISTEN *; RESET ALL;`` — one more round trip per checkout, which in the
    worker (one checkout per delivery) measured ~10-40 % of its throughput. With a
    custom reset asyncpg still rolls back a transaction left open and drops listener
    callbacks; session settings, session advisory locks, LISTENs and WITH HOLD cursors
    stay on the connection for its next user, as with pgbouncer's transaction pooling,
    psycopg_pool, pgxpool or Postgrex. So code running on such a pool keeps its changes
    transaction-scoped (``SET LOCAL``, ``pg_advisory_xact_lock``).
    """
    return None


#: How a process's connections reach PostgreSQL (setting ``database_pooler``): ``none``,
#: directly or through a pool in session mode; ``transaction``, through a pool in
#: transaction mode (PgBouncer's ``pool_mode = transaction``, without protocol-level
#: prepared statements, as in Debian's 1.18). There a client's consecutive transactions
#: may run on different server sessions, so: no named prepared statements (asyncpg's
#: statement cache off: unnamed statements are parsed in the same round trip as they
#: run, which a transaction pooler keeps on one server), and only ``application_name``
#: among the session settings (a pooler refuses other startup parameters, and a SET
#: would stick to whichever session ran it). The scheduler needs a session of its own
#: (LISTEN, the fence): it refuses ``transaction`` (``scheduler.cli``).
POOLERS = ("none", "transaction")


def _connection_options(
    pooler: str, application_name: str, extra: dict[str, str] | None
) -> dict[str, Any]:
    """asyncpg's connect options for ``pooler`` (see ``POOLERS``)."""
    if pooler not in POOLERS:
        raise ValueError(f"database_pooler must be one of {', '.join(POOLERS)}, not {pooler!r}")
    settings = {"application_name": application_name[:63]}
    if pooler == "transaction":
        return {"server_settings": settings, "statement_cache_size": 0}
    settings.update(extra or {})
    return {"server_settings": settings}


def _unavailable(dsn: str, exc: BaseException) -> ServiceUnavailable:
    return ServiceUnavailable(
        f"cannot connect to PostgreSQL at {redact_url(dsn)}: {type(exc).__name__}: {exc}",
        transient=not isinstance(exc, DB_REFUSED),
    )


async def connect(
    dsn: str,
    *,
    timeout: float = 10.0,
    application_name: str = "duetime",
    server_settings: dict[str, str] | None = None,
    pooler: str = "none",
) -> asyncpg.Connection:
    try:
        conn = await asyncpg.connect(
            dsn,
            timeout=timeout,
            command_timeout=timeout * 3,
            **_connection_options(pooler, application_name, server_settings),
        )
    except _CONNECT_ERRORS as exc:
        raise _unavailable(dsn, exc) from None
    await init_connection(conn)
    return conn


async def create_pool(
    dsn: str,
    *,
    min_size: int = 1,
    max_size: int = 10,
    timeout: float = 10.0,
    application_name: str = "duetime",
    server_settings: dict[str, str] | None = None,
    prepare: Callable[[asyncpg.Connection], Awaitable[None]] | None = None,
    bound_statements: bool = True,
    pooler: str = "none",
    **kwargs: Any,
) -> asyncpg.Pool:
    """A pool whose connections get the codecs, then ``prepare`` (once per connection:
    e.g. preparing the statements its users run, so the first ones are not slow).

    Statements are bounded on the client side at ``3 x timeout`` unless
    ``bound_statements`` is False: the worker's handler pool, whose statements are
    bounded by each task's own timeout (a report that only ever runs for minutes must
    not fail at 30 s with a bare ``TimeoutError``), and whose worker statements pass
    their own bound. ``pooler``: how the connections reach PostgreSQL (``POOLERS``)."""

    async def init(conn: asyncpg.Connection) -> None:
        await init_connection(conn)
        if prepare is not None:
            await prepare(conn)

    try:
        pool = await asyncpg.create_pool(
            dsn,
            min_size=min_size,
            max_size=max_size,
            timeout=timeout,
            command_timeout=timeout * 3 if bound_statements else None,
            init=init,
            **_connection_options(pooler, application_name, server_settings),
            **kwargs,
        )
    except _CONNECT_ERRORS as exc:
        raise _unavailable(dsn, exc) from None
    assert pool is not None
    return pool


async def pool_from_settings(settings: Settings, *, max_size: int = 10, **kw: Any) -> asyncpg.Pool:
    return await create_pool(
        settings.database_url,
        max_size=max_size,
        timeout=settings.db_timeout,
        application_name=f"duetime:{settings.node_id}",
        pooler=settings.database_pooler,
        **kw,
    )
