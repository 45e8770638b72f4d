"""Dispatch credit: how many more messages each job queue may be given now (pure).

The order in which due jobs start is decided in PostgreSQL (priority, then run time;
docs/architecture.md, "Who decides the order"), so the broker must hold only a short
buffer of work that starts soon: a message already in RabbitMQ starts in queue order,
whatever arrives behind it. The dispatcher therefore publishes to a queue only up to
its *target*, the larger of ``buffer`` and ``consumers x per_consumer``, where
``consumers`` is what RabbitMQ reported at the last sample:

    credit = target - (ready at the last sample + published since that sample)

``ready`` counts only messages no consumer holds yet (a quorum queue's declare-ok), so
the consumers' own prefetch windows come on top of the target: the target is the
refill margin between two samples, not the consumers' whole intake.

A queue is given messages again only once at least ``refill`` of its target is free
(its *refill mark*, a quarter by default), then as much as its credit allows: the
broker's buffer is topped up by a claim of a hundred jobs or so rather than by a claim
of a few each time a sample shows a few messages consumed. Measured on a storm of 5,000
jobs (one worker at concurrency 64), refilling on any credit took 330 claim
transactions of 15 jobs on average, each paying the fence check, the claim, the marking
and the commit (docs/benchmarks.md). The mark does not move the bound (a queue never
holds more than its target), and a job arriving behind a buffer being refilled waits for
no more messages than behind a full one. The mark is kept well under the target so the
buffer is refilled while it still holds most of it: a claim and its confirms take tens
of milliseconds, longer on a loaded machine, and the consumers must not run dry
meanwhile.

A sample is a passive ``queue.declare`` on the publisher's channel (one round trip,
no new broker object), taken before a claim for each queue that has received messages
since its last sample or has less credit than its target, at most every ``refresh``
seconds. A queue never sampled (no message published to it yet in this term) has
credit ``buffer``: a term's first batch of a queue is bounded too, even if the previous
leader left that queue full.

Failing closed would stop dispatch with the broker's first hiccup; failing open would
refill the broker without bound. A queue whose sample fails is *blind*: it gets
``buffer`` messages per ``blind_window`` seconds until a sample succeeds again, so a
broker that cannot answer a declare still gets work, at a bounded rate.

A claim that skips a held queue steps over that queue's due rows in index order, one
heap fetch each: 60-100 ms for a held backlog of 200,000 rows, where a claim otherwise
takes about 1 ms. So after such a claim found nothing, the next one waits, the pause
doubling from ``refresh`` up to ``HELD_CLAIM_PAUSE_MAX``; a queue that regains credit,
or a claim that found work, ends the pause. A wake-up (a NOTIFY) does not: producers
writing into the held queue itself would otherwise buy one such claim per pass. The
price: while some queue is held, a job of another, idle queue may wait up to that
second.

Every method is synchronous and reads time only from the clock (tests drive it with a
``ManualClock``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from scheduler.clock import Clock

__all__ = ["DispatchCredit", "claim_limit"]

#: Seconds a blind queue's allowance of ``buffer`` messages lasts.
BLIND_WINDOW = 1.0
#: Longest pause between claims that skip a held queue and found nothing.
HELD_CLAIM_PAUSE_MAX = 1.0


class _Queued(Protocol):
    @property
    def queue(self) -> str: ...


J = TypeVar("J", bound=_Queued)


@dataclass(slots=True)
class _Book:
    ready: int = 0
    consumers: int = 0
    sampled_at: float = float("-inf")
    published: int = 0
    blind_since: float | None = None  # monotonic start of the current blind window


def claim_limit(credit: int, batch_size: int) -> int:
    """The claim's LIMIT for a largest queue credit of ``credit``: the largest power of
    two not above it, at most ``batch_size``. The limit is a literal in the claim's text
    (dispatch.sql), so rounding keeps a handful of prepared statements per connection
    instead of one per credit value; rounding down never locks a row the pass cannot
    publish (a short pass is simply followed by another)."""
    if credit >= batch_size:
        return batch_size
    return 1 << (max(1, credit).bit_length() - 1)


class DispatchCredit:
    """Per-queue dispatch credit (module docstring)."""

    def __init__(
        self,
        *,
        buffer: int,
        per_consumer: int,
        refresh: float,
        clock: Clock,
        blind_window: float = BLIND_WINDOW,
        refill: float = 0.0,
    ) -> None:
        if buffer < 1 or per_consumer < 0 or refresh < 0 or blind_window <= 0:
            raise ValueError("buffer >= 1, per_consumer >= 0, refresh >= 0, blind_window > 0")
        if not 0 <= refill <= 1:
            raise ValueError(f"refill must be between 0 and 1 (got {refill})")
        self.buffer, self.per_consumer, self.refill = buffer, per_consumer, refill
        self.refresh, self.blind_window = refresh, blind_window
        self._clock = clock
        self._books: dict[str, _Book] = {}
        self._pause = 0.0  # current pause of claims that skip held queues
        self._quiet_until = float("-inf")

    # -- reading ---------------------------------------------------------------------

    def target(self, queue: str) -> int:
        book = self._books.get(queue)
        consumers = book.consumers if book else 0
        return max(self.buffer, consumers * self.per_consumer)

    def credit(self, queue: str) -> int:
        """Messages ``queue`` may still be given before its next sample."""
        book = self._books.get(queue)
        if book is None:
            return self.buffer
        if book.blind_since is not None:
            now = self._clock.monotonic()
            if now - book.blind_since >= self.blind_window:  # a new blind allowance
                book.blind_since, book.published = now, 0
        return max(0, self.target(queue) - book.ready - book.published)

    def mark(self, queue: str) -> int:
        """The credit ``queue`` needs before it is given messages again (at least 1)."""
        return max(1, math.ceil(self.refill * self.target(queue)))

    def held(self) -> list[str]:
        """Queues whose credit is under their refill mark: the claim skips them."""
        return sorted(q for q in self._books if self.credit(q) < self.mark(q))

    def without_consumers(self) -> list[str]:
        """Queues whose last sample succeeded and counted no consumer (the staging claim
        skips such a staged queue: nobody would start what it holds)."""
        return sorted(
            q
            for q, book in self._books.items()
            if book.blind_since is None and book.sampled_at > float("-inf") and not book.consumers
        )

    def limit(self, batch_size: int) -> int:
        """The claim's LIMIT: the largest credit of a sampled queue that is not held, or
        ``buffer`` (a queue not sampled yet) when none is; then ``claim_limit``."""
        credits = [c for q in self._books if (c := self.credit(q)) >= self.mark(q)]
        return claim_limit(max(credits) if credits else self.buffer, batch_size)

    def to_sample(self) -> list[str]:
        """Queues whose next claim would be decided on an old sample: some were
        published since, or the queue was not empty, and ``refresh`` has passed."""
        now = self._clock.monotonic()
        return [
            q
            for q, book in self._books.items()
            if (book.published or book.ready or book.blind_since is not None)
            and now - book.sampled_at >= self.refresh
        ]

    def trim(self, jobs: Sequence[J]) -> tuple[list[J], list[J]]:
        """Split a claim (in its order) into what fits each queue's credit and what does
        not (left pending by the caller)."""
        room = {q: self.credit(q) for q in {job.queue for job in jobs}}
        kept: list[J] = []
        over: list[J] = []
        for job in jobs:
            if room[job.queue] > 0:
                room[job.queue] -= 1
                kept.append(job)
            else:
                over.append(job)
        return kept, over

    # -- recording -------------------------------------------------------------------

    def observe(self, queue: str, ready: int, consumers: int) -> None:
        """A sample: ``ready`` messages no consumer holds, ``consumers`` consumers."""
        book = self._books.setdefault(queue, _Book())
        book.ready, book.consumers = max(0, ready), max(0, consumers)
        book.sampled_at, book.published, book.blind_since = self._clock.monotonic(), 0, None

    def observe_failed(self, queue: str) -> None:
        """A sample that failed: the queue is blind (``buffer`` per ``blind_window``)."""
        book = self._books.setdefault(queue, _Book())
        now = self._clock.monotonic()
        book.sampled_at = now
        if book.blind_since is None:
            book.blind_since, book.ready, book.published = now, 0, 0

    def spend(self, queues: Iterable[str]) -> None:
        """Messages confirmed: one per entry of ``queues`` (a job's queue)."""
        for queue, count in Counter(queues).items():
            self._books.setdefault(queue, _Book()).published += count

    def reset(self) -> None:
        """Forget every sample (a new term: what the broker holds is read again)."""
        self._books.clear()
        self.wake()

    # -- claims that skip held queues (module docstring) -----------------------------

    def skip_claim(self, held: Sequence[str]) -> bool:
        """True while a claim skipping ``held`` (non-empty) would only repeat one that
        found nothing."""
        return bool(held) and self._clock.monotonic() < self._quiet_until

    def claimed(self, jobs: int, held: Sequence[str]) -> None:
        """What a claim skipping ``held`` found: nothing starts or doubles the pause."""
        if jobs or not held:
            self.wake()
            return
        self._pause = min(HELD_CLAIM_PAUSE_MAX, max(self.refresh, 2 * self._pause))
        self._quiet_until = self._clock.monotonic() + self._pause

    def wake(self) -> None:
        """End the pause (a queue regained credit, a claim found work, a new term)."""
        self._pause, self._quiet_until = 0.0, float("-inf")
