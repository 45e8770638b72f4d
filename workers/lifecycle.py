"""What a worker process opens once and its handlers share: startup and shutdown hooks.

Handlers often need something expensive to open and cheap to share: an HTTP session, an
SDK client, a connection pool to another service. Opening it per job wastes time;
opening it at import time runs before the worker's logging, settings and signal
handling, and nothing closes it. So a registry holds hooks:

- ``@worker_startup`` hooks run once per worker process, in the order registered, after
  the worker's pools are open and **before it consumes anything**. Each receives the
  shared :class:`WorkerState` and puts on it what handlers need (``state.http = ...``).
  A hook that raises or exceeds ``HOOK_TIMEOUT`` stops the worker with one line naming
  it: nothing was consumed, so no job is affected.
- ``@worker_shutdown`` hooks run once after the last job ended (the grace period is
  over and every outcome settled), in reverse order, each bounded by ``HOOK_TIMEOUT``;
  one that fails is logged and the others still run. They also run when a startup hook
  failed, so what the earlier ones opened is closed.
- A handler reads the state as ``ctx.state`` (``ctx.state.http.get(...)``).

A hook is ``async def hook(state)`` or a plain ``def hook(state)``; a plain one runs in
a thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any, TypeVar

from scheduler.errors import DuetimeError, InvalidInput
from scheduler.log import get_logger

__all__ = ["HOOK_TIMEOUT", "Hook", "Lifecycle", "WorkerStartupFailed", "WorkerState"]

log = get_logger(__name__)

#: Seconds a startup or shutdown hook may take.
HOOK_TIMEOUT = 30.0


class WorkerState(SimpleNamespace):
    """What startup hooks share with handlers (``ctx.state``): set any attribute."""


Hook = Callable[[WorkerState], Awaitable[None] | None]
K = TypeVar("K", bound=Callable[..., Any])


class WorkerStartupFailed(DuetimeError):
    """A startup hook raised or timed out; the worker consumed nothing. Exit status 1:
    a supervisor may restart it once what the hook needs is back."""

    exit_code = 1


def _name(hook: Callable[..., Any]) -> str:
    return f"{getattr(hook, '__module__', '?')}.{getattr(hook, '__qualname__', repr(hook))}"


def _check(hook: Any, kind: str) -> None:
    if not callable(hook):
        raise InvalidInput(f"a worker {kind} hook must be callable, not {hook!r}")
    try:
        inspect.signature(hook).bind(WorkerState())
    except (TypeError, ValueError):
        raise InvalidInput(
            f"worker {kind} hook {_name(hook)} must take one argument (the worker state)"
        ) from None


class Lifecycle:
    """The hooks of one registry and the state they fill (one per worker process)."""

    def __init__(self) -> None:
        self.startup: list[Hook] = []
        self.shutdown: list[Hook] = []
        self.state = WorkerState()

    def on_startup(self, hook: K) -> K:
        _check(hook, "startup")
        if hook not in self.startup:
            self.startup.append(hook)
        return hook

    def on_shutdown(self, hook: K) -> K:
        _check(hook, "shutdown")
        if hook not in self.shutdown:
            self.shutdown.append(hook)
        return hook

    async def _call(self, hook: Hook, timeout: float) -> None:
        if inspect.iscoroutinefunction(hook):
            await asyncio.wait_for(hook(self.state), timeout)
            return
        result = await asyncio.wait_for(asyncio.to_thread(hook, self.state), timeout)
        if inspect.isawaitable(result):  # a plain def that returned a coroutine
            await asyncio.wait_for(result, timeout)

    async def start(self, timeout: float = HOOK_TIMEOUT) -> None:
        """Run the startup hooks in order; raise ``WorkerStartupFailed`` at the first
        that fails (after running the shutdown hooks)."""
        for hook in self.startup:
            name = _name(hook)
            try:
                await self._call(hook, timeout)
            except Exception as exc:
                why = f"timed out after {timeout:g}s" if isinstance(exc, TimeoutError) else (
                    f"{type(exc).__name__}: {exc}")  # fmt: skip
                log.error("worker_startup_hook_failed", hook=name, error=why)
                await self.stop(timeout)
                raise WorkerStartupFailed(f"worker startup hook {name} failed: {why}") from exc
            log.info("worker_startup_hook_done", hook=name)

    async def stop(self, timeout: float = HOOK_TIMEOUT) -> None:
        """Run the shutdown hooks in reverse order; failures are logged, not raised."""
        for hook in reversed(self.shutdown):
            name = _name(hook)
            try:
                await self._call(hook, timeout)
            except Exception as exc:
                why = f"timed out after {timeout:g}s" if isinstance(exc, TimeoutError) else (
                    f"{type(exc).__name__}: {exc}")  # fmt: skip
                log.error("worker_shutdown_hook_failed", hook=name, error=why)
            else:
                log.info("worker_shutdown_hook_done", hook=name)
