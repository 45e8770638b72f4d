"""Raising the fence on a won term: the one step every leader takes before its duties.

The replica (``replica.Replica``) wins a shard's term in etcd, then writes its epoch
to that shard's ``leader_fence`` (``FenceStore.advance``) before any duty may act. The update
may wait for an older leader's open transaction, so it is raced against whatever ends
the term meanwhile (a lost shard, a stop request): the caller passes those
as ``abort``. The lock timeout outwaits a paused predecessor (PostgreSQL kills its
transaction after about one TTL, ``policy.session_settings``), and ``takeover_grace``
lets ``advance`` end a frozen zombie's session that still holds the fence row
(``scheduler.store.fenced``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Collection
from typing import Any

from scheduler.config import Settings
from scheduler.errors import describe
from scheduler.store.fence import FenceStore

__all__ = ["FENCE_READ_TIMEOUT", "advance_fence", "fence_lock_timeout"]

#: Bound on the read that reports which epoch a fence that is ahead holds.
FENCE_READ_TIMEOUT = 5.0


def fence_lock_timeout(settings: Settings) -> float:
    """Long enough to outwait a paused predecessor's transaction (killed after ~TTL)."""
    return settings.lease_ttl * 1.5 + 1.0


async def advance_fence(
    fence: FenceStore,
    epoch: int,
    node_id: str,
    settings: Settings,
    *,
    abort: Collection[asyncio.Future[Any]],
    log: Any,
) -> tuple[str, str] | None:
    """Raise the fence to ``epoch`` unless one of ``abort`` finishes first.

    Returns ``("", "")`` once the fence holds ``epoch``; ``("fence_error", detail)`` when
    the update failed; ``("fenced", detail)`` when the fence already holds a newer
    epoch; ``None`` when an ``abort`` future finished first (the update is cancelled and
    the caller knows why the term ended).
    """
    advance = asyncio.create_task(
        fence.advance(
            epoch,
            node_id,
            lock_timeout=fence_lock_timeout(settings),
            takeover_grace=settings.fence_takeover_grace,
        ),
        name=f"fence:advance:{epoch}",
    )
    await asyncio.wait({advance, *abort}, return_when=asyncio.FIRST_COMPLETED)
    if not advance.done():
        advance.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await advance
        return None
    if advance.cancelled() or advance.exception() is not None:
        exc = advance.exception() if not advance.cancelled() else None
        error = describe(exc) if exc else "cancelled"
        log.error("fence_advance_failed", error=error)
        return "fence_error", error
    if not advance.result():
        fence_epoch: int | None = None
        with contextlib.suppress(Exception):
            fence_epoch = (await asyncio.wait_for(fence.read(), FENCE_READ_TIMEOUT)).epoch
        log.error(
            "fence_ahead",
            fence_epoch=fence_epoch,
            hint="a newer leader exists; if the etcd cluster was rebuilt (revisions "
            "restarted), reset duetime.leader_fence.epoch to 0 with no scheduler running",
        )
        return "fenced", f"fence holds epoch {fence_epoch}"
    log.info("fence_advanced")
    return "", ""
