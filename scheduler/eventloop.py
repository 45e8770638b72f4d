"""The event loop the ``duetime`` commands run on: uvloop when it is installed (the
``uvloop`` extra: ``pip install 'duetime[uvloop]'``), asyncio's own loop otherwise.

Why: the worker spends its CPU in the event loop's socket and callback machinery (a
delivery is a few small reads and writes to PostgreSQL and RabbitMQ; py-spy puts no
duetime function above 2 % of its samples). Measured alternately in one tree, uvloop cut
the worker's CPU per job by 15-20 % for a handler without ``ctx.db`` and 9-28 % for one
with an INSERT (docs/benchmarks.md, "A slot is a running handler"). It stays optional:
it is a compiled dependency, and everything runs the same without it. Embedding code
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
