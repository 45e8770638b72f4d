"""The duties of one replica: built once, started on every won term, stopped on loss.

The replica (``scheduler.leadership.replica``) owns the term: when it may lead and
when it must step down. This module owns what runs during a term: each duty's loop is
started with the term, its task is what the replica watches (a duty task that ends,
for whatever reason, ends the term: a duty must never be dead while the replica still
claims leadership), and on every step-down all of them are stopped concurrently and
their cleanup awaited, each bounded by ``stop_timeout``, before the replica resigns.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from scheduler.duties.base import Duty, LeaderTerm
from scheduler.duties.context import DutyContext

__all__ = ["DUTY_STOP_TIMEOUT", "DutiesFactory", "DutySet"]

#: A duty whose cleanup takes longer is abandoned (and logged).
DUTY_STOP_TIMEOUT = 10.0

DutiesFactory = Callable[[DutyContext], Sequence[Duty]]


class DutySet:
    """The replica's duties, by unique name, and the ones running in this term."""

    def __init__(self, duties: Sequence[Duty], *, stop_timeout: float = DUTY_STOP_TIMEOUT) -> None:
        names = [d.name for d in duties]
        if len(set(names)) != len(names):
            raise ValueError(f"duty names must be unique, got {names}")
        self.duties = list(duties)
        self.names = names
        self.stop_timeout = stop_timeout
        self.running: list[Duty] = []

    def start(self, term: LeaderTerm, log: Any) -> list[Duty]:
        """Start every duty's loop in ``term``; a duty that fails to start is logged and
        left out (``tasks`` then reports it, and the term ends)."""
        self.running = []
        for duty in self.duties:
            try:
                duty.loop.start(term)
            except Exception:
                log.exception("duty_start_failed", duty=duty.name)
                continue
            self.running.append(duty)
        return self.running

    def tasks(self) -> tuple[dict[str, asyncio.Future[Any]], str | None]:
        """The running duties' tasks by name, and the first duty not running (or None)."""
        tasks: dict[str, asyncio.Future[Any]] = {}
        for duty in self.duties:
            task = duty.loop.task if duty in self.running else None
            if task is None:
                return tasks, duty.name
            tasks[duty.name] = task
        return tasks, None

    async def stop(self, log: Any) -> list[Duty]:
        """Stop the running duties and await their cleanup, concurrently, each bounded by
        ``stop_timeout``. Returns the duties that were running."""
        running, self.running = self.running, []
        if not running:
            return running

        async def stop_one(duty: Duty) -> None:
            try:
                await asyncio.wait_for(duty.loop.stop(), self.stop_timeout)
            except TimeoutError:
                log.error("duty_stop_timeout", duty=duty.name, timeout=self.stop_timeout)
            except Exception:
                log.exception("duty_stop_failed", duty=duty.name)

        await asyncio.gather(*(stop_one(d) for d in running))
        return running
