"""Concurrency and rate limits: how many more jobs of each limited target may start now
(pure).

A limit caps the jobs of a target (``task:NAME`` or ``queue:NAME``) that are
``dispatched`` at once (``max_running``) and those that start in any ``rate_period``
seconds (``rate_count``); ``per_key`` caps each ``limit_key`` of the target instead (jobs
without a key share one slot pool, key ''). The dispatcher builds an ``Allowance`` in
its fenced transaction from the limits, the dispatched counts (``LimitStore.counts``)
and the starts in each rate's window (``LimitStore.starts``) read there; a slot's room is
the smaller of what both leave. Then:

- the general claim skips every limited task and queue (``skip_tasks``/``skip_queues``);
- the limited claim skips what is ``closed`` (no allowance left) and locks a bounded
  candidate set of the rest, which ``take`` walks in claim order, keeping a job only if
  every limit it falls under has room and charging each of them.

A rate's room is also what its token bucket holds (``scheduler.duties.rate_buckets``:
the window keeps the rate exact, the bucket spreads its starts over the period).

A job under both a task limit and a queue limit is charged to both. After marking the
kept jobs dispatched, the dispatcher logs their starts (``rate_starts``) in the same
transaction, which is what the next claim's window sums. A ``fair`` queue's
jobs are claimed by the fair claim instead (round-robin between keys) and go through
``take`` the same way; a fair queue without ``max_running`` caps nothing. Jobs ``take``
leaves out stay pending (their row locks end at the commit). Synchronous, no I/O.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Protocol, TypeVar

from scheduler.duties.rate_buckets import RateBuckets
from scheduler.store.limits import Closed, Limit, Running, Started

__all__ = ["Allowance", "RunningBound"]

#: The room of a target without a cap (a fair-only queue).
MAX_ROOM = 1 << 30


class _Limited(Protocol):
    @property
    def task(self) -> str: ...

    @property
    def queue(self) -> str: ...

    @property
    def limit_key(self) -> str: ...


J = TypeVar("J", bound=_Limited)


class _Targeted(Protocol):
    @property
    def task(self) -> str: ...

    @property
    def queue(self) -> str: ...


class Allowance:
    """Remaining room per limit (and per key of a per-key limit)."""

    def __init__(
        self,
        limits: Sequence[Limit],
        running: Iterable[Running],
        started: Iterable[Started] = (),
        buckets: RateBuckets | None = None,
    ) -> None:
        self.limits = {lim.target: lim for lim in limits}
        self.buckets = buckets  # spread each rate's starts (None: the window alone)
        self.read_at = buckets.now() if buckets is not None else 0.0  # tokens as of then
        self._charged: Counter[tuple[str, str]] = Counter()  # kept by ``take``, per slot
        self._used: dict[tuple[str, str], int] = {}  # (target, key or '') -> dispatched
        self._started: dict[tuple[str, str], int] = {}  # (target, key or '') -> in window
        self._free_in: dict[tuple[str, str], float] = {}  # when the oldest start leaves
        for row in running:
            for lim in self._matching(row.task, row.queue):
                slot = self._slot(lim, row.limit_key)
                self._used[slot] = self._used.get(slot, 0) + row.count
        for start in started:
            rated = self.limits.get(start.target)
            if rated is None or rated.rate_count is None:
                continue  # a rate removed since: its old starts bind nothing
            slot = self._slot(rated, start.limit_key)
            self._started[slot] = self._started.get(slot, 0) + start.count
            self._free_in[slot] = min(self._free_in.get(slot, start.free_in), start.free_in)

    @property
    def rated(self) -> bool:
        """Whether some limit has a rate (its starts must be logged)."""
        return any(lim.rate_count is not None for lim in self.limits.values())

    @property
    def skip_tasks(self) -> tuple[str, ...]:
        """Tasks the general claim must leave to the limited claim."""
        return tuple(sorted(lim.name for lim in self.limits.values() if lim.kind == "task"))

    @property
    def skip_queues(self) -> tuple[str, ...]:
        return tuple(sorted(lim.name for lim in self.limits.values() if lim.kind == "queue"))

    def _matching(self, task: str, queue: str) -> list[Limit]:
        found = []
        for target in (f"task:{task}", f"queue:{queue}"):
            lim = self.limits.get(target)
            if lim is not None and (lim.max_running is not None or lim.rate_count is not None):
                found.append(lim)  # a fair-only queue caps nothing
        return found

    @staticmethod
    def _slot(lim: Limit, key: str) -> tuple[str, str]:
        return (lim.target, key if lim.per_key else "")

    def room(self, lim: Limit, key: str = "") -> int:
        """Jobs of ``lim``'s target (of ``key``, for a per-key limit) that may start:
        what its cap on running jobs and its rate both leave."""
        slot = self._slot(lim, key)
        room = MAX_ROOM
        if lim.max_running is not None:
            room = min(room, lim.max_running - self._used.get(slot, 0))
        if lim.rate_count is not None:
            room = min(room, lim.rate_count - self._started.get(slot, 0))
            if self.buckets is not None:
                tokens = self.buckets.tokens(lim, slot[1], self.read_at)
                room = min(room, int(tokens + 1e-9) - self._charged[slot])
        return max(0, room)

    def closed(self) -> Closed:
        """Targets with no room, and the keys of per-key limits with none: the limited
        claim leaves them out, so a full key's backlog cannot crowd others' jobs out of
        the bounded candidate set."""
        tasks: list[str] = []
        queues: list[str] = []
        task_keys: list[tuple[str, str]] = []
        queue_keys: list[tuple[str, str]] = []
        for lim in self.limits.values():
            if not lim.per_key:
                if self.room(lim) == 0:
                    (tasks if lim.kind == "task" else queues).append(lim.name)
                continue
            known = (*self._used, *self._started, *self._bucket_slots())
            keys = {key for target, key in known if target == lim.target}
            for key in sorted(keys):
                if self.room(lim, key) == 0:
                    (task_keys if lim.kind == "task" else queue_keys).append((lim.name, key))
        return Closed(tuple(tasks), tuple(queues), tuple(task_keys), tuple(queue_keys))

    def holding(self) -> bool:
        """Whether some limit (or some key of one) has no room left."""
        closed = self.closed()
        return bool(closed.tasks or closed.queues or closed.task_keys or closed.queue_keys)

    def all_closed(self) -> bool:
        """Whether no job of any limited target may start now (a per-key limit is
        never all closed: a key not seen yet has room)."""
        return all(
            not lim.per_key and not lim.fair and self.room(lim) == 0 for lim in self.limits.values()
        )

    def slack(self, limit: int) -> bool:
        """Whether no limit can bind a claim of ``limit`` jobs: every limit is a plain
        cap (no rate, not fair) with room for ``limit`` more (in its busiest key, per
        key). Then the general claim may take the limited targets' jobs with the others,
        as if there were no limits: a job charges one cap of its task and one of its
        queue at most, and each has room for the whole claim. A limit that does not
        bind then costs the count alone (docs/benchmarks.md, issue 23's target 6)."""
        for lim in self.limits.values():
            if lim.fair or lim.rate_count is not None or lim.max_running is None:
                return False
            used = [n for (target, _), n in self._used.items() if target == lim.target]
            if lim.max_running - max(used, default=0) < limit:
                return False
        return True

    def bound(self, limits: Sequence[Limit]) -> int | None:
        """At most how many jobs the limited claim should lock for ``limits``: the room
        of a single limit that is not per key, else None (no bound). With several
        limits a bound would be unfair: candidates of one target, first by priority,
        could fill it while another target with room got none, pass after pass."""
        if len(limits) != 1 or limits[0].per_key:
            return None
        return self.room(limits[0])

    def _bucket_slots(self) -> list[tuple[str, str]]:
        return self.buckets.slots() if self.buckets is not None else []

    def free_in(self) -> float | None:
        """Seconds until a rate that has no room left admits starts again (the soonest
        such): its window frees a start and its bucket holds a slice; None when no rate
        holds anything back (a full ``max_running`` waits for an outcome instead)."""
        waits = []
        for target, key in {*self._free_in, *self._bucket_slots()}:
            lim = self.limits.get(target)
            if lim is None or lim.rate_count is None or self.room(lim, key) > 0:
                continue
            slot = self._slot(lim, key)
            if lim.max_running is not None and self._used.get(slot, 0) >= lim.max_running:
                continue
            wait = 0.0
            if self._started.get(slot, 0) >= lim.rate_count:
                wait = self._free_in.get(slot, 0.0)
            if self.buckets is not None:
                wait = max(wait, self.buckets.wait(lim, key, self._charged[slot]))
            waits.append(wait)
        return max(0.0, min(waits)) if waits else None

    def rate_starts(self, jobs: Iterable[J]) -> dict[tuple[str, str], int]:
        """The starts ``jobs`` (kept and dispatched) make, per rate-limited (target,
        key) slot, to log (``LimitStore.record_starts``)."""
        starts: Counter[tuple[str, str]] = Counter()
        for job in jobs:
            for lim in self._matching(job.task, job.queue):
                if lim.rate_count is not None:
                    starts[self._slot(lim, job.limit_key)] += 1
        return dict(starts)

    def exhausted(self) -> set[tuple[str, str]]:
        """The rated slots ``take`` charged that have no room left (their jobs wait)."""
        return {
            slot
            for slot in self._charged
            if (lim := self.limits.get(slot[0])) is not None and self.room(lim, slot[1]) == 0
        }

    @property
    def fair_queues(self) -> tuple[str, ...]:
        """Queues whose due jobs start round-robin between their keys, with room."""
        return tuple(
            sorted(
                lim.name
                for lim in self.limits.values()
                if lim.fair and (lim.per_key or self.room(lim) > 0)
            )
        )

    def take(self, jobs: Iterable[J], limit: int) -> tuple[list[J], list[J]]:
        """Walk ``jobs`` in order; keep (at most ``limit``) those every matching limit
        has room for, charging them. Returns (kept, left out)."""
        kept: list[J] = []
        left: list[J] = []
        for job in jobs:
            lims = self._matching(job.task, job.queue)
            if len(kept) >= limit or any(self.room(lim, job.limit_key) == 0 for lim in lims):
                left.append(job)
                continue
            for lim in lims:
                slot = self._slot(lim, job.limit_key)
                self._used[slot] = self._used.get(slot, 0) + 1
                if lim.rate_count is not None:
                    self._started[slot] = self._started.get(slot, 0) + 1
                    self._charged[slot] += 1
            kept.append(job)
        return kept, left


class RunningBound:
    """An upper bound on the dispatched jobs of each limited target, kept between exact
    counts so that a claim no limit can bind skips the count (issue 23's target 6: the
    count read every dispatched job of the limited targets on every pass).

    Why it is safe: within one leader term only this dispatcher makes jobs
    ``dispatched`` (the commit-time trigger ``jobs_dispatch_fenced`` refuses any other
    epoch), and outcomes only lower the count. So an exact count read in this term
    (``observe``) plus every job marked dispatched since (``charge``, called inside the
    claim transaction before its commit, so a commit whose answer is lost still counts)
    is never below the truth. The bound is per target, over all its keys, which also
    bounds each key of a per-key limit. It is dropped on a new term (another leader
    dispatched meanwhile), when the limits change (a new target has no count), and
    after ``max_age`` seconds (a dispatched row moved into a limited task by hand is
    counted from then on)."""

    def __init__(self, *, max_age: float) -> None:
        self.max_age = max_age
        self._epoch: int | None = None
        self._read_at = float("-inf")
        self._limits: tuple[Limit, ...] = ()
        self._bound: dict[str, int] = {}

    def reset(self) -> None:
        self._epoch = None
        self._bound = {}

    def _valid(self, epoch: int, limits: Sequence[Limit], now: float) -> bool:
        return (
            self._epoch == epoch
            and now - self._read_at < self.max_age
            and tuple(limits) == self._limits
        )

    def observe(
        self, epoch: int, limits: Sequence[Limit], running: Iterable[Running], now: float
    ) -> None:
        """Start again from an exact count read at ``now`` in term ``epoch``."""
        bound = {lim.target: 0 for lim in limits}
        for row in running:
            for target in (f"task:{row.task}", f"queue:{row.queue}"):
                if target in bound:
                    bound[target] += row.count
        self._epoch, self._read_at, self._limits, self._bound = epoch, now, tuple(limits), bound

    def charge(self, epoch: int, jobs: Iterable[_Targeted]) -> None:
        """Count ``jobs`` (just marked dispatched in term ``epoch``) against the bound."""
        if self._epoch != epoch:
            return  # not this term's bound: the next claim counts anyway
        for job in jobs:
            for target in (f"task:{job.task}", f"queue:{job.queue}"):
                if target in self._bound:
                    self._bound[target] += 1

    def bound(self, target: str) -> int | None:
        """The bound on ``target``'s dispatched jobs, or None without one."""
        return self._bound.get(target) if self._epoch is not None else None

    def slack(self, epoch: int, limits: Sequence[Limit], limit: int, now: float) -> bool:
        """Whether, by the bound alone, no limit can bind a claim of ``limit`` jobs (as
        ``Allowance.slack`` decides from an exact count): then the count is skipped."""
        if not limits or not self._valid(epoch, limits, now):
            return False
        for lim in limits:
            if lim.fair or lim.rate_count is not None or lim.max_running is None:
                return False
            if self._bound.get(lim.target, lim.max_running) + limit > lim.max_running:
                return False
        return True
