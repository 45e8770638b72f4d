"""Which shards this node should lead: a pure decision from one view of the cluster.

**The goal.** With R live members and K shards, nobody leads more than ⌈K/R⌉ once
stable, every shard is led, and shards move as little as possible: a join moves only
the shards the newcomer needs, a death moves only the dead node's shards.

**One plan, computed by everyone.** Every node reads the same etcd snapshot (members,
and who leads each shard) and runs the same deterministic ``plan``:

1. Quotas: ``K mod R`` members may lead ⌈K/R⌉, the others ⌊K/R⌋. The larger quotas go
   to the members that already lead the most (ties: a stable hash of the node id), so
   a node is never asked to drop a shard that another node would then have to pick up
   only to keep the count even.
2. Keep: each member keeps its current shards up to its quota, the ones whose
   rendezvous score (a stable hash of shard and node) is highest for it; the rest is
   surplus.
3. Fill: unled and surplus shards go to members with room, best rendezvous score
   first over all (shard, member) pairs, so the same shard tends to land on the same
   node whatever order things happened in.

Shards held by a node that is not a member (its member key is gone but a key was read
before it expired) are left where they are: nobody can take them until they vanish.

**Acting on it (``Assigner.decide``).** A node *campaigns* for every shard the plan
gives it that it does not lead: at once when the shard is unled (a dead node's shards
are re-led as soon as its lease expires), and as a standby when another node still
leads it (it takes the key the moment that node resigns). It *resigns* planned surplus
only after the membership has been unchanged for ``settle`` seconds (at most
``max_resign`` shards per decision when set): a node that joins, leaves and rejoins
causes no storm. A node that has itself been running for less than ``settle`` takes
only shards that have been unled for ``grace``: at a cold start the first process does
not grab every shard only to hand most of them over as the others arrive. Views of
different nodes may differ for a moment (each reads etcd on its own); a shard that
stays unled for ``grace`` seconds is campaigned for by every node below ⌈K/R⌉,
whatever its own plan says, so a disagreement can delay the balance but never leave a
shard without a leader.

The module does no I/O and reads time only through ``clock.monotonic()``, so tests
drive it round by round (tests/unit/test_shard_assignment.py).
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

__all__ = [
    "Assigner",
    "Decision",
    "View",
    "plan",
    "rendezvous_order",
    "score",
    "target",
]

DEFAULT_SETTLE = 1.0
DEFAULT_GRACE = 1.0


class MonotonicClock(Protocol):
    def monotonic(self) -> float: ...


def score(shard: str, node: str) -> int:
    """Rendezvous (highest-random-weight) score: the same on every node and run."""
    digest = hashlib.blake2b(f"{shard}\0{node}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def _node_hash(node: str) -> int:
    return int.from_bytes(hashlib.blake2b(node.encode(), digest_size=8).digest(), "big")


def rendezvous_order(shard: str, members: Iterable[str]) -> list[str]:
    """Members from the one ``shard`` prefers most to the one it prefers least."""
    return sorted(members, key=lambda node: (-score(shard, node), node))


def target(shards: int, members: int) -> int:
    """⌈K/R⌉: the most shards one member may lead once stable."""
    return -(-shards // members) if members else shards


@dataclass(frozen=True)
class View:
    """One consistent read of the cluster: live members and the holder of each shard.

    ``leaders`` maps a shard to the node id in its key; shards absent from it (or
    mapped to None) are unled."""

    members: frozenset[str]
    shards: tuple[str, ...]
    leaders: Mapping[str, str | None] = field(default_factory=dict)

    def holder(self, shard: str) -> str | None:
        return self.leaders.get(shard)

    def led_by(self, node: str) -> set[str]:
        return {s for s in self.shards if self.leaders.get(s) == node}

    def unled(self) -> list[str]:
        return [s for s in self.shards if self.leaders.get(s) is None]


def plan(view: View) -> dict[str, set[str]]:
    """The balanced assignment everyone computes from ``view``: member -> shards."""
    members = sorted(view.members)
    if not members:
        return {}
    shards = list(dict.fromkeys(view.shards))
    low, extra = divmod(len(shards), len(members))
    current = {m: view.led_by(m) for m in members}
    by_load = sorted(members, key=lambda m: (-len(current[m]), _node_hash(m), m))
    quota = {m: low + (1 if i < extra else 0) for i, m in enumerate(by_load)}

    result: dict[str, set[str]] = {}
    placed: set[str] = set()
    for m in members:
        keep = sorted(current[m], key=lambda s: (-score(s, m), s))[: quota[m]]
        result[m] = set(keep)
        placed.update(keep)
    member_set = set(members)
    for s in shards:  # held by a non-member: stays put until its key expires
        holder = view.holder(s)
        if holder is not None and holder not in member_set:
            placed.add(s)

    pool = [s for s in shards if s not in placed]
    if pool:
        room = {m: quota[m] - len(result[m]) for m in members}
        pairs = sorted(
            ((s, m) for s in pool for m in members if room[m] > 0),
            key=lambda p: (-score(p[0], p[1]), p[0], p[1]),
        )
        for s, m in pairs:
            if s in placed or room[m] <= 0:
                continue
            result[m].add(s)
            room[m] -= 1
            placed.add(s)
    return result


@dataclass(frozen=True)
class Decision:
    """What this node should do now.

    ``campaign``: shards to take when they are (or become) unled, most wanted first;
    take at most ``room`` of them now (⌈K/R⌉ minus what this node leads), so a node
    winning several races at once never overshoots. ``resign``: shards to hand over
    now. ``target``: ⌈K/R⌉ for this view. ``settled``: the membership has been stable
    for the settle time (so surplus may be handed over)."""

    campaign: tuple[str, ...]
    resign: frozenset[str]
    target: int
    settled: bool
    room: int


class Assigner:
    """Turns views into decisions for one node, with the hysteresis described above."""

    def __init__(
        self,
        node_id: str,
        clock: MonotonicClock,
        *,
        settle: float = DEFAULT_SETTLE,
        grace: float = DEFAULT_GRACE,
        max_resign: int | None = None,
    ) -> None:
        if not node_id:
            raise ValueError("node_id must not be empty")
        if settle < 0 or grace < 0:
            raise ValueError(f"settle and grace must be >= 0 (got {settle}, {grace})")
        if max_resign is not None and max_resign < 1:
            raise ValueError(f"max_resign must be >= 1 (got {max_resign})")
        self.node_id = node_id
        self.settle = settle
        self.grace = grace
        self.max_resign = max_resign
        self._clock = clock
        self._born: float | None = None
        self._members: frozenset[str] | None = None
        self._members_since = 0.0
        self._unled_since: dict[str, float] = {}

    def decide(self, view: View, *, leading: Collection[str] | None = None) -> Decision:
        """The decision for ``view``. ``leading`` is what this node believes it leads
        (default: what the view says); a shard it believes it leads is never resigned
        unless the view agrees, and never campaigned for."""
        now = self._clock.monotonic()
        if self._born is None:
            self._born = now
        young = now - self._born < self.settle
        members = view.members | {self.node_id}
        if members != self._members:
            self._members, self._members_since = members, now
        for s in view.shards:
            if view.holder(s) is None:
                self._unled_since.setdefault(s, now)
            else:
                self._unled_since.pop(s, None)
        for s in set(self._unled_since) - set(view.shards):
            del self._unled_since[s]

        full = View(members, view.shards, view.leaders)
        mine_in_view = full.led_by(self.node_id)
        mine = mine_in_view if leading is None else set(leading)
        wanted = plan(full).get(self.node_id, set())
        high = target(len(view.shards), len(members))
        settled = now - self._members_since >= self.settle

        def preference(shard: str) -> tuple[int, str]:
            return (-score(shard, self.node_id), shard)

        campaign: list[str] = []
        if not young:
            campaign = sorted(
                (s for s in wanted - mine if view.holder(s) != self.node_id), key=preference
            )
        room = max(0, high - len(mine))
        if room:
            stale = sorted(
                (s for s, since in self._unled_since.items()
                 if now - since >= self.grace and s not in mine and s not in campaign),
                key=preference,
            )  # fmt: skip
            campaign.extend(stale[:room])

        resign: set[str] = set()
        if settled:
            surplus = sorted(
                (mine & mine_in_view) - wanted, key=lambda s: (score(s, self.node_id), s)
            )
            resign = set(surplus if self.max_resign is None else surplus[: self.max_resign])
        return Decision(tuple(campaign), frozenset(resign), high, settled, room)
