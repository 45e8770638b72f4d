"""scheduler.eventloop: uvloop (a dependency) by default, asyncio's loop when chosen or
missing."""

from __future__ import annotations

import asyncio
import gc
import importlib
import ssl
from typing import Any

import pytest
from asyncpg import connect_utils

from scheduler import eventloop
from scheduler.config import Settings
from scheduler.config.loading import load_settings
from scheduler.errors import ConfigError


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def _no_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.import_module

    def no_uvloop(name: str, *args: Any) -> Any:
        if name == "uvloop":
            raise ImportError("No module named 'uvloop'")
        return real(name, *args)

    monkeypatch.setattr(eventloop.importlib, "import_module", no_uvloop)


def test_without_uvloop_the_commands_run_on_asyncio(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_uvloop(monkeypatch)
    assert eventloop.loop_name() == "asyncio"
    assert eventloop.run(_loop_module()).startswith("asyncio")


def test_uvloop_is_a_dependency_and_the_default() -> None:
    import uvloop  # noqa: F401  (pyproject: a dependency except on Windows)

    assert eventloop.loop_name() == "uvloop"
    assert eventloop.run(_loop_module()).startswith("uvloop")
    assert Settings().event_loop == "auto"


def test_event_loop_asyncio_runs_the_commands_on_asyncios_own_loop() -> None:
    assert eventloop.loop_name("asyncio") == "asyncio"
    assert eventloop.run(_loop_module(), "asyncio").startswith("asyncio")


def test_event_loop_uvloop_where_it_is_missing_is_a_one_line_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _no_uvloop(monkeypatch)
    with pytest.raises(ConfigError, match="uvloop is not installed"):
        eventloop.run(_loop_module(), "uvloop")
    assert eventloop.run(_loop_module()).startswith("asyncio")  # auto falls back


def test_duetime_event_loop_is_read_and_checked() -> None:
    assert load_settings(env={"DUETIME_EVENT_LOOP": "asyncio"}).event_loop == "asyncio"
    with pytest.raises(ConfigError, match="event_loop"):
        load_settings(env={"DUETIME_EVENT_LOOP": "trio"})


async def _context_of_a_raise() -> BaseException | None:
    try:
        raise ValueError("a handler's own failure")
    except ValueError as exc:
        return exc.__context__


def test_an_exception_raised_under_run_is_not_chained_to_the_missing_uvloop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every traceback a worker logged used to end in "During handling of the above
    exception ... No module named 'uvloop'": the commands ran inside the except clause."""
    _no_uvloop(monkeypatch)
    assert eventloop.run(_context_of_a_raise()) is None


async def _abandon_a_tls_negotiation() -> None:
    """What asyncpg leaves behind when the task awaiting its SSL negotiation is cancelled
    (a connect or cancel-request timeout) in the same loop turn as the server closes the
    connection: the negotiation's future gets the exception and nobody reads it. Built
    with asyncpg's own protocol, so a change of its message fails here."""
    loop = asyncio.get_running_loop()
    proto = connect_utils.TLSUpgradeProto(
        loop, "127.0.0.1", 5432, ssl.create_default_context(), True
    )
    proto.connection_lost(None)
    del proto
    gc.collect()
    await asyncio.sleep(0)


async def _drop_a_failed_future() -> None:
    fut = asyncio.get_running_loop().create_future()
    fut.set_exception(ValueError("nobody read me"))
    del fut
    gc.collect()
    await asyncio.sleep(0)


def test_an_abandoned_asyncpg_ssl_negotiation_is_not_logged_as_an_error(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """During a database outage asyncio logged "Future exception was never retrieved"
    ERRORs for these (14 in one chaos pg_cut run); they are expected there, so they go to
    debug. Any other unread exception is still asyncio's error."""
    _no_uvloop(monkeypatch)
    eventloop.run(_abandon_a_tls_negotiation())
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]
    eventloop.run(_drop_a_failed_future())
    assert [r for r in caplog.records if "nobody read me" in str(r.exc_info)]
