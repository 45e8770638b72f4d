"""The task registry: the only way a message's ``task`` name becomes code.

``@task("send_email")`` puts a ``handler(ctx, payload)`` in a ``Registry`` (the
module-level ``default_registry`` unless told otherwise): an ``async def`` one runs on
the worker's event loop, a plain ``def`` one on its handler threads (``workers.threads``)
with a synchronous ``ctx`` (``workers.sync_db.SyncJobContext``). A worker runs only what
its registry holds: nothing in a payload is imported, evaluated or unpickled, and the
modules that fill the registry come only from the worker's command line (``--import``).

Mistakes fail at import time, when the worker starts, not when the first job arrives:
a name registered twice, a handler that is not a function (or is a generator), a bad
timeout or budget.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from scheduler.errors import InvalidInput
from scheduler.jobspec import MAX_ATTEMPTS_LIMIT, MAX_TASK_LENGTH
from workers.lifecycle import Lifecycle
from workers.retry import DEFAULT_RETRY, RetryPolicy

if TYPE_CHECKING:
    from workers.context import JobContext
    from workers.sync_db import SyncJobContext

AsyncHandler = Callable[["JobContext", dict[str, Any]], Awaitable[Any]]
SyncHandler = Callable[["SyncJobContext", dict[str, Any]], Any]
Handler = AsyncHandler | SyncHandler
H = TypeVar("H", bound=Handler)
K = TypeVar("K", bound=Callable[..., Any])


class DuplicateTask(InvalidInput):
    """A task name was registered twice."""


@dataclass(frozen=True, slots=True)
class TaskSpec:
    """A registered task.

    - ``timeout``: seconds the handler may run (None: no limit; long jobs heartbeat).
    - ``max_attempts``: when set, replaces the job row's ``max_attempts`` (the column
      defaults to 5 for every producer, so the task author's number is the informed one).
    - ``retry``: the back-off policy for this task's failures.
    - ``share_transaction``: an opt-in for throughput. Attempts of such tasks that use
      ``ctx.db`` at the same time may share one transaction (``workers.groups``), so
      they see each other's uncommitted writes, row and advisory locks and
      transaction-local settings (``SET LOCAL``), and one member's failure rolls the
      others back and runs their handlers again. Only for handlers whose ``ctx.db``
      work is independent writes and that make no external calls. The default (False)
      is one transaction per attempt (DESIGN §15).
    - ``sync``: a plain ``def`` handler, run on a handler thread (``workers.threads``).
    """

    name: str
    handler: Handler
    timeout: float | None = None
    max_attempts: int | None = None
    retry: RetryPolicy = DEFAULT_RETRY
    share_transaction: bool = False
    sync: bool = False

    def attempts_allowed(self, row_max_attempts: int) -> int:
        return self.max_attempts if self.max_attempts is not None else row_max_attempts


def _validate_name(name: Any) -> str:
    if not isinstance(name, str) or not name.strip():
        raise InvalidInput(f"task name must be a non-empty string, not {name!r}")
    if len(name) > MAX_TASK_LENGTH:
        raise InvalidInput(
            f"task name {name[:40]!r}... is longer than {MAX_TASK_LENGTH} characters"
        )
    return name


def _validate_timeout(timeout: Any) -> float | None:
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise InvalidInput(f"task timeout must be seconds or a timedelta, not {timeout!r}")
    if not math.isfinite(seconds) or seconds <= 0:
        raise InvalidInput(f"task timeout must be > 0 seconds, not {timeout!r}")
    return float(seconds)


def _validate_attempts(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInput(f"max_attempts must be an integer, not {value!r}")
    if not 1 <= value <= MAX_ATTEMPTS_LIMIT:
        raise InvalidInput(f"max_attempts must be between 1 and {MAX_ATTEMPTS_LIMIT}")
    return value


def _validate_sharing(name: str, share_transaction: Any, isolated: Any) -> bool:
    """``share_transaction`` as a bool. ``isolated`` is the old spelling of what is now
    the default, accepted so existing code imports; with either value the task shares
    nothing unless it says ``share_transaction=True`` (the safe reading of old code)."""
    for option, value in (("share_transaction", share_transaction), ("isolated", isolated)):
        if value is not None and not isinstance(value, bool):
            raise InvalidInput(f"task {name!r}: {option} must be True or False, not {value!r}")
    if isolated and share_transaction:
        raise InvalidInput(
            f"task {name!r}: isolated=True and share_transaction=True contradict each other"
        )
    return bool(share_transaction)


def _where(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _is_sync(name: str, handler: Any) -> bool:
    """False for an ``async def`` handler, True for a plain ``def`` one; a generator (its
    body would never run) or anything not callable is refused."""
    if inspect.iscoroutinefunction(handler):
        return False
    if (
        not callable(handler)
        or inspect.isclass(handler)
        or inspect.isgeneratorfunction(handler)
        or inspect.isasyncgenfunction(handler)
    ):
        raise InvalidInput(
            f"task {name!r}: handler {_where(handler)} must be an 'async def' or a plain "
            "'def' function taking (ctx, payload)"
        )
    return True


class Registry:
    """Task name → ``TaskSpec``. Iterating yields names in sorted order."""

    def __init__(self) -> None:
        self._tasks: dict[str, TaskSpec] = {}
        self.lifecycle = Lifecycle()
        """Startup/shutdown hooks and the state they share (``workers.lifecycle``)."""

    def on_startup(self, hook: K) -> K:
        """Run ``hook(state)`` once before the worker consumes (decorator form too)."""
        return self.lifecycle.on_startup(hook)

    def on_shutdown(self, hook: K) -> K:
        """Run ``hook(state)`` once after the worker's last job (decorator form too)."""
        return self.lifecycle.on_shutdown(hook)

    def register(
        self,
        name: str,
        handler: Handler,
        *,
        timeout: float | timedelta | None = None,
        max_attempts: int | None = None,
        retry: RetryPolicy | None = None,
        share_transaction: bool = False,
        isolated: bool | None = None,
    ) -> TaskSpec:
        name = _validate_name(name)
        shared = _validate_sharing(name, share_transaction, isolated)
        sync = _is_sync(name, handler)
        if retry is not None and not isinstance(retry, RetryPolicy):
            raise InvalidInput(f"task {name!r}: retry must be a RetryPolicy, not {retry!r}")
        existing = self._tasks.get(name)
        if existing is not None:
            if existing.handler is handler:  # the very same function: harmless
                return existing
            raise DuplicateTask(
                f"task {name!r} is registered twice: by {_where(existing.handler)} and by "
                f"{_where(handler)}"
            )
        spec = TaskSpec(
            name=name,
            handler=handler,
            timeout=_validate_timeout(timeout),
            max_attempts=_validate_attempts(max_attempts),
            retry=retry or DEFAULT_RETRY,
            share_transaction=shared,
            sync=sync,
        )
        self._tasks[name] = spec
        return spec

    def task(
        self,
        name: str,
        *,
        timeout: float | timedelta | None = None,
        max_attempts: int | None = None,
        retry: RetryPolicy | None = None,
        share_transaction: bool = False,
        isolated: bool | None = None,
    ) -> Callable[[H], H]:
        """Decorator form of ``register``; returns the handler unchanged."""

        def decorate(handler: H) -> H:
            self.register(
                name,
                handler,
                timeout=timeout,
                max_attempts=max_attempts,
                retry=retry,
                share_transaction=share_transaction,
                isolated=isolated,
            )
            return handler

        return decorate

    def get(self, name: str) -> TaskSpec | None:
        return self._tasks.get(name)

    def names(self) -> list[str]:
        return sorted(self._tasks)

    def budgets(self) -> dict[str, int]:
        """Task name -> ``max_attempts`` of the tasks registered with their own."""
        return {n: s.max_attempts for n, s in self._tasks.items() if s.max_attempts is not None}

    def unknown_message(self, name: str, limit: int = 20) -> str:
        """The ``last_error`` for a job whose task nobody registered."""
        names = self.names()
        shown = ", ".join(names[:limit])
        if len(names) > limit:
            shown += f", … ({len(names) - limit} more)"
        return f"unknown task {name!r} (registered: {shown or 'none'})"

    def __contains__(self, name: object) -> bool:
        return name in self._tasks

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._tasks)


default_registry = Registry()


def task(
    name: str,
    *,
    timeout: float | timedelta | None = None,
    max_attempts: int | None = None,
    retry: RetryPolicy | None = None,
    share_transaction: bool = False,
    isolated: bool | None = None,
    registry: Registry | None = None,
) -> Callable[[H], H]:
    """Register ``async def handler(ctx: JobContext, payload: dict)`` as task ``name``,
    or a plain ``def handler(ctx: SyncJobContext, payload: dict)``, which runs on a
    handler thread with a synchronous ``ctx.db`` in the same transaction.

    ``timeout`` (seconds or timedelta) bounds each run; ``max_attempts`` replaces the
    job row's budget; ``retry`` sets the back-off. Registering a name twice raises
    ``DuplicateTask`` at import time. Each attempt's ``ctx.db`` work is a transaction of
    its own; ``share_transaction=True`` lets attempts that run together share one (see
    ``TaskSpec``). ``isolated=True`` says the default and is kept for existing code.
    """
    target = registry if registry is not None else default_registry  # empty is falsy
    return target.task(
        name,
        timeout=timeout,
        max_attempts=max_attempts,
        retry=retry,
        share_transaction=share_transaction,
        isolated=isolated,
    )


def worker_startup(hook: K | None = None, *, registry: Registry | None = None) -> Any:
    """``@worker_startup``: run ``hook(state)`` once per worker process before it
    consumes; what it sets on ``state`` handlers read as ``ctx.state``. A failing hook
    stops the worker before it consumes anything (``workers.lifecycle``)."""
    target = registry if registry is not None else default_registry

    def decorate(fn: K) -> K:
        return target.on_startup(fn)

    return decorate if hook is None else decorate(hook)


def worker_shutdown(hook: K | None = None, *, registry: Registry | None = None) -> Any:
    """``@worker_shutdown``: run ``hook(state)`` once after the worker's last job."""
    target = registry if registry is not None else default_registry

    def decorate(fn: K) -> K:
        return target.on_shutdown(fn)

    return decorate if hook is None else decorate(hook)
