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
from collections.abc import Callable
from typing import Any, Self

import asyncpg

from scheduler import db
from scheduler.log import get_logger
from scheduler.sql import load

Q = load("listener")
log = get_logger(__name__)


class ChannelListener:
    def __init__(
        self,
        dsn: str,
        channel: str,
        on_notify: Callable[[], None],
        *,
        on_lost: Callable[[], None] | None = None,
        timeout: float = 10.0,
        application_name: str = "duetime:listen",
    ) -> None:
        self._dsn = dsn
        self._channel = channel
        self._on_notify = on_notify
        self._on_lost = on_lost
        self._timeout = timeout
        self._application_name = application_name
        self._conn: asyncpg.Connection | None = None
        self._lost = False

    @property
    def alive(self) -> bool:
        return self._conn is not None and not self._lost and not self._conn.is_closed()

    async def open(self) -> Self:
        conn = await db.connect(
            self._dsn, timeout=self._timeout, application_name=self._application_name
        )
        try:
            conn.add_termination_listener(self._terminated)
            await conn.add_listener(self._channel, self._notified)
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
            log.warning("listener_check_failed", channel=self._channel, error=repr(exc))
            self._terminated(conn)
            return False
        return True

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None or conn.is_closed():
            return
        conn.remove_termination_listener(self._terminated)
        try:
            await asyncio.wait_for(conn.close(), min(self._timeout, 5.0))
        except Exception:
            with contextlib.suppress(Exception):
                conn.terminate()

    def _notified(self, *_: Any) -> None:
        self._on_notify()

    def _terminated(self, conn: Any) -> None:
        if self._lost:
            return
        self._lost = True
        if not conn.is_closed():
            conn.terminate()
        if self._on_lost is not None:
            self._on_lost()
