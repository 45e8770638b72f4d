"""Fence heartbeat: the leader records, every TTL/3, that its epoch is alive.

It writes ``leader_fence.renewed_at`` only where the fence still holds this leader's
epoch, so it is also the cheapest proof that the database still accepts this leader:
once a newer leader has advanced the fence, the next beat raises ``Fenced`` and the
replica (which watches every duty's task) steps down. ``duetime status`` reads the row
to show who leads and how fresh that claim is. It is the one duty that writes under
the fence in every term, even an idle one, so the step-down path never waits for work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from scheduler.duties.base import DutyLoop
from scheduler.duties.context import DutyContext
from scheduler.duties.knobs import check_knobs, config_from_settings, knob

if TYPE_CHECKING:
    from scheduler.config import Settings


def renew_period(settings: Settings) -> float:
    """One beat per lease renewal period."""
    return settings.lease_ttl / 3


@dataclass(frozen=True, slots=True)
class FenceHeartbeatConfig:
    """How often the heartbeat beats (``config_from_settings`` fills it)."""

    interval: float = knob(5.0, setting=renew_period, gt=0)
    """Seconds between beats: the lease TTL / 3."""

    def __post_init__(self) -> None:
        check_knobs(self)


class FenceHeartbeat:
    """Every ``interval`` seconds: ``UPDATE leader_fence SET renewed_at = now()``
    where the epoch is ours; ``Fenced`` otherwise. Built from its ``DutyContext``,
    whose fence store it writes through."""

    name = "fence_heartbeat"

    def __init__(self, ctx: DutyContext, *, config: FenceHeartbeatConfig | None = None) -> None:
        self.config = config or config_from_settings(FenceHeartbeatConfig, ctx.settings)
        self.fence = ctx.fence
        self.interval = self.config.interval
        self.beats = 0
        self.loop = DutyLoop(self, shard=ctx.shard)

    async def run_once(self) -> float:
        await self.fence.heartbeat(self.loop.term.epoch)
        self.beats += 1
        return self.interval
