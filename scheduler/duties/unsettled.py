"""Jobs the dispatcher published whose claim then failed to commit: pure bookkeeping on a
``Clock``, so the dispatcher publishes each such job again at most once.

Why: the dispatcher publishes before it commits (``scheduler.duties.dispatcher``). When
the claim transaction dies after RabbitMQ confirmed the batch (its connection killed,
the database restarting), every row stays ``pending`` and the next claim takes the same
rows, earliest first, and publishes them again. A storm of connection kills repeated
that for every batch it hit: a benchmark saw 51 failed commits put 23,833 stale
messages into the queue, which the workers then had to read and skip.

What the dispatcher does with this memory: a claimed job that is remembered here (same
id, same attempt) is not published inside the claim transaction. It is marked
``dispatched`` with the others, and published *after* the commit: if that commit fails
too, nothing more went out, and when it succeeds the job gets a message that no longer
depends on the transaction (the copy from the failed claim may already have been read
and dropped by a worker, which saw the row ``pending``; so the job is never left without
a message). A publish after the commit that RabbitMQ does not confirm leaves the job
``dispatched`` without a message, for the reconciler (``visibility_timeout``), like a
crash between a commit and a publish. The copies of one attempt are thereby bounded at
two: the one from the first failed claim and the one after the commit.

Bounded: an entry lives ``ttl`` seconds (a job claimed again later simply takes the
ordinary path), and at most ``capacity`` entries are kept, the oldest dropped first. The
memory belongs to one dispatcher object and outlives its ``teardown`` (the duty loop
tears down after every failed pass, which is exactly when it is needed); a new leader
starts without it, so its first claim of such a job publishes inside the transaction,
as any claim does: one more copy at most.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from scheduler.clock import Clock
from scheduler.store.rows import ClaimedJob

#: How long a confirmed-but-uncommitted job is remembered (seconds).
DEFAULT_TTL = 60.0
#: Most jobs remembered at once (a few MB at most).
DEFAULT_CAPACITY = 100_000


class Unsettled:
    """(job id, attempt) of jobs published by a claim that did not commit."""

    def __init__(
        self, *, clock: Clock, ttl: float = DEFAULT_TTL, capacity: int = DEFAULT_CAPACITY
    ) -> None:
        if not ttl > 0 or capacity < 1:
            raise ValueError(f"ttl must be > 0 and capacity >= 1 (got {ttl!r}, {capacity!r})")
        self._clock, self.ttl, self.capacity = clock, ttl, capacity
        self._since: OrderedDict[tuple[int, int], float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._since)

    def remember(self, jobs: Iterable[ClaimedJob]) -> None:
        now = self._clock.monotonic()
        for job in jobs:
            key = (job.id, job.attempt)
            self._since.pop(key, None)
            self._since[key] = now
        while len(self._since) > self.capacity:
            self._since.popitem(last=False)

    def forget(self, jobs: Iterable[ClaimedJob]) -> None:
        for job in jobs:
            self._since.pop((job.id, job.attempt), None)

    def split(self, jobs: Sequence[ClaimedJob]) -> tuple[list[ClaimedJob], list[ClaimedJob]]:
        """``jobs`` as (to publish in the transaction, to publish after the commit):
        the second are the remembered ones."""
        self._expire()
        if not self._since:
            return list(jobs), []
        fresh: list[ClaimedJob] = []
        again: list[ClaimedJob] = []
        for job in jobs:
            (again if (job.id, job.attempt) in self._since else fresh).append(job)
        return fresh, again

    def clear(self) -> None:
        self._since.clear()

    def _expire(self) -> None:
        oldest = self._clock.monotonic() - self.ttl
        while self._since:
            key, since = next(iter(self._since.items()))
            if since > oldest:
                return
            del self._since[key]
