"""Fence heartbeat: the leader records, every TTL/3, that its epoch is alive.

It writes ``leader_fence.renewed_at`` only where the fence still holds this leader's
epoch, so it is also the cheapest proof that the database still accepts this leader:
once a newer leader has advanced the fence, the next beat raises ``Fenced`` and the
replica (which watches every duty's task) steps down. ``duetime status`` reads the row
to show who leads and how fresh that claim is.

Until the dispatcher exists this is the one duty that writes under the fence; it keeps
the replica's step-down path exercised by a real fenced write.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scheduler.clock import SYSTEM_CLOCK, Clock
from scheduler.duty import LoopDuty
from scheduler.store.fence import FenceStore

if TYPE_CHECKING:
    from scheduler.replica import ReplicaContext


class FenceHeartbeat(LoopDuty):
    """Every ``interval`` seconds: ``UPDATE leader_fence SET renewed_at = now()``
    where the epoch is ours; ``Fenced`` otherwise."""

    name = "fence_heartbeat"

    def __init__(self, fence: FenceStore, *, interval: float, clock: Clock = SYSTEM_CLOCK) -> None:
        if interval <= 0:
            raise ValueError(f"fence heartbeat interval must be > 0 (got {interval})")
        super().__init__(clock=clock)
        self.fence = fence
        self.interval = interval
        self.beats = 0

    @classmethod
    def from_context(cls, ctx: ReplicaContext) -> FenceHeartbeat:
        """One beat per lease renewal period (TTL/3)."""
        return cls(ctx.fence, interval=ctx.settings.lease_ttl / 3, clock=ctx.clock)

    async def run_once(self) -> float:
        await self.fence.heartbeat(self.term.epoch)
        self.beats += 1
        return self.interval
