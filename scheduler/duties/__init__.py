"""The leader's duties, one module each, all ``LoopDuty`` subclasses (scheduler/duty.py).

``default_duties(ctx)`` is the list ``duetime scheduler`` runs while it leads; the
replica starts them in this order on every won term and stops them all on loss.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scheduler.duties.dispatcher import Dispatcher
from scheduler.duties.fence_heartbeat import FenceHeartbeat
from scheduler.duties.maintainer import Maintainer
from scheduler.duties.planner import Planner
from scheduler.duties.reconciler import Reconciler
from scheduler.duty import LoopDuty

if TYPE_CHECKING:
    from scheduler.leadership.replica import ReplicaContext

__all__ = ["Dispatcher", "FenceHeartbeat", "Maintainer", "Planner", "Reconciler", "default_duties"]


def default_duties(ctx: ReplicaContext) -> list[LoopDuty]:
    """Every duty of a leader, built once per replica from its shared context."""
    return [
        FenceHeartbeat.from_context(ctx),
        Dispatcher.from_context(ctx),
        Planner.from_context(ctx),
        Reconciler.from_context(ctx),
        Maintainer.from_context(ctx),
    ]
