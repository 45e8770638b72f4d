"""Every leader duty is built one way: ``Duty(ctx, *, config=None, ...)`` from a
``DutyContext``, with nothing else required and no I/O until its loop starts; and the
duties read time only through the context's clock."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path
from typing import cast

import asyncpg

from scheduler.clock import ManualClock
from scheduler.config import Settings
from scheduler.duties import DEFAULT_DUTIES, default_duties
from scheduler.duties.context import DutyContext
from scheduler.duties.fence_heartbeat import FenceHeartbeat

DUTIES_DIR = Path(__file__).resolve().parents[2] / "scheduler" / "duties"


def context(settings: Settings | None = None) -> DutyContext:
    """A context over a pool that is never used: building a duty must not touch it."""
    pool = cast(asyncpg.Pool, object())
    return DutyContext.standalone(settings or Settings(), pool, clock=ManualClock(), shard="s1")


def test_every_duty_takes_its_context_then_keyword_only_defaults() -> None:
    for duty in DEFAULT_DUTIES:
        params = list(inspect.signature(duty).parameters.values())
        assert [p.name for p in params[:1]] == ["ctx"], duty
        assert params[0].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD, duty
        for p in params[1:]:
            assert p.kind is inspect.Parameter.KEYWORD_ONLY, (duty, p.name)
            assert p.default is None, (duty, p.name)
        assert "config" in {p.name for p in params[1:]}, duty


def test_default_duties_are_built_from_the_context_alone() -> None:
    ctx = context()
    duties = default_duties(ctx)
    assert [d.name for d in duties] == [d.name for d in DEFAULT_DUTIES]  # type: ignore[attr-defined]
    for duty in duties:
        assert duty.loop.shard == "s1", duty.name
        clock = getattr(duty, "clock", ctx.clock)
        assert clock is ctx.clock, duty.name


def test_the_fence_heartbeat_beats_once_per_renewal_period() -> None:
    settings = dataclasses.replace(Settings(), lease_ttl=9.0)
    heartbeat = FenceHeartbeat(context(settings))
    assert heartbeat.interval == 3.0


def test_duties_read_time_only_through_the_clock() -> None:
    forbidden = {("time", "time"), ("time", "monotonic"), ("datetime", "now")}
    found = []
    for path in sorted(DUTIES_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module == "time":
                found.append(f"{path.name}:{node.lineno} from time import ...")
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and (node.value.id, node.attr) in forbidden
            ):
                found.append(f"{path.name}:{node.lineno} {node.value.id}.{node.attr}")
    assert found == []
