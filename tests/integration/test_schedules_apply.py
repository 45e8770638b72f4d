"""Schedules as code (``ScheduleStore.apply``, ``duetime schedules apply``) against a real
database and the real planner: create, leave alone, redefine (cancelling what was planned
under the old definition), prune only its own, never touch a schedule made by hand,
concurrent applies, and the CLI's diff and one-line errors."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import pytest

from scheduler import db
from scheduler.clock import SYSTEM_CLOCK
from scheduler.config import Settings
from scheduler.duties.base import LeaderTerm
from scheduler.duties.context import DutyContext
from scheduler.duties.planner import Planner, PlannerConfig
from scheduler.errors import InvalidInput
from scheduler.planning import ScheduleSpec
from scheduler.planning.declared import DeclaredSchedule, ScheduleDeclaration
from scheduler.store.fence import FenceStore
from scheduler.store.schedules import ScheduleConflict, ScheduleStore
from tests.support.cli import run_duetime as duetime

EPOCH = 3


@dataclass
class World:
    settings: Settings
    pool: asyncpg.Pool
    store: ScheduleStore
    node: str

    async def plan(self) -> None:
        ctx = DutyContext.standalone(self.settings, self.pool, clock=SYSTEM_CLOCK)
        planner = Planner(ctx, config=PlannerConfig(horizon=60.0))
        planner.loop.bind(LeaderTerm(EPOCH, self.node))
        await planner.plan_pass()

    async def fetch(self, sql: str, *args: object) -> list[asyncpg.Record]:
        async with self.pool.acquire() as conn:
            return list(await conn.fetch(sql, *args))

    async def pending(self, name: str) -> list[asyncpg.Record]:
        return await self.fetch(
            "SELECT j.payload, j.task, j.due_at FROM duetime.jobs j "
            "JOIN duetime.schedules s ON s.id = j.schedule_id "
            "WHERE s.name = $1 AND j.status = 'pending' ORDER BY j.due_at",
            name,
        )


@pytest.fixture
async def world(settings: Settings, migrated_dsn: str, unique: str) -> AsyncIterator[World]:
    pool = await db.create_pool(migrated_dsn, min_size=1, max_size=4)
    try:
        assert await FenceStore(pool).advance(EPOCH, f"test-{unique}")
        yield World(
            dataclasses.replace(settings, database_url=migrated_dsn), pool, ScheduleStore(pool),
            f"test-{unique}",
        )  # fmt: skip
    finally:
        await pool.close()


def declare(source: str, *specs: ScheduleSpec | DeclaredSchedule) -> ScheduleDeclaration:
    return ScheduleDeclaration.of(source, specs)


def every(name: str, period: str = "10s", **kwargs: object) -> ScheduleSpec:
    return ScheduleSpec(name=name, task="tick", interval=period, **kwargs)  # type: ignore[arg-type]


async def test_apply_creates_then_changes_nothing_the_second_time(world: World) -> None:
    declaration = declare("billing", every("a"), every("b", "1m", payload={"x": 1}))
    first = await world.store.apply(declaration)
    assert [(c.kind, c.name) for c in first.changes] == [("create", "a"), ("create", "b")]
    rows = await world.fetch("SELECT name, managed_by, updated_at FROM duetime.schedules")
    assert {(r["name"], r["managed_by"]) for r in rows} == {("a", "billing"), ("b", "billing")}

    second = await world.store.apply(declaration)
    assert [c.kind for c in second.changes] == ["unchanged", "unchanged"]
    again = await world.fetch("SELECT name, managed_by, updated_at FROM duetime.schedules")
    assert sorted(map(tuple, again)) == sorted(map(tuple, rows))  # not even updated_at


async def test_a_changed_schedule_cancels_what_was_planned_and_is_planned_again(
    world: World,
) -> None:
    await world.store.apply(declare("ops", every("report", "10s", payload={"v": 1})))
    await world.plan()
    planned = await world.pending("report")
    assert planned and all(r["payload"] == {"v": 1} for r in planned)

    result = await world.store.apply(declare("ops", every("report", "10s", payload={"v": 2})))
    (change,) = result.changes
    assert change.kind == "update"
    assert change.fields == {"payload": ('{"v":1}', '{"v":2}')}
    assert result.cancelled == {"report": len(planned)}
    assert await world.pending("report") == []  # nothing left under the old definition

    await world.plan()
    replanned = await world.pending("report")
    assert replanned and all(r["payload"] == {"v": 2} for r in replanned)


async def test_prune_removes_only_its_own_and_never_a_schedule_made_by_hand(
    world: World,
) -> None:
    await world.store.add(every("by-hand"))
    await world.store.apply(declare("team-a", every("a1"), every("a2")))
    await world.store.apply(declare("team-b", every("b1")))

    kept = await world.store.apply(declare("team-a", every("a1")))
    assert [(c.kind, c.name) for c in kept.changes] == [("unchanged", "a1"), ("undeclared", "a2")]
    pruned = await world.store.apply(declare("team-a", every("a1")), prune=True)
    assert [(c.kind, c.name) for c in pruned.changes] == [("unchanged", "a1"), ("remove", "a2")]
    names = {r["name"] for r in await world.fetch("SELECT name FROM duetime.schedules")}
    assert names == {"by-hand", "a1", "b1"}


async def test_a_name_made_by_hand_is_a_conflict_unless_adopted(world: World) -> None:
    await world.store.add(every("legacy", "1m"))
    with pytest.raises(ScheduleConflict) as refused:
        await world.store.apply(declare("ops", every("new-one"), every("legacy", "30s")))
    assert [c.name for c in refused.value.conflicts] == ["legacy"]
    assert "made by hand" in str(refused.value)
    names = {r["name"] for r in await world.fetch("SELECT name FROM duetime.schedules")}
    assert names == {"legacy"}  # nothing applied, not even the create

    adopted = await world.store.apply(declare("ops", every("legacy", "30s")), adopt=True)
    (change,) = adopted.changes
    assert change.kind == "update" and set(change.fields) == {"interval", "managed_by"}
    (row,) = await world.fetch("SELECT managed_by, interval FROM duetime.schedules")
    assert row["managed_by"] == "ops" and row["interval"].total_seconds() == 30


async def test_paused_is_left_alone_unless_declared(world: World) -> None:
    await world.store.apply(declare("ops", every("p")))
    await world.store.pause("p")  # an operator, during an incident
    result = await world.store.apply(declare("ops", every("p")))
    assert [c.kind for c in result.changes] == ["unchanged"]
    assert (await world.store.get("p")).paused
    resumed = await world.store.apply(declare("ops", DeclaredSchedule(every("p"), paused=False)))
    assert resumed.changes[0].fields == {"paused": ("True", "False")}
    assert not (await world.store.get("p")).paused


async def test_dry_run_writes_nothing(world: World) -> None:
    result = await world.store.apply(declare("ops", every("d")), dry_run=True)
    assert result.dry_run and [c.kind for c in result.changes] == ["create"]
    assert await world.fetch("SELECT 1 FROM duetime.schedules") == []


async def test_concurrent_applies_of_one_file_create_each_schedule_once(world: World) -> None:
    declaration = declare("deploy", *(every(f"s{i}") for i in range(20)))
    stores = [ScheduleStore(world.pool) for _ in range(4)]
    results = await asyncio.gather(*(s.apply(declaration) for s in stores))
    created = sum(r.count("create") for r in results)
    unchanged = sum(r.count("unchanged") for r in results)
    assert (created, unchanged) == (20, 60)
    (count,) = await world.fetch("SELECT count(*) FROM duetime.schedules")
    assert count[0] == 20


async def test_plain_sql_managed_by_is_checked_by_a_named_constraint(world: World) -> None:
    await world.store.apply(declare("ops", every("c")))
    with pytest.raises(asyncpg.CheckViolationError) as refused:
        await world.fetch("UPDATE duetime.schedules SET managed_by = ' bad' WHERE name = 'c'")
    assert refused.value.constraint_name == "schedules_managed_by_invalid"


def test_a_declaration_names_each_schedule_once() -> None:
    with pytest.raises(InvalidInput, match="declared twice: a"):
        declare("ops", every("a"), every("a", "1m"))


# -- the CLI -----------------------------------------------------------------------------

FILE = """
source = "billing"

[schedules.nightly]
task = "reports.nightly"
cron = "30 2 * * *"
tz = "Europe/Paris"
payload = { kind = "full" }

[schedules.heartbeat]
task = "ping"
every = "30s"
overlap = "skip"
"""


async def test_cli_apply_prints_the_diff_and_is_idempotent(
    world: World, test_env: dict[str, str], migrated_dsn: str, tmp_path: Path
) -> None:
    env = {**test_env, "DUETIME_DATABASE_URL": migrated_dsn}
    path = tmp_path / "schedules.toml"
    path.write_text(FILE)

    dry = await duetime(env, "schedules", "apply", str(path), "--dry-run")
    assert dry.code == 0, dry
    assert dry.out.splitlines()[0].startswith("would apply (dry run, nothing written)")
    assert await world.fetch("SELECT 1 FROM duetime.schedules") == []

    run = await duetime(env, "schedules", "apply", str(path))
    assert run.code == 0, run
    lines = run.out.splitlines()
    assert lines[0] == f"applied {path} (source 'billing'): 2 created"
    assert lines[1] == "+ nightly: reports.nightly, cron '30 2 * * *' in Europe/Paris"
    assert lines[2] == "+ heartbeat: ping, every 30s"

    path.write_text(FILE.replace('every = "30s"', 'every = "1m"'))
    changed = await duetime(env, "schedules", "apply", str(path), "--json")
    assert changed.code == 0, changed
    out = changed.json()
    assert isinstance(out, dict)
    kinds = {c["name"]: c["kind"] for c in out["changes"]}
    assert kinds == {"nightly": "unchanged", "heartbeat": "update"}
    heartbeat = next(c for c in out["changes"] if c["name"] == "heartbeat")
    assert heartbeat["fields"] == {"interval": {"from": "30s", "to": "1m"}}
    json.dumps(out)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        (
            "[schedules.a]\ntask = 't'\ncorn = '* * * * *'\n",
            "unknown key 'corn' (did you mean 'cron'?)",
        ),
        ("[schedules.a]\ntask = 't'\n", "give exactly one of 'cron' and 'every'"),
        ("[schedules.a]\ntask = 't'\ncron = '61 * * * *'\n", "schedules.a: "),
        ("[schedules.a]\ntask = 't'\nevery = '1m'\npaused = 'yes'\n", "paused: expected true"),
        ("sourec = 'x'\n", "unknown top-level key 'sourec' (did you mean 'source'?)"),
        ("[schedules.a\n", "not valid TOML"),
    ],
)
async def test_cli_apply_bad_file_is_one_line_exit_2(
    test_env: dict[str, str], tmp_path: Path, text: str, fragment: str
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    env = {**test_env, "DUETIME_DATABASE_URL": "postgresql://postgres@127.0.0.1:1/none"}
    run = await duetime(env, "schedules", "apply", str(path))
    assert run.code == 2, run
    assert fragment in run.error_line()
    assert str(path) in run.error_line()


async def test_cli_apply_conflict_is_one_line_and_writes_nothing(
    world: World, test_env: dict[str, str], migrated_dsn: str, tmp_path: Path
) -> None:
    await world.store.add(every("heartbeat"))
    env = {**test_env, "DUETIME_DATABASE_URL": migrated_dsn}
    path = tmp_path / "schedules.toml"
    path.write_text(FILE)
    run = await duetime(env, "schedules", "apply", str(path))
    assert run.code == 2, run
    assert "'heartbeat' exists, made by hand" in run.error_line()
    assert "--adopt" in run.error_line()
    names = {r["name"] for r in await world.fetch("SELECT name FROM duetime.schedules")}
    assert names == {"heartbeat"}
