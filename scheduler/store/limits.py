"""LimitStore: the concurrency and rate limits an operator sets (``sql/limits.sql``,
migrations 0016 and 0018), and the reads and writes the dispatcher enforces them with.

A limit caps how many jobs of a target (``task:NAME`` or ``queue:NAME``; with
``per_key``, of each ``limit_key`` of it) are ``dispatched`` at once (``max_running``)
and how many start per period (``rate_count`` per ``rate_period`` seconds). The rows are
the only state: the dispatcher counts the dispatched jobs (``counts``) and the logged
starts of the window (``starts``) in its fenced transaction before each claim, and logs
its own starts in it (``record_starts``), so a crash of a worker or a leader can neither
leak a slot nor reset a rate's budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from scheduler.errors import InvalidInput
from scheduler.jobspec import RATE_PERIODS, parse_limit_target, parse_rate
from scheduler.sql import load
from scheduler.store.conn import Conn, PooledStore, local_setting
from scheduler.store.rows import ClaimedJob

Q = load("limits")

#: The payload of the NOTIFY on ``duetime_jobs`` a settling function sends when the job
#: it settled held a ``max_running`` slot (migration 0024).
SLOT_PAYLOAD = "slot"

#: Largest ``max_running`` (CHECK limits_max_running_positive).
MAX_RUNNING_LIMIT = 1_000_000

_PERIOD_UNITS = {seconds: unit for unit, seconds in RATE_PERIODS.items()}


@dataclass(frozen=True, slots=True)
class Limit:
    """One row of duetime.limits."""

    target: str
    max_running: int | None  # None: no cap (fair or rate only)
    per_key: bool = False
    fair: bool = False
    rate_count: int | None = None  # at most this many starts ...
    rate_period: int | None = None  # ... per this many seconds (1, 60 or 3600)

    @property
    def rate(self) -> str | None:
        """The rate as ``duetime limits set --rate`` takes it (``100/s``), or None."""
        if self.rate_count is None or self.rate_period is None:
            return None
        return f"{self.rate_count}/{_PERIOD_UNITS.get(self.rate_period, f'{self.rate_period}s')}"

    @property
    def kind(self) -> str:
        """``task`` or ``queue``."""
        return self.target.partition(":")[0]

    @property
    def name(self) -> str:
        return self.target.partition(":")[2]


@dataclass(frozen=True, slots=True)
class LimitRow:
    """A limit with its use now (``duetime limits list``)."""

    limit: Limit
    created_at: datetime
    updated_at: datetime
    running: int  # dispatched now (the busiest key's, for a per-key limit)
    due: int  # due pending jobs of the target, held back or about to start
    started: int = 0  # starts in the rate's window now (the busiest key's, per key)

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.limit.target,
            "max_running": self.limit.max_running,
            "per_key": self.limit.per_key,
            "fair": self.limit.fair,
            "rate": self.limit.rate,
            "running": self.running,
            "due": self.due,
            "started": self.started,
            "created_at": self.created_at.isoformat(),
            "updated_at": self.updated_at.isoformat(),
        }


@dataclass(frozen=True, slots=True)
class KeyUse:
    """One key of a per-key limit with its use now (the dashboard's Limits page)."""

    target: str
    limit_key: str  # '' for jobs without a key
    running: int
    due: int
    started: int  # in the rate's window now (0 without a rate)


@dataclass(frozen=True, slots=True)
class Running:
    """Dispatched jobs of one (task, queue, limit key); key '' is none."""

    task: str
    queue: str
    limit_key: str
    count: int


@dataclass(frozen=True, slots=True)
class Started:
    """Starts of a rate-limited target in its window now; key '' unless per key."""

    target: str
    limit_key: str
    count: int
    free_in: float  # seconds until the oldest of them leaves the window


@dataclass(frozen=True, slots=True)
class LimitedJob:
    """A job the limited claim locked, with the key per-key limits count it under."""

    job: ClaimedJob
    limit_key: str  # '' for none

    @property
    def task(self) -> str:
        return self.job.task

    @property
    def queue(self) -> str:
        return self.job.queue


@dataclass(frozen=True, slots=True)
class Closed:
    """What the limited claim must not take: targets and per-key keys with no
    allowance left (``scheduler.duties.limits.Allowance.closed``)."""

    tasks: tuple[str, ...] = ()
    queues: tuple[str, ...] = ()
    task_keys: tuple[tuple[str, str], ...] = ()
    queue_keys: tuple[tuple[str, str], ...] = ()


def _check(max_running: int) -> int:
    if isinstance(max_running, bool) or not isinstance(max_running, int):
        raise InvalidInput("max_running must be an integer")
    if not 1 <= max_running <= MAX_RUNNING_LIMIT:
        raise InvalidInput(f"max_running must be between 1 and {MAX_RUNNING_LIMIT}")
    return max_running


def _limit(r: Any) -> Limit:
    return Limit(
        r["target"], r["max_running"], r["per_key"], r["fair"], r["rate_count"], r["rate_period"]
    )


class LimitStore(PooledStore):
    # -- operator (``duetime limits``, as the schema owner) --------------------------

    async def set(
        self,
        target: str,
        max_running: int | None,
        *,
        per_key: bool = False,
        fair: bool = False,
        rate: str | None = None,
    ) -> None:
        """Create or change the limit on ``target`` (``fair``: a queue's due jobs start
        round-robin between their limit keys; ``rate``: at most ``N/s``, ``N/min`` or
        ``N/h`` starts); it applies to jobs already pending from the dispatcher's next
        read of the limits (within a second)."""
        kind, _ = parse_limit_target(target)
        rate_count, rate_period = (None, None) if rate is None else parse_rate(rate)
        if max_running is None and rate is None and not fair:
            raise InvalidInput("a limit needs --max-running or --rate, or --fair on a queue")
        if per_key and max_running is None and rate is None:
            raise InvalidInput("--per-key needs --max-running or --rate")
        if fair and kind != "queue":
            raise InvalidInput("--fair applies to a queue (queue:NAME)")
        cap = None if max_running is None else _check(max_running)
        async with self._db.acquire() as conn:
            await conn.execute(Q["set"], target, cap, per_key, fair, rate_count, rate_period)

    async def remove(self, target: str) -> bool:
        """Remove the limit on ``target``; False when there was none."""
        parse_limit_target(target)
        async with self._db.acquire() as conn:
            return await conn.fetchval(Q["remove"], target) is not None

    # -- dispatcher ------------------------------------------------------------------

    async def all(self) -> list[Limit]:
        """Every limit (the dispatcher caches them)."""
        async with self._db.acquire() as conn:
            records = await conn.fetch(Q["all"])
        return [_limit(r) for r in records]

    def generic_plans(self, conn: Conn) -> AbstractAsyncContextManager[None]:
        """Within the caller's transaction, run the statements inside on their generic
        plans (why: ``generic_plans`` in limits.sql); the session's plan choice again
        after them."""
        return local_setting(conn, Q["generic_plans"], Q["default_plans"])

    async def counts(self, conn: Conn, limits: Sequence[Limit]) -> list[Running]:
        """Dispatched jobs of the targets of ``limits``, inside the caller's fenced
        transaction."""
        tasks = [lim.name for lim in limits if lim.kind == "task"]
        queues = [lim.name for lim in limits if lim.kind == "queue"]
        records = await conn.fetch(Q["counts"], tasks, queues)
        return [Running(r["task"], r["queue"], r["limit_key"], int(r["running"])) for r in records]

    async def starts(self, conn: Conn, limits: Sequence[Limit]) -> list[Started]:
        """Starts in the window now of the rate-limited ``limits``, inside the caller's
        fenced transaction (none without a rate: no query then)."""
        rated = [lim for lim in limits if lim.rate_period is not None]
        if not rated:
            return []
        records = await conn.fetch(
            Q["starts"], [lim.target for lim in rated], [lim.rate_period for lim in rated]
        )
        return [
            Started(r["target"], r["limit_key"], int(r["started"]), float(r["free_in"]))
            for r in records
        ]

    async def record_starts(self, conn: Conn, starts: dict[tuple[str, str], int]) -> None:
        """Log ``starts`` ({(target, key): jobs}) in the caller's fenced transaction,
        after the jobs were marked dispatched in it."""
        if not starts:
            return
        slots = sorted(starts)
        await conn.execute(
            Q["record_starts"],
            [target for target, _ in slots],
            [key for _, key in slots],
            [starts[slot] for slot in slots],
        )

    async def held(self, limits: Sequence[Limit]) -> dict[str, int]:
        """Due pending jobs per target of ``limits`` (every target, 0 when none)."""
        tasks = [lim.name for lim in limits if lim.kind == "task"]
        queues = [lim.name for lim in limits if lim.kind == "queue"]
        async with self._db.acquire() as conn:
            records = await conn.fetch(Q["held"], tasks, queues)
        counts = {r["target"]: int(r["jobs"]) for r in records}
        return {lim.target: counts.get(lim.target, 0) for lim in limits}

    async def claim_fair(self, conn: Conn, queue: str, limit: int) -> list[LimitedJob]:
        """Lock up to ``limit`` due jobs of the fair ``queue``, round-robin between their
        limit keys (``claim_fair`` in limits.sql), in that order."""
        ranked = await conn.fetch(Q["claim_fair"], queue, limit)
        if not ranked:
            return []
        dues = [r["due_at"] for r in ranked]
        records = await conn.fetch(Q["lock_ids"], [r["id"] for r in ranked], min(dues), max(dues))
        by_id = {r["id"]: r for r in records}
        return [
            LimitedJob(ClaimedJob.from_record(by_id[r["id"]]), by_id[r["id"]]["limit_key"])
            for r in ranked
            if r["id"] in by_id
        ]

    async def claim(
        self,
        conn: Conn,
        limits: Sequence[Limit],
        closed: Closed,
        limit: int,
        *,
        held: Sequence[str] = (),
    ) -> list[LimitedJob]:
        """Lock up to ``limit`` due jobs of the targets of ``limits`` that ``closed`` and
        the credit-``held`` queues leave open, highest priority first, then run time."""
        tasks = [lim.name for lim in limits if lim.kind == "task"]
        queues = [lim.name for lim in limits if lim.kind == "queue"]
        records = await conn.fetch(
            Q["claim"],
            tasks,
            queues,
            list(closed.tasks),
            [*closed.queues, *held],
            [t for t, _ in closed.task_keys],
            [k for _, k in closed.task_keys],
            [q for q, _ in closed.queue_keys],
            [k for _, k in closed.queue_keys],
            limit,
        )
        return [
            LimitedJob(
                ClaimedJob.from_record(r),
                r["limit_key"],
            )
            for r in records
        ]

    # -- operator, read ----------------------------------------------------------

    async def busiest_keys(self, per_limit: int = 20) -> list[KeyUse]:
        """The keys of the per-key limits, the ``per_limit`` with most due jobs each."""
        async with self._db.acquire() as conn:
            records = await conn.fetch(Q["busiest_keys"], per_limit)
        return [
            KeyUse(r["target"], r["limit_key"], int(r["running"]), int(r["due"]), int(r["started"]))
            for r in records
        ]

    async def list(self) -> list[LimitRow]:
        async with self._db.acquire() as conn:
            records = await conn.fetch(Q["list"])
        return [
            LimitRow(
                _limit(r),
                created_at=r["created_at"],
                updated_at=r["updated_at"],
                running=int(r["running"]),
                due=int(r["due"]),
                started=int(r["started"]),
            )
            for r in records
        ]
