"""Starting a long-running service whose dependencies are not ready (yet).

Why this exists: a worker or replica that dies because RabbitMQ answered one
``queue.declare`` with ``INTERNAL_ERROR`` (a quorum queue's Raft group still starting on
a loaded broker), or because PostgreSQL was restarting at that moment, turns a blip into
a process restart at best (systemd, ``RestartSec=2s``) and a silent outage at worst (any
supervisor that gives up, or none). Long-running services therefore retry their start
on *transient* errors with a jittered, bounded back-off, log every failed attempt with
the reason and the delay, and stay stoppable throughout: SIGTERM while retrying is a
clean exit, and so is SIGTERM during an attempt (a connect to a broker that accepts TCP
and never answers waits ``amqp_timeout``; the attempt is cancelled, not awaited).

What is *not* transient fails at once, with its one-line error: bad credentials, a
missing database or vhost, a TLS certificate that does not verify, a queue declared
with other arguments (``InvalidInput``), bad configuration. Retrying those would only
hide the mistake behind a log line that repeats forever.

One-shot commands (``duetime migrate``, ``jobs``, ``status``) do not retry: they report
the error and exit 1, so scripts see it immediately.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import aiormq.exceptions

from scheduler.backoff import bounded_jitter
from scheduler.db import DB_REFUSED, DB_UNAVAILABLE
from scheduler.errors import DuetimeError, ServiceUnavailable, describe
from scheduler.log import get_logger

log = get_logger(__name__)

START_RETRY_BASE = 0.5
START_RETRY_CAP = 10.0

# Refusals that will not change by waiting: the broker or database said "no" to us.
_PERMANENT_AMQP = (
    aiormq.exceptions.ProbableAuthenticationError,
    aiormq.exceptions.AuthenticationError,
    aiormq.exceptions.ConnectionNotAllowed,  # vhost missing or not permitted
    aiormq.exceptions.IncompatibleProtocolError,
)


def is_permanent_cause(exc: BaseException) -> bool:
    """True for a connection failure that waiting will not fix (credentials, missing
    database or vhost, TLS verification)."""
    return isinstance(exc, (*_PERMANENT_AMQP, *DB_REFUSED))  # DB_REFUSED has TLS verification


def is_transient(exc: BaseException) -> bool:
    """Whether a failed start is worth retrying."""
    if isinstance(exc, ServiceUnavailable):
        return exc.transient
    if isinstance(exc, DuetimeError) or is_permanent_cause(exc):
        return False
    # aiormq connection errors are OSErrors; a channel closed under our feet is not
    return isinstance(exc, (*DB_UNAVAILABLE, aiormq.exceptions.ChannelInvalidStateError))


async def start_with_retry(
    start: Callable[[], Awaitable[None]],
    stop: asyncio.Event,
    *,
    service: str,
    base: float = START_RETRY_BASE,
    cap: float = START_RETRY_CAP,
) -> bool:
    """Run ``start`` until it succeeds (True) or ``stop`` is set while waiting (False).

    ``start`` must clean up after itself when it raises or is cancelled (close what it
    opened), so that it can simply be called again, or abandoned when ``stop`` is set
    during an attempt. A non-transient error propagates unchanged.
    """
    failures = 0
    while True:
        try:
            if not await _unless_stopped(start, stop):
                log.info("service_start_abandoned", service=service, attempts=failures + 1)
                return False
        except Exception as exc:
            if not is_transient(exc):
                raise
            failures += 1
            delay = bounded_jitter(failures, base=base, cap=cap)
            log.warning(
                "service_start_failed",
                service=service,
                attempt=failures,
                error=describe(exc),
                retry_in=round(delay, 3),
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
                log.info("service_start_abandoned", service=service, attempts=failures)
                return False
            continue
        if failures:
            log.info("service_start_recovered", service=service, attempts=failures + 1)
        return True


async def _unless_stopped(start: Callable[[], Awaitable[None]], stop: asyncio.Event) -> bool:
    """Run one ``start`` attempt; False (the attempt cancelled and awaited) if ``stop``
    is set first. The attempt's own errors propagate."""
    if stop.is_set():
        return False
    attempt = asyncio.ensure_future(start())
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({attempt, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # both tasks are owned here: none outlives the call
        stopped.cancel()
        attempt.cancel()  # a no-op once it finished
        await asyncio.gather(stopped, attempt, return_exceptions=True)
    if attempt.cancelled():
        return False
    if attempt.exception() is not None and stop.is_set():
        # abandoned: whatever the attempt made of its cancellation (aiormq's connect
        # turns a cancel during its handshake into StopAsyncIteration) is not an error
        # of the start, and a stop must not end in a traceback
        return False
    attempt.result()  # raises the attempt's error
    return True
