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
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def loop_name() -> str:
    """``uvloop`` when it is installed, else ``asyncio``: what ``run`` will use."""
    try:
        importlib.import_module("uvloop")
    except ImportError:
        return "asyncio"
    return "uvloop"


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)``, on uvloop when it is installed."""
    try:
        uvloop = importlib.import_module("uvloop")
    except ImportError:
        return asyncio.run(main)
    result: T = uvloop.run(main)
    return result
