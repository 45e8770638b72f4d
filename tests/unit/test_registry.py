"""Task registry: registration rules fail at import time, lookups, the public API."""

from __future__ import annotations

import importlib
from datetime import timedelta
from typing import Any

import pytest

import workers
from scheduler.errors import InvalidInput
from workers import DuplicateTask, Registry, RetryPolicy, task


async def handler(ctx: Any, payload: dict[str, Any]) -> None:
    return None


async def other(ctx: Any, payload: dict[str, Any]) -> None:
    return None


def test_decorator_registers_and_returns_the_function() -> None:
    registry = Registry()

    @registry.task(
        "send_email", timeout=timedelta(seconds=30), max_attempts=8, retry=RetryPolicy(base=1.0)
    )
    async def send(ctx: Any, payload: dict[str, Any]) -> None:
        return None

    spec = registry.get("send_email")
    assert spec is not None and spec.handler is send
    assert spec.timeout == 30.0 and spec.max_attempts == 8 and spec.retry.base == 1.0
    assert "send_email" in registry and len(registry) == 1
    assert registry.get("nope") is None


def test_module_level_task_uses_the_given_registry() -> None:
    registry = Registry()
    task("a", registry=registry)(handler)
    assert registry.names() == ["a"]


def test_registering_a_name_twice_is_an_error_naming_both_handlers() -> None:
    registry = Registry()
    registry.register("dup", handler)
    message = r"'dup' is registered twice: by .*handler and by .*other"
    with pytest.raises(DuplicateTask, match=message):
        registry.register("dup", other)
    registry.register("dup", handler)  # the very same function again is harmless


def test_plain_def_handlers_register_as_sync_and_generators_are_refused() -> None:
    """Plain ``def`` handlers run on the handler threads (they used to be refused);
    what cannot be a handler still fails at import time."""

    def sync(ctx: Any, payload: dict[str, Any]) -> None:
        return None

    def gen(ctx: Any, payload: dict[str, Any]) -> Any:
        yield None

    async def agen(ctx: Any, payload: dict[str, Any]) -> Any:
        yield None

    registry = Registry()
    assert registry.register("s", sync).sync is True
    assert registry.register("a", handler).sync is False
    for bad in (gen, agen, "not callable", dict):
        with pytest.raises(InvalidInput, match="must be an 'async def' or a plain 'def'"):
            registry.register(f"bad.{bad!r}", bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"timeout": 0}, "timeout must be > 0"),
        ({"timeout": "5"}, "timeout must be seconds"),
        ({"max_attempts": 0}, "max_attempts must be between"),
        ({"max_attempts": True}, "max_attempts must be an integer"),
        ({"retry": {"base": 1}}, "retry must be a RetryPolicy"),
    ],
)
def test_bad_options_fail_at_registration(kwargs: dict, message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        Registry().register("x", handler, **kwargs)


@pytest.mark.parametrize("name", ["", "   ", None, "x" * 201])
def test_bad_names_fail(name: Any) -> None:
    with pytest.raises(InvalidInput):
        Registry().register(name, handler)


def test_unknown_message_lists_registered_names() -> None:
    registry = Registry()
    registry.register("b", handler)
    registry.register("a", other)
    assert registry.unknown_message("x") == "unknown task 'x' (registered: a, b)"
    assert Registry().unknown_message("x") == "unknown task 'x' (registered: none)"


def test_task_max_attempts_replaces_the_row_budget_only_when_set() -> None:
    registry = Registry()
    with_budget = registry.register("a", handler, max_attempts=2)
    without = registry.register("b", other)
    assert with_budget.attempts_allowed(5) == 2
    assert without.attempts_allowed(5) == 5


def test_public_api_is_exported_and_does_not_drift() -> None:
    assert sorted(workers.__all__) == [
        "AttemptAbandoned",
        "Dependency",
        "DuplicateTask",
        "Fail",
        "JobContext",
        "Registry",
        "Retry",
        "RetryPolicy",
        "Snooze",
        "SyncJobContext",
        "TaskSpec",
        "Worker",
        "WorkerStartupFailed",
        "WorkerState",
        "default_registry",
        "run_worker",
        "task",
        "worker_shutdown",
        "worker_startup",
    ]
    for name in workers.__all__:
        assert getattr(workers, name) is not None


def test_fixture_task_module_registers_into_the_default_registry() -> None:
    importlib.import_module("tests.fixtures_tasks.basic")
    importlib.import_module("tests.fixtures_tasks.basic")  # a second import is a no-op
    assert {"fixtures.record", "fixtures.fail"} <= set(workers.default_registry.names())


async def test_run_task_calls_the_handler_like_the_worker_does() -> None:
    from duetime.testing import run_task

    registry = Registry()
    seen: list[Any] = []

    @registry.task("t.echo")
    async def echo(ctx: Any, payload: dict[str, Any]) -> str:
        seen.append((ctx.job_id, ctx.attempt, ctx.idempotency_key, ctx.db, await ctx.heartbeat()))
        return payload["x"]

    @registry.task("t.slow", timeout=0.05)
    async def slow(ctx: Any, payload: dict[str, Any]) -> None:
        import asyncio

        await asyncio.sleep(5)

    assert await run_task("t.echo", {"x": "y"}, db="conn", registry=registry, job_id=9) == "y"
    assert seen == [(9, 1, "job:9", "conn", True)]
    with pytest.raises(TimeoutError):
        await run_task("t.slow", db=None, registry=registry)
    with pytest.raises(LookupError, match="unknown task 'nope'"):
        await run_task("nope", db=None, registry=registry)


def test_attempts_share_no_transaction_unless_the_task_opts_in() -> None:
    """DESIGN §15: one transaction per attempt by default; ``isolated`` (the old spelling
    of the default) still imports, and contradicting it is refused."""
    registry = Registry()
    assert registry.register("plain", handler).share_transaction is False
    assert registry.register("old", other, isolated=True).share_transaction is False
    assert (
        registry.register("bulk", lambda_free_handler, share_transaction=True).share_transaction
        is True
    )
    with pytest.raises(InvalidInput, match="contradict"):
        registry.register("both", handler, share_transaction=True, isolated=True)
    with pytest.raises(InvalidInput, match="share_transaction must be True or False"):
        registry.register("odd", handler, share_transaction="yes")  # type: ignore[arg-type]


async def lambda_free_handler(ctx: Any, payload: dict[str, Any]) -> None:
    return None
