"""The event loop the ``duetime`` commands run on: uvloop (a dependency, except on
Windows), asyncio's own loop where it is not installed or ``DUETIME_EVENT_LOOP=asyncio``
says so (``event_loop``: auto, uvloop, asyncio).

Why: the worker spends its CPU in the event loop's socket and callback machinery (a
delivery is a few small reads and writes to PostgreSQL and RabbitMQ; py-spy puts no
duetime function above 2 % of its samples). Measured alternately in one tree, uvloop cut
the worker's CPU per job in a storm at concurrency 10 by 8-15 % and the scheduler's by
7-14 % (docs/benchmarks.md, "uvloop and orjson, measured quiet" and "uvloop by
default"). It was optional while a broker that accepted connections and reset them
could end a starting worker on uvloop: aiormq raised ``StopAsyncIteration``, which
``scheduler.broker.connect`` now counts as a failed attempt. The whole suite, the
fault-injection scenarios included, runs on the loop this module picks. Embedding code
(``Worker`` in your own ``asyncio.run``) chooses its own loop.

The loop's exception handler knows one asyncpg artefact (``_abandoned_tls_probe``): a
connection attempt or query-cancel request given up (a timeout, a stop) in the same loop
turn as the server closed the connection during its SSL negotiation leaves a future with
``ConnectionError('unexpected connection_lost() call')`` that nobody reads (the same
asyncpg path as MagicStack/asyncpg#1310). asyncio reported each as an ERROR "Future
exception was never retrieved" (14 in one 37 s chaos ``pg_cut`` run), beside the
worker's own ``database_unreachable``; it is logged at debug level instead. Everything
else goes to asyncio's default handler.
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Coroutine
from types import ModuleType
from typing import Any, TypeVar

from scheduler.errors import ConfigError
from scheduler.log import get_logger

T = TypeVar("T")
log = get_logger(__name__)

#: What asyncpg's ``TLSUpgradeProto.connection_lost`` sets on a negotiation nobody awaits.
ABANDONED_TLS_PROBE = "unexpected connection_lost() call"


def _uvloop(choice: str) -> ModuleType | None:
    """The uvloop module ``choice`` asks for, or None for asyncio's loop."""
    if choice == "asyncio":
        return None
    try:
        return importlib.import_module("uvloop")
    except ImportError:
        if choice == "uvloop":
            raise ConfigError(
                "event_loop uvloop: uvloop is not installed (pip install uvloop), "
                "or set DUETIME_EVENT_LOOP=asyncio"
            ) from None
        return None


def loop_name(choice: str = "auto") -> str:
    """``uvloop`` or ``asyncio``: what ``run`` will use for ``choice``."""
    return "asyncio" if _uvloop(choice) is None else "uvloop"


def run(main: Coroutine[Any, Any, T], choice: str = "auto") -> T:
    """``asyncio.run(main)`` on the loop ``choice`` names (``auto``: uvloop where it is
    installed), with ``handle_exception`` as the loop's exception handler. ``main`` runs
    outside any ``except`` clause: an exception it raises and logs carries its own
    traceback, not a chained ``ModuleNotFoundError`` from looking for uvloop."""
    try:
        uvloop = _uvloop(choice)
    except ConfigError:
        main.close()  # never awaited: no "coroutine was never awaited" warning
        raise
    if uvloop is None:
        return asyncio.run(_handled(main))
    result: T = uvloop.run(_handled(main))
    return result


async def _handled(main: Coroutine[Any, Any, T]) -> T:
    asyncio.get_running_loop().set_exception_handler(handle_exception)
    return await main


def handle_exception(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The loop's exception handler: asyncio's default, except for asyncpg's abandoned
    SSL negotiation (module docstring), which is expected while a database is down."""
    if _abandoned_tls_probe(context):
        log.debug(
            "postgres_connect_abandoned",
            detail="a connection or cancel request to PostgreSQL was given up during its "
            "SSL negotiation; asyncpg left its outcome unread",
        )
        return
    loop.default_exception_handler(context)


def _abandoned_tls_probe(context: dict[str, Any]) -> bool:
    exc = context.get("exception")
    return (
        context.get("message") == "Future exception was never retrieved"
        and type(exc) is ConnectionError
        and exc.args == (ABANDONED_TLS_PROBE,)
    )
