"""Process scaffolding: systemd notify, watchdog interval, signals, loop monitor."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from scheduler import service as service_mod
from scheduler.errors import ConfigError
from scheduler.loopmon import LoopMonitor, wake_lag
from scheduler.metrics import EVENT_LOOP_LAG
from scheduler.service import Service, notify, watchdog_interval


def _receiver(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.settimeout(2)
    return sock


def test_notify_without_systemd_is_a_no_op() -> None:
    assert notify("READY=1", environ={}) is False


def test_notify_writes_a_datagram_to_a_path_socket(tmp_path: Path) -> None:
    path = str(tmp_path / "notify.sock")
    with _receiver(path) as sock:
        assert notify("READY=1", environ={"NOTIFY_SOCKET": path})
        assert sock.recv(1024) == b"READY=1"


def test_notify_supports_abstract_sockets() -> None:
    name = f"duetime-test-{uuid.uuid4().hex}"
    with _receiver("\0" + name) as sock:
        assert notify("WATCHDOG=1", environ={"NOTIFY_SOCKET": "@" + name})
        assert sock.recv(1024) == b"WATCHDOG=1"


def test_notify_never_raises(tmp_path: Path) -> None:
    assert notify("READY=1", environ={"NOTIFY_SOCKET": str(tmp_path / "absent")}) is False
    assert notify("READY=1", environ={"NOTIFY_SOCKET": "vsock:2:1234"}) is False


def test_watchdog_interval_is_half_the_timeout_and_only_for_us() -> None:
    assert watchdog_interval({}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "0"}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "4000000"}) == 2.0
    mine = {"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": str(os.getpid())}
    assert watchdog_interval(mine) == 2.0
    assert watchdog_interval({"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": "1"}) is None


async def test_first_signal_requests_stop_second_exits_at_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    exits: list[int] = []
    monkeypatch.setattr(service_mod.os, "_exit", exits.append)
    path = str(tmp_path / "notify.sock")
    with _receiver(path) as sock:
        env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "200000"}
        async with Service("test", environ=env) as svc:
            svc.ready()
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.wait_for(svc.stop_event.wait(), 2)
            assert exits == []
            os.kill(os.getpid(), signal.SIGINT)
            await asyncio.sleep(0)  # let the loop run the signal handler
            for _ in range(100):
                if exits:
                    break
                await asyncio.sleep(0.01)
            assert exits == [130]
        received = set()
        while True:
            try:
                received.add(sock.recv(1024))
            except TimeoutError:
                break
            if b"STOPPING=1" in received:
                break
        assert {b"READY=1", b"WATCHDOG=1", b"STOPPING=1"} <= received
    # handlers removed: the default SIGINT handler is back in place for the loop
    loop = asyncio.get_running_loop()
    assert not loop.remove_signal_handler(signal.SIGTERM)


def test_wake_lag_arithmetic() -> None:
    assert wake_lag(10.0, 10.1, 0.1) == pytest.approx(0.0)
    assert wake_lag(10.0, 10.8, 0.1) == pytest.approx(0.7)
    assert wake_lag(10.0, 10.05, 0.1) == 0.0  # never negative


def _lag_count() -> float:
    for metric in EVENT_LOOP_LAG.collect():
        for sample in metric.samples:
            if sample.name.endswith("_count"):
                return sample.value
    return 0.0


async def test_loop_monitor_reports_a_blocked_loop(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("WARNING")
    monitor = LoopMonitor(interval=0.02, threshold=0.2)
    before = _lag_count()
    monitor.start()
    try:
        await asyncio.sleep(0.05)
        time.sleep(0.4)  # noqa: ASYNC251 -- blocks the event loop on purpose
        for _ in range(100):
            if monitor.blocked_count:
                break
            await asyncio.sleep(0.01)
    finally:
        await monitor.stop()
        await monitor.stop()  # safe twice
    assert monitor.blocked_count == 1
    assert 0.3 <= monitor.max_lag < 1.0
    assert _lag_count() > before
    blocked = [
        r.msg
        for r in caplog.records
        if isinstance(r.msg, dict) and r.msg.get("event") == "event_loop_blocked"
    ]
    assert len(blocked) == 1 and blocked[0]["lag"] >= 0.3


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_metrics_are_served_and_the_port_is_released() -> None:
    port = _free_port()

    def scrape() -> str:
        url = f"http://127.0.0.1:{port}/metrics"
        with urllib.request.urlopen(url, timeout=2) as response:
            return str(response.read().decode())

    async with Service("test", metrics_port=port, environ={}) as svc:
        text = await asyncio.to_thread(scrape)
        assert "duetime_is_leader " in text
        assert "duetime_event_loop_lag_seconds_bucket" in text
        assert (await svc.observability.readiness()).ready
        svc._on_signal(signal.SIGTERM)  # shutdown begins: readiness turns 503 at once
        assert svc.stop_event.is_set()
        assert not (await svc.observability.readiness()).ready
    started = time.monotonic()
    async with Service("again", metrics_port=port, environ={}):  # port free again
        pass
    assert time.monotonic() - started < 0.5  # stopping does not wait on the server


async def test_a_busy_metrics_port_is_a_config_error() -> None:
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ConfigError, match=str(port)):
            async with Service("test", metrics_port=port, environ={}):
                pass
