"""The event loop the ``duetime`` commands run on: uvloop when it is installed (the
``uvloop`` extra: ``pip install 'duetime[uvloop]'``), asyncio's own loop otherwise.

Why: the worker spends its CPU in the event loop's socket and callback machinery (a
delivery is a few small reads and writes to PostgreSQL and RabbitMQ; py-spy puts no
duetime function above 2 % of its samples). Measured alternately in one tree on a quiet
machine, uvloop cut CPU per job in a storm at concurrency 10 by 12.5 % in the worker
and 7-14 % in the scheduler (docs/benchmarks.md, "uvloop and orjson, measured quiet").
It stays optional, on purpose: the fault-injection suite is run on asyncio's loop, and
under uvloop a broker that accepts connections and drops them was sometimes noticed
only at ``amqp_timeout`` (2 runs in 6, against none on asyncio). Embedding code
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

from scheduler.log import get_logger

T = TypeVar("T")
log = get_logger(__name__)

#: What asyncpg's ``TLSUpgradeProto.connection_lost`` sets on a negotiation nobody awaits.
ABANDONED_TLS_PROBE = "unexpected connection_lost() call"


def _uvloop() -> ModuleType | None:
    try:
        return importlib.import_module("uvloop")
    except ImportError:
        return None


def loop_name() -> str:
    """``uvloop`` when it is installed, else ``asyncio``: what ``run`` will use."""
    return "asyncio" if _uvloop() is None else "uvloop"


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)``, on uvloop when it is installed, with ``handle_exception``
    as the loop's exception handler. ``main`` runs outside any ``except`` clause: an
    exception it raises and logs carries its own traceback, not a chained
    ``ModuleNotFoundError`` for the optional loop."""
    uvloop = _uvloop()
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
