"""The settlement vocabulary: what happened to an attempt's commit (``Verdict``), and what
a delivery ended as (``Outcome``). ``workers.settlement`` maps the one to the other; the
transaction groups (``workers.groups``) hand out verdicts too, and sit below it.
"""

from __future__ import annotations

from enum import Enum, StrEnum

__all__ = ["Outcome", "Verdict"]


class Outcome(StrEnum):
    """What a delivery ended as; every value means it is settled and may be acked."""

    SUCCEEDED = "succeeded"
    RETRIED = "retried"
    DEAD = "dead"
    SKIPPED = "skipped"  # stale, duplicate, or superseded: nothing to do
    CANCELLED = "cancelled"  # the job was cancelled while its handler ran (workers.cancel)
    SNOOZED = "snoozed"  # back to pending at the same attempt (workers.snooze)


class Verdict(Enum):
    """What happened to an attempt's commit (the table in ``workers.settlement``)."""

    COMMITTED = "committed"
    FAILED = "failed"
    RERUN = "rerun"
    SUPERSEDED = "superseded"
    DUPLICATE = "duplicate"
