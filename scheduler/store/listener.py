"""ChannelListener: a dedicated connection LISTENing on one NOTIFY channel.

Duties that wake on NOTIFY (dispatcher on ``duetime_jobs``, planner on
``duetime_schedules``) share this. ``on_notify`` is called for every notification.
``alive`` turns false as soon as asyncpg sees the connection end (termination
listener) and ``on_lost`` is called, so the owner can fall back to probing and
reconnect. A half-open TCP connection is only noticed by traffic: ``check()`` runs a
trivial query under a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, Self

import asyncpg

from scheduler import db
from scheduler.backoff import bounded_jitter
from scheduler.clock import SYSTEM_CLOCK, Clock
from scheduler.errors import ServiceUnavailable
from scheduler.log import get_logger
from scheduler.sql import load

Q = load("listener")
log = get_logger(__name__)


@dataclass(eq=False)
class ChannelListener:
    """One LISTEN connection (module docstring); ``open()`` connects it."""

    dsn: str
    channel: str
    on_notify: Callable[[], None]
    _: KW_ONLY
    on_lost: Callable[[], None] | None = None
    #: called with each notification's payload (before ``on_notify``), when set
    on_payload: Callable[[str], None] | None = None
    timeout: float = 10.0
    application_name: str = "duetime:listen"
    _conn: asyncpg.Connection | None = field(default=None, init=False, repr=False)
    _lost: bool = field(default=False, init=False, repr=False)

    @property
    def alive(self) -> bool:
        return self._conn is not None and not self._lost and not self._conn.is_closed()

    async def open(self) -> Self:
        conn = await db.connect(
            self.dsn, timeout=self.timeout, application_name=self.application_name
        )
        try:
            conn.add_termination_listener(self._terminated)
            await conn.add_listener(self.channel, self._notified)
        except BaseException:
            conn.terminate()
            raise
        self._conn, self._lost = conn, False
        return self

    async def check(self, timeout: float) -> bool:
        """Round-trip on the connection; False (and closed) when it does not answer."""
        conn = self._conn
        if conn is None or not self.alive:
            return False
        try:
            await conn.fetchval(Q["ping"], timeout=timeout)
        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError, TimeoutError) as exc:
            log.warning("listener_check_failed", channel=self.channel, error=repr(exc))
            self._terminated(conn)
            return False
        return True

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None or conn.is_closed():
            return
        conn.remove_termination_listener(self._terminated)
        try:
            await asyncio.wait_for(conn.close(), min(self.timeout, 5.0))
        except Exception:
            with contextlib.suppress(Exception):
                conn.terminate()

    def _notified(self, _conn: Any, _pid: int, _channel: str, payload: object) -> None:
        if self.on_payload is not None:
            self.on_payload(str(payload))
        self.on_notify()

    def _terminated(self, conn: Any) -> None:
        if self._lost:
            return
        self._lost = True
        if not conn.is_closed():
            conn.terminate()
        if self.on_lost is not None:
            self.on_lost()


class KeptListener:
    """A ``ChannelListener`` a duty keeps open across passes.

    ``ensure()`` is called at the start of every pass: it pings a live connection every
    ``check_interval`` (a half-open socket is silent), replaces a dead one, and retries a
    failed connect with jittered back-off while the duty runs on probes. It returns True
    when a fresh connection was just opened — NOTIFYs sent while nobody listened are
    lost, so the caller should probe once. ``log`` returns the duty's current logger
    (it is re-bound with node id and epoch at every term); ``clock`` times the pings
    and the back-off.
    """

    def __init__(
        self,
        dsn: str,
        channel: str,
        on_notify: Callable[[], None],
        *,
        timeout: float,
        application_name: str,
        check_interval: float,
        log: Callable[[], Any],
        clock: Clock = SYSTEM_CLOCK,
        on_payload: Callable[[str], None] | None = None,
    ) -> None:
        #: a fresh ChannelListener, each time the kept one must be replaced
        self._new = functools.partial(
            ChannelListener,
            dsn,
            channel,
            on_notify,
            on_lost=on_notify,
            on_payload=on_payload,
            timeout=timeout,
            application_name=application_name,
        )
        self._channel = channel
        self._timeout = timeout
        self._check_interval = check_interval
        self._log = log
        self._clock = clock  # paces the liveness checks and the reconnect back-off
        self._listener: ChannelListener | None = None
        self._failures = 0
        self._retry_at = 0.0
        self._checked_at = 0.0

    @property
    def alive(self) -> bool:
        return self._listener is not None and self._listener.alive

    async def ensure(self) -> bool:
        now = self._clock.monotonic()
        listener = self._listener
        if listener is not None and listener.alive:
            if now - self._checked_at < self._check_interval:
                return False
            self._checked_at = now
            if await listener.check(timeout=min(2.0, self._timeout)):
                return False
        if listener is not None:
            self._listener = None
            await listener.close()
            self._log().warning("listener_lost", channel=self._channel)
        if now < self._retry_at:
            return False
        fresh = self._new()
        try:
            await fresh.open()
        except (ServiceUnavailable, asyncpg.PostgresError, OSError) as exc:
            self._failures += 1
            delay = bounded_jitter(self._failures, base=0.5, cap=10.0)
            self._retry_at = now + delay
            self._log().warning(
                "listener_connect_failed",
                channel=self._channel,
                error=str(exc),
                retry_in=round(delay, 2),
            )
            return False
        if self._failures:
            self._log().info(
                "listener_restored", channel=self._channel, after_failures=self._failures
            )
        self._listener, self._failures, self._checked_at = fresh, 0, now
        return True

    async def close(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            await listener.close()
