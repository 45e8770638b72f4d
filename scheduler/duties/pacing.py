"""When the dispatcher claims and how long it sleeps: pure decisions on a ``Clock``.

The dispatcher asks this object at each step of a pass and does the I/O it answers
for (probe the earliest pending run time, claim a batch, sample the backlog):

- **Probe or claim.** Before claiming, a pass probes the earliest pending run time
  (0.2 ms) and sleeps until it, at most ``probe_interval``: that short re-probe is what
  finds rows inserted by plain SQL. It skips the probe under a backlog (full batches
  run back to back) and when the timer the last probe set is up (a job is due now:
  claim at once, one round trip sooner).
- **After a batch.** A full batch means a backlog: claim again at once. A batch with
  failed publishes backs off with jitter, unless it was full and some of it went out.
  A probe that said "due" followed by an empty claim means every due row is locked by
  another transaction (a cancel, a worker's read): look again after ``probe_interval``.
  Otherwise the caller probes again and sleeps as ``idle`` says.
- **Backlog gauge.** Sampled at most every ``backlog_interval`` (a count over the
  pending index).

Every method is synchronous and reads time only from the clock, so tests drive it with
a ``ManualClock`` and a seeded ``random.Random``, without sleeping or services.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from scheduler.backoff import bounded_jitter
from scheduler.clock import Clock


@dataclass(frozen=True, slots=True)
class BatchReport:
    """What one claim transaction did."""

    claimed: int = 0
    published: int = 0
    failed: int = 0
    #: The claim's LIMIT (0: the batch size); a claim that filled it means a backlog.
    limit: int = 0
    #: Queues the claim skipped because their broker buffer was full.
    held: int = 0


class DispatchPacing:
    """The dispatcher's pacing state: backlog, the due timer, failed passes, sampling."""

    def __init__(
        self,
        *,
        batch_size: int,
        probe_interval: float,
        backlog_interval: float,
        clock: Clock,
        rng: random.Random | None = None,
    ) -> None:
        self.batch_size, self.probe_interval = batch_size, probe_interval
        self.backlog_interval = backlog_interval
        self._clock, self._rng = clock, rng
        self.in_backlog = False
        self.failed_passes = 0  # consecutive batches with failed publishes
        self._due_at: float | None = None  # monotonic instant the last probe slept until
        self._backlog_sampled_at = float("-inf")

    def should_probe(self) -> bool:
        """Probe before claiming? Consumes the due timer unless under a backlog."""
        if self.in_backlog:
            return False
        due, self._due_at = self._due_at, None
        return due is None or self._clock.monotonic() < due

    def after_probe(self, wait: float | None) -> float | None:
        """The sleep a probe answer calls for, or None when a job is due: claim now."""
        if wait is None or wait > 0:
            return self.idle(wait)
        return None

    def idle(self, wait: float | None) -> float:
        """Sleep until the next run time ``wait`` seconds away (None: none pending), at
        most ``probe_interval``; arms the due timer when the run time is within it."""
        self._due_at = None
        if wait is None:
            return self.probe_interval
        if 0 < wait <= self.probe_interval:
            self._due_at = self._clock.monotonic() + wait
        return max(0.0, min(wait, self.probe_interval))

    def after_batch(self, report: BatchReport, *, probed: bool) -> float | None:
        """The sleep after a claim transaction, or None: probe again, then ``idle``."""
        full = report.claimed >= (report.limit or self.batch_size)
        if report.failed:
            self.failed_passes += 1
            self.in_backlog = full and report.published > 0
            if self.in_backlog:
                return 0.0
            return bounded_jitter(self.failed_passes, base=0.1, cap=5.0, rng=self._rng)
        self.failed_passes = 0
        self.in_backlog = full
        if full:
            return 0.0
        if report.claimed == 0 and probed:
            return self.probe_interval
        return None

    def after_conflict(self) -> float:
        """The sleep after a claim lost a race (serialization, deadlock, lock timeout)."""
        self.in_backlog = False
        return bounded_jitter(1, base=0.02, rng=self._rng)

    def reset(self) -> None:
        """Probe on the next pass: the LISTEN connection was just (re)opened and the
        NOTIFYs sent meanwhile are lost, or a new term begins."""
        self.in_backlog = False

    def backlog_sample_due(self) -> bool:
        """True at most once per ``backlog_interval``; the caller then samples."""
        now = self._clock.monotonic()
        if now - self._backlog_sampled_at < self.backlog_interval:
            return False
        self._backlog_sampled_at = now
        return True
