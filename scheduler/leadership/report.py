"""What operators see of a replica's terms: log event names, transitions and metrics.

The replica has one code path for every cluster; what it *reports* is a contract that
differs by layout, and this module is the one place that knows how:

- **Unsharded** (no ``DUETIME_SHARDS``: the one shard ``main`` on ``<prefix>/leader``):
  the events ``replica_started``, ``elected``, ``leading``, ``stepping_down``,
  ``resigned``; ``duetime_is_leader``, ``duetime_leader_epoch`` and
  ``duetime_leader_transitions_total{reason}`` with ``reason`` one of
  ``STEP_DOWN_REASONS`` (the elector's own reasons for a lost term, such as
  ``lease_unconfirmed``, are reported as ``lease_lost`` with the raw reason as
  ``detail``). Operators' dashboards, the chaos suite and the docs read these.
- **Sharded**: the same events prefixed ``shard_`` and carrying ``shard``; a term ends
  ``shard_handed_over`` (this node gave the key up) or ``shard_released`` (the elector
  took it); ``duetime_shard_is_leader{shard}``, ``duetime_shard_epoch{shard}``,
  ``duetime_shard_transitions_total{shard,reason}`` with the elector's reasons as they
  are, and ``duetime_is_leader`` while at least one shard is led.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.config.shards import DEFAULT_SHARD
from scheduler.leadership.policy import STEP_DOWN_REASONS
from scheduler.metrics import (
    IS_LEADER,
    LEADER_EPOCH,
    LEADER_TRANSITIONS,
    SHARD_EPOCH,
    SHARD_IS_LEADER,
    SHARD_TRANSITIONS,
)

__all__ = ["Report", "Transition"]


@dataclass(frozen=True, slots=True)
class Transition:
    """One logged state change of one shard, kept in ``Replica.transitions``."""

    event: str  # elected | leading | stepping_down | resigned (unsharded) or
    #             handed_over | released (sharded)
    epoch: int
    reason: str | None
    at: float  # clock.monotonic()
    shard: str = DEFAULT_SHARD


@dataclass(frozen=True)
class Report:
    """The names a replica reports under; ``sharded`` picks the layout (see above)."""

    sharded: bool

    def event(self, step: str) -> str:
        """The transition name of ``step`` (``handed_over``/``released`` end a term)."""
        if not self.sharded and step in ("handed_over", "released"):
            return "resigned"
        return step

    def log_event(self, step: str) -> str:
        """The log event of ``step``: ``elected``, or ``shard_elected`` when sharded."""
        return f"shard_{step}" if self.sharded else self.event(step)

    def reason(self, raw: str, detail: str) -> tuple[str, str]:
        """The step-down ``(reason, detail)`` reported for an end of term ``raw``."""
        if self.sharded or raw in STEP_DOWN_REASONS:
            return raw, detail
        return "lease_lost", raw

    def elected(self, shard: str) -> None:
        if self.sharded:
            SHARD_TRANSITIONS.labels(shard, "elected").inc()

    def leading(self, shard: str, epoch: int) -> None:
        IS_LEADER.set(1)
        if self.sharded:
            SHARD_IS_LEADER.labels(shard).set(1)
            SHARD_EPOCH.labels(shard).set(epoch)
        else:
            LEADER_EPOCH.set(epoch)
            LEADER_TRANSITIONS.labels("elected").inc()

    def stepped_down(self, shard: str, reason: str, *, led: bool, leading_any: bool) -> None:
        """A term of ``shard`` ended for ``reason``; ``led``: its duties had started;
        ``leading_any``: this node still leads some shard."""
        if self.sharded:
            SHARD_IS_LEADER.labels(shard).set(0)
            SHARD_EPOCH.labels(shard).set(0)
            SHARD_TRANSITIONS.labels(shard, reason).inc()
        else:
            if led:
                LEADER_EPOCH.set(0)
            LEADER_TRANSITIONS.labels(reason).inc()
        if not leading_any:
            IS_LEADER.set(0)
