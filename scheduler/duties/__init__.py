"""The leader's duties, one module each, all built one way (``scheduler.duties.context``)
and run by one loop (``scheduler.duties.base``).

``DEFAULT_DUTIES`` are the duties ``duetime scheduler`` runs while it leads, in the
order the replica starts them on every won term (it stops them all on loss);
``default_duties(ctx)`` builds them for one replica.
"""

from __future__ import annotations

from scheduler.duties.base import Duty
from scheduler.duties.context import DutyContext, DutyFactory
from scheduler.duties.dispatcher import Dispatcher
from scheduler.duties.fence_heartbeat import FenceHeartbeat
from scheduler.duties.maintainer import Maintainer
from scheduler.duties.planner import Planner
from scheduler.duties.reconciler import Reconciler

__all__ = [
    "DEFAULT_DUTIES",
    "Dispatcher",
    "DutyContext",
    "FenceHeartbeat",
    "Maintainer",
    "Planner",
    "Reconciler",
    "default_duties",
]

#: Every duty of a leader, in start order: each is built from the replica's context alone.
DEFAULT_DUTIES: tuple[DutyFactory, ...] = (
    FenceHeartbeat,
    Dispatcher,
    Planner,
    Reconciler,
    Maintainer,
)


def default_duties(ctx: DutyContext) -> list[Duty]:
    """Every duty of a leader, built once per replica from its shared context."""
    return [duty(ctx) for duty in DEFAULT_DUTIES]
