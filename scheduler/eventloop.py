"""The event loop the ``duetime`` commands run on: uvloop when it is installed (a
dependency of duetime wherever it has a wheel: Linux and macOS on CPython), asyncio's
own loop otherwise (or after ``pip uninstall uvloop``).

Why: the worker spends its CPU in the event loop's socket and callback machinery (a
delivery is a few small reads and writes to PostgreSQL and RabbitMQ; py-spy puts no
duetime function above 2 % of its samples). Measured alternately in one tree on a quiet
machine, uvloop cut CPU per job in a storm at concurrency 10 by 12.5 % in the worker
and 7-14 % in the scheduler (docs/benchmarks.md, "uvloop and orjson, measured quiet").
Everything runs the same without it. Embedding code (``Worker`` in your own
``asyncio.run``) chooses its own loop.
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
