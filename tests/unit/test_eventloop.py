"""scheduler.eventloop: uvloop when it is installed, asyncio's loop otherwise."""

from __future__ import annotations

import asyncio
import importlib
from typing import Any

import pytest

from scheduler import eventloop


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_without_uvloop_the_commands_run_on_asyncio(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.import_module

    def no_uvloop(name: str, *args: Any) -> Any:
        if name == "uvloop":
            raise ImportError("No module named 'uvloop'")
        return real(name, *args)

    monkeypatch.setattr(eventloop.importlib, "import_module", no_uvloop)
    assert eventloop.loop_name() == "asyncio"
    assert eventloop.run(_loop_module()).startswith("asyncio")


def test_with_uvloop_installed_the_commands_run_on_it() -> None:
    pytest.importorskip("uvloop")
    assert eventloop.loop_name() == "uvloop"
    assert eventloop.run(_loop_module()).startswith("uvloop")
