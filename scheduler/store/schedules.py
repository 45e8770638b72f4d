"""ScheduleStore: schedules for users (add, list, get, pause, resume, remove, trigger) and
for the planner (claim, apply a batch of decisions, wake-up probe). Statements live in
``sql/schedules.sql``; the LISTEN connection that wakes the planner is
``scheduler.store.listener``.

Methods the planner runs inside its fenced transaction take ``conn``; the others use
the pool (or ``conn=`` to join a caller's transaction).
"""

from __future__ import annotations

import builtins
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

import asyncpg

from scheduler.errors import InvalidInput
from scheduler.log import get_logger
from scheduler.planning import PlanDecision, Schedule, ScheduleNotFound, ScheduleSpec
from scheduler.planning.declared import Change, ScheduleDeclaration, diff
from scheduler.sql import compose, fragment, load
from scheduler.store.conn import Conn, PooledStore
from scheduler.store.jobs import NOTIFY_HORIZON
from scheduler.store.rows import UNREADABLE, ClaimedSchedule, Job

__all__ = ["NOTIFY_CHANNEL", "ApplyResult", "ClaimedSchedule", "ScheduleConflict", "ScheduleStore"]

Q = load("schedules")
CLAIMED = fragment("schedules", "claimed_columns")
CLAIM_DUE = compose("schedules", "claim_due", columns=CLAIMED)
CLAIM_DUE_IDS = compose("schedules", "claim_due", columns="s.id")
CLAIMED_SCHEDULE = compose("schedules", "claimed_schedule", columns=CLAIMED)
log = get_logger(__name__)

#: Channel of the schedules insert/update trigger (migration 0002).
NOTIFY_CHANNEL = "duetime_schedules"
MAX_PAGE = 10_000
_BIGINT_MAX = 2**63 - 1


class ScheduleStore(PooledStore):
    # -- users -------------------------------------------------------------------------

    async def add(self, spec: ScheduleSpec, *, conn: Conn | None = None) -> Schedule:
        """Create a schedule; the planner (woken by the insert trigger) plans it."""
        async with self._db.conn(conn) as c:
            try:
                record = await c.fetchrow(
                    Q["insert"],
                    spec.name,
                    spec.task,
                    spec.payload,
                    spec.queue,
                    spec.max_attempts,
                    spec.cron,
                    spec.interval,
                    spec.timezone,
                    spec.start_at,
                    spec.end_at,
                    spec.paused,
                    spec.misfire_policy,
                    spec.misfire_cap,
                    spec.overlap_policy,
                    spec.jitter,
                )
            except asyncpg.UniqueViolationError:
                raise InvalidInput(f"a schedule named {spec.name!r} already exists") from None
            except asyncpg.CheckViolationError as exc:
                raise InvalidInput(
                    f"the database refused the schedule ({exc.constraint_name}): {exc}"
                ) from None
        return Schedule.from_record(record)

    async def get(self, ref: str | int, *, conn: Conn | None = None) -> Schedule:
        """A schedule by name, or by id (a name wins when both match)."""
        async with self._db.conn(conn) as c:
            record = await self._resolve(c, ref)
        return Schedule.from_record(record)

    async def _resolve(self, conn: Conn, ref: str | int) -> asyncpg.Record:
        text = str(ref).strip()
        number = int(text) if text.isdigit() and int(text) <= _BIGINT_MAX else None
        record: asyncpg.Record | None = await conn.fetchrow(Q["resolve"], text, number)
        if record is None:
            raise ScheduleNotFound(ref)
        return record

    async def list(
        self,
        *,
        paused: bool | None = None,
        after_id: int | None = None,
        limit: int = 100,
        conn: Conn | None = None,
    ) -> builtins.list[Schedule]:
        """One page ordered by id; pass the last id as ``after_id`` for the next one."""
        if not 1 <= limit <= MAX_PAGE:
            raise InvalidInput(f"limit must be between 1 and {MAX_PAGE}")
        async with self._db.conn(conn) as c:
            records = await c.fetch(Q["list"], paused, after_id, limit)
        return [Schedule.from_record(r) for r in records]

    async def pause(self, ref: str | int) -> tuple[Schedule, int]:
        """Stop planning; jobs planned ahead and not due yet are cancelled (by the
        table's trigger, as for a pause by plain SQL). Returns the schedule and how many
        jobs were cancelled."""
        return await self._cancelling(ref, "pause")

    async def resume(self, ref: str | int) -> Schedule:
        """Plan again from now (fire times inside the pause are not caught up)."""
        async with self._db.acquire() as c, c.transaction():
            schedule_id = (await self._resolve(c, ref))["id"]
            record = await c.fetchrow(Q["resume"], schedule_id)
        return Schedule.from_record(record)

    async def remove(self, ref: str | int) -> tuple[Schedule, int]:
        """Delete the schedule; the table's trigger cancels its jobs that are not due
        yet (its finished jobs stay, with ``schedule_id`` pointing at nothing)."""
        return await self._cancelling(ref, "delete")

    async def _cancelling(self, ref: str | int, statement: str) -> tuple[Schedule, int]:
        """Run ``statement`` (pause or delete) on the schedule ``ref``, under its lock,
        and count the planned jobs its trigger cancelled in the same transaction."""
        async with self._db.acquire() as c, c.transaction():
            schedule_id = (await self._resolve(c, ref))["id"]
            await c.fetchval(Q["lock"], schedule_id)
            record = await c.fetchrow(Q[statement], schedule_id)
            cancelled = await c.fetchval(Q["planned_cancelled"])
        return Schedule.from_record(record), int(cancelled)

    async def trigger(self, ref: str | int) -> Job:
        """Fire once now, outside the timing (paused or not; no overlap check)."""
        async with self._db.acquire() as c, c.transaction():
            schedule_id = (await self._resolve(c, ref))["id"]
            record = await c.fetchrow(Q["trigger"], schedule_id)
            if record is not None:
                await c.execute(Q["notify_jobs"])  # due now: wake the dispatcher
        if record is None:  # removed in between
            raise ScheduleNotFound(ref)
        return Job.from_record(record)

    async def apply(
        self,
        declaration: ScheduleDeclaration,
        *,
        prune: bool = False,
        adopt: bool = False,
        dry_run: bool = False,
    ) -> ApplyResult:
        """Make the stored schedules agree with ``declaration`` (schedules as code,
        :mod:`scheduler.planning.declared`), in one transaction.

        Creates what is missing, redefines what differs (jobs planned ahead under the old
        definition and not yet due are cancelled, and it is planned again from now),
        leaves what agrees untouched (no write: applying twice changes nothing), and with
        ``prune`` removes the schedules of the declaration's source it no longer names.
        A name already used by a schedule made by hand or by another source is a
        conflict: nothing is written and ``ScheduleConflict`` is raised, unless ``adopt``.
        Concurrent applies are serialised, so every deploy may run one at once.
        ``dry_run`` computes the same changes and writes nothing."""
        names = sorted(declaration.names)
        async with self._db.acquire() as c, c.transaction():
            await c.execute(Q["apply_lock"])
            records = await c.fetch(Q["declared_or_managed"], names, declaration.source)
            changes = diff(
                declaration, [Schedule.from_record(r) for r in records], prune=prune, adopt=adopt
            )
            conflicts = [ch for ch in changes if ch.kind == "conflict"]
            if conflicts:
                raise ScheduleConflict(conflicts)
            cancelled: dict[str, int] = {}
            if not dry_run:
                for change in changes:
                    if change.writes:
                        cancelled[change.name] = await self._write(c, change, declaration.source)
        return ApplyResult(declaration.source, changes, cancelled, dry_run)

    async def _write(self, c: Conn, change: Change, source: str) -> int:
        """One change of an apply; returns how many planned jobs it cancelled."""
        if change.kind == "create":
            assert change.declared is not None
            spec = change.declared.spec
            paused = bool(change.declared.paused)
            try:
                await c.fetchrow(Q["insert_managed"], *_columns(spec), paused,
                                 *_policies(spec), source)  # fmt: skip
            except asyncpg.CheckViolationError as exc:
                raise InvalidInput(
                    f"schedule {spec.name!r}: the database refused it "
                    f"({exc.constraint_name}): {exc}"
                ) from None
            return 0
        assert change.stored is not None
        schedule_id = change.stored.id
        await c.fetchval(Q["lock"], schedule_id)
        await c.fetchrow(Q["pause" if change.kind == "update" else "delete"], schedule_id)
        cancelled = int(await c.fetchval(Q["planned_cancelled"]))
        await c.execute(Q["reset_cancelled"])
        if change.kind == "update":
            assert change.declared is not None
            spec = change.declared.spec
            declared = change.declared.paused
            paused = change.stored.paused if declared is None else declared
            try:
                await c.fetchrow(Q["redefine"], schedule_id, *_columns(spec)[1:], paused,
                                 *_policies(spec), source)  # fmt: skip
            except asyncpg.CheckViolationError as exc:
                raise InvalidInput(
                    f"schedule {spec.name!r}: the database refused it "
                    f"({exc.constraint_name}): {exc}"
                ) from None
        return cancelled

    async def recent_runs(self, schedule_id: int, limit: int = 10) -> builtins.list[Job]:
        async with self._db.acquire() as c:
            records = await c.fetch(Q["recent_runs"], schedule_id, limit)
        return [Job.from_record(r) for r in records]

    # -- planner (inside its fenced transaction) ------------------------------------------

    async def claim_due(
        self, conn: Conn, now: datetime, limit: int
    ) -> builtins.list[ClaimedSchedule]:
        """Lock up to ``limit`` schedules whose ``plan_at`` has come, oldest first."""
        records = await conn.fetch(CLAIM_DUE, now, limit)
        return [
            ClaimedSchedule(Schedule.from_record(r), bool(r["previous_active"])) for r in records
        ]

    async def claim_due_isolated(
        self, conn: Conn, now: datetime, limit: int
    ) -> tuple[builtins.list[ClaimedSchedule], builtins.list[tuple[int, str]]]:
        """``claim_due`` one row at a time, for when it raised ``UNREADABLE``: the
        schedules that could be read, and (id, error) of those that could not."""
        claimed: builtins.list[ClaimedSchedule] = []
        unreadable: builtins.list[tuple[int, str]] = []
        for schedule_id in [r["id"] for r in await conn.fetch(CLAIM_DUE_IDS, now, limit)]:
            try:
                record = await conn.fetchrow(CLAIMED_SCHEDULE, schedule_id)
                if record is None:
                    continue
                claimed.append(
                    ClaimedSchedule(Schedule.from_record(record), bool(record["previous_active"]))
                )
            except UNREADABLE as exc:
                unreadable.append((schedule_id, f"{type(exc).__name__}: {exc}"))
        return claimed, unreadable

    async def pause_unreadable(self, conn: Conn, schedule_id: int, reason: str) -> bool:
        """Pause a schedule with ``reason`` as last_error, by id alone."""
        return await conn.execute(Q["pause_unreadable"], schedule_id, reason) == "UPDATE 1"

    async def apply_plan(
        self, conn: Conn, decisions: Sequence[PlanDecision], *, now: datetime | None = None
    ) -> dict[int, int]:
        """Write a batch of decisions in one statement; returns {schedule id: jobs created}.

        A fire time already in ``schedule_fires`` creates no job (it was materialized
        before, by this leader or another). Given the planner's ``now``, a batch that
        holds jobs due within ``NOTIFY_HORIZON`` of it also wakes the dispatcher (one
        more statement; jobs planned further ahead are found by its probe)."""
        if not decisions:
            return {}
        f_ids: builtins.list[int] = []
        f_times: builtins.list[datetime] = []
        f_dues: builtins.list[datetime] = []
        f_keys: builtins.list[str] = []
        for d in decisions:
            for fire in d.fires:
                f_ids.append(d.schedule_id)
                f_times.append(fire.fire_time)
                f_dues.append(fire.due_at)
                f_keys.append(fire.key)
        records = await conn.fetch(
            Q["apply_plan"],
            f_ids,
            f_times,
            f_dues,
            f_keys,
            [d.schedule_id for d in decisions],
            [d.next_fire_at for d in decisions],
            [d.plan_at for d in decisions],
            [d.buffered_fire_at for d in decisions],
            [d.skipped for d in decisions],
            [d.missed for d in decisions],
            [d.error for d in decisions],
        )
        if now is not None and f_dues and min(f_dues) <= now + NOTIFY_HORIZON:
            await conn.execute(Q["notify_jobs"])
        return {r["id"]: r["fired"] for r in records}

    # -- planner (pool) --------------------------------------------------------------

    async def next_plan_at(self) -> float | None:
        """Epoch seconds of the earliest ``plan_at`` of an active schedule (-inf: now;
        None or inf: nothing to plan)."""
        async with self._db.acquire() as conn:
            value = await conn.fetchval(Q["next_plan_at"])
        return None if value is None else float(value)


def _columns(spec: ScheduleSpec) -> tuple[object, ...]:
    """name .. end_at, in the order of the insert statements."""
    return (spec.name, spec.task, spec.payload, spec.queue, spec.max_attempts, spec.cron,
            spec.interval, spec.timezone, spec.start_at, spec.end_at)  # fmt: skip


def _policies(spec: ScheduleSpec) -> tuple[object, ...]:
    return (spec.misfire_policy, spec.misfire_cap, spec.overlap_policy, spec.jitter)


class ScheduleConflict(InvalidInput):
    """A declaration names schedules made by hand or by another source."""

    def __init__(self, conflicts: Sequence[Change]) -> None:
        shown = "; ".join(f"{c.name!r} {c.reason}" for c in conflicts[:3])
        more = f" (and {len(conflicts) - 3} more)" if len(conflicts) > 3 else ""
        super().__init__(f"{len(conflicts)} conflict(s), nothing applied: {shown}{more}")
        self.conflicts = list(conflicts)


@dataclass(frozen=True)
class ApplyResult:
    """What an apply did (or, ``dry_run``, would do)."""

    source: str
    changes: builtins.list[Change]
    cancelled: dict[str, int]  # name -> planned jobs cancelled by its redefinition/removal
    dry_run: bool

    def count(self, kind: str) -> int:
        return sum(1 for c in self.changes if c.kind == kind)
