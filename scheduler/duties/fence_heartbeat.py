"""Fence heartbeat: the leader records, every TTL/3, that its epoch is alive.

It writes ``leader_fence.renewed_at`` only where the fence still holds this leader's
epoch, so it is also the cheapest proof that the database still accepts this leader:
once a newer leader has advanced the fence, the next beat raises ``Fenced`` and the
replica (which watches every duty's task) steps down. ``duetime status`` reads the row
to show who leads and how fresh that claim is. It is the one duty that writes under
the fence in every term, even an idle one, so the step-down path never waits for work.
"""

from __future__ import annotations

from scheduler.config.shards import DEFAULT_SHARD
from scheduler.duties.base import DutyContext, DutyLoop
from scheduler.store.fence import FenceStore


class FenceHeartbeat:
    """Every ``interval`` seconds: ``UPDATE leader_fence SET renewed_at = now()``
    where the epoch is ours; ``Fenced`` otherwise."""

    name = "fence_heartbeat"

    def __init__(self, fence: FenceStore, *, interval: float, shard: str = DEFAULT_SHARD) -> None:
        if interval <= 0:
            raise ValueError(f"fence heartbeat interval must be > 0 (got {interval})")
        self.fence = fence
        self.interval = interval
        self.beats = 0
        self.loop = DutyLoop(self, shard=shard)

    @classmethod
    def from_context(cls, ctx: DutyContext) -> FenceHeartbeat:
        """One beat per lease renewal period (TTL/3)."""
        return cls(ctx.fence, interval=ctx.settings.lease_ttl / 3, shard=ctx.shard)

    async def run_once(self) -> float:
        await self.fence.heartbeat(self.loop.term.epoch)
        self.beats += 1
        return self.interval
