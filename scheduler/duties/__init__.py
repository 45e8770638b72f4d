"""The leader's duties, one module each, all of one shape (``scheduler.duties.base``).

``default_duties(ctx)`` is the list ``duetime scheduler`` runs while it leads; the
replica starts them in this order on every won term and stops them all on loss.
"""

from __future__ import annotations

from scheduler.duties.base import Duty, DutyContext, from_context
from scheduler.duties.dispatcher import Dispatcher
from scheduler.duties.fence_heartbeat import FenceHeartbeat
from scheduler.duties.maintainer import Maintainer
from scheduler.duties.planner import Planner
from scheduler.duties.reconciler import Reconciler

__all__ = ["Dispatcher", "FenceHeartbeat", "Maintainer", "Planner", "Reconciler", "default_duties"]


def default_duties(ctx: DutyContext) -> list[Duty]:
    """Every duty of a leader, built once per replica from its shared context."""
    return [
        FenceHeartbeat.from_context(ctx),
        from_context(Dispatcher, ctx),
        from_context(Planner, ctx),
        from_context(Reconciler, ctx),
        from_context(Maintainer, ctx),
    ]
