"""Typed rows returned by the stores (never raw asyncpg Records past the store)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any, Literal

JobStatus = Literal["pending", "dispatched", "succeeded", "dead", "cancelled"]
JOB_STATUSES: tuple[str, ...] = ("pending", "dispatched", "succeeded", "dead", "cancelled")
TERMINAL_STATUSES: frozenset[str] = frozenset({"succeeded", "dead", "cancelled"})
#: What decoding a row can raise in the client (asyncpg's codecs, scheduler/db.py's jsonb
#: decoder) as opposed to the database refusing a statement: a date outside Python's
#: years 1-9999 (OverflowError), JSON nested deeper than its parser goes (RecursionError).
UNREADABLE: tuple[type[Exception], ...] = (OverflowError, RecursionError, ValueError)


@dataclass(frozen=True, slots=True)
class Job:
    id: int
    task: str
    payload: dict[str, Any]
    queue: str
    due_at: datetime
    run_at: datetime | None
    status: str
    attempt: int
    max_attempts: int
    idempotency_key: str | None
    created_at: datetime
    dispatched_at: datetime | None
    heartbeat_at: datetime | None
    finished_at: datetime | None
    dispatch_epoch: int | None
    last_error: str | None
    schedule_id: int | None

    @property
    def effective_key(self) -> str:
        """The ledger key: the row's own, or ``job:<id>`` (DESIGN §3)."""
        return self.idempotency_key or f"job:{self.id}"

    @property
    def next_run_at(self) -> datetime:
        return self.run_at or self.due_at

    @classmethod
    def from_record(cls, record: Any) -> Job:
        return cls(**{name: record[name] for name in cls.__slots__})

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for key, value in out.items():
            if isinstance(value, datetime):
                out[key] = value.isoformat()
        return out


@dataclass(frozen=True, slots=True)
class ClaimedJob:
    """What the dispatcher needs to publish a job: the message is a pointer at the row
    (scheduler/messages.py), so neither the payload nor the idempotency key is read."""

    id: int
    task: str
    queue: str
    due_at: datetime
    attempt: int
    run_at: datetime | None = None

    @classmethod
    def from_record(cls, record: Any) -> ClaimedJob:
        return cls(
            id=record["id"],
            task=record["task"],
            queue=record["queue"],
            due_at=record["due_at"],
            attempt=record["attempt"],
            run_at=record["run_at"],
        )


@dataclass(frozen=True, slots=True)
class FenceState:
    epoch: int
    leader_node: str | None
    elected_at: datetime | None
    renewed_at: datetime | None
