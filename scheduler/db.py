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


#: Views (the CLI, the dashboard) show JSON nested at most this deep; deeper values are
#: replaced by a note (``NOT_SHOWN``) carrying the first ``SHOWN_TEXT`` characters.
SHOWN_DEPTH = 64
SHOWN_TEXT = 2000
NOT_SHOWN = "(duetime: not shown)"


def json_depth(value: Any) -> int:
    """How deep ``value`` nests (``{}``/``[]`` = 1, a scalar = 0), without recursion."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def decode_jsonb_for_display(text: str) -> Any:
    """``decode_jsonb`` for connections that only show rows (``create_pool(display=
    True)``: the CLI, the dashboard). Any value the database accepts decodes: JSON nested
    deeper than Python's parser goes (RecursionError), or deeper than ``SHOWN_DEPTH``
    (every later step, ``dataclasses.asdict``, ``json.dumps``, a template, recurses), is
    replaced by ``{NOT_SHOWN: "<why>; <n> characters of JSON, the first 2000: …"}``.
    Workers and the leader keep the strict decoder: they park rows they cannot read."""
    try:
        value = decode_jsonb(text)
    except (RecursionError, ValueError) as exc:
        why = f"JSON the client cannot decode ({type(exc).__name__})"
    else:
        depth = json_depth(value)
        if depth <= SHOWN_DEPTH:
            return value
        why = f"JSON nested {depth} levels deep (views show up to {SHOWN_DEPTH})"
    cut = "the first " + str(SHOWN_TEXT) if len(text) > SHOWN_TEXT else "all"
    return {NOT_SHOWN: f"{why}; {len(text)} characters of JSON, {cut}: {text[:SHOWN_TEXT]}"}


async def init_connection(conn: asyncpg.Connection, *, display: bool = False) -> None:
    decoder = decode_jsonb_for_display if display else decode_jsonb
    await conn.set_type_codec("jsonb", encoder=json.dumps, decoder=decoder, schema="pg_catalog")


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
    display: bool = False,
    **kwargs: Any,
) -> asyncpg.Pool:
    """A pool whose connections get the codecs, then ``prepare`` (once per connection:
    e.g. preparing the statements its users run, so the first ones are not slow).

    Statements are bounded on the client side at ``3 x timeout`` unless
    ``bound_statements`` is False: the worker's handler pool, whose statements are
    bounded by each task's own timeout (a report that only ever runs for minutes must
    not fail at 30 s with a bare ``TimeoutError``), and whose worker statements pass
    their own bound. ``pooler``: how the connections reach PostgreSQL (``POOLERS``).
    ``display``: a pool that only shows rows (``decode_jsonb_for_display``)."""

    async def init(conn: asyncpg.Connection) -> None:
        await init_connection(conn, display=display)
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
