"""The metrics port binds loopback unless told otherwise (security issue, item 15): a
real ``duetime dashboard`` with ``DUETIME_METRICS_PORT``, its listening socket read from
``/proc/net/tcp``. Every process binds through ``scheduler.service.Service``; the
dashboard's is the case the issue names (loopback-only dashboard, metrics on every
interface)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.dashboard.conftest import Cluster, free_port, http_status
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(90)


def listening_address(port: int) -> str | None:
    """The local address of the TCP socket listening on ``port`` (IPv4, /proc/net/tcp)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:
            return ".".join(str(int(address[i : i + 2], 16)) for i in (6, 4, 2, 0))
    return None


@pytest.mark.parametrize(("listen", "expected"), [(None, "127.0.0.1"), ("0.0.0.0", "0.0.0.0")])
async def test_the_dashboards_metrics_port_binds_loopback_by_default(
    cluster: Cluster, listen: str | None, expected: str
) -> None:
    metrics = free_port()
    env = {"DUETIME_METRICS_PORT": str(metrics)}
    if listen is not None:
        env["DUETIME_METRICS_LISTEN"] = listen
    served = await cluster.start_dashboard(env=env)
    try:
        await wait_for(
            lambda: asyncio.to_thread(http_status, f"http://127.0.0.1:{metrics}/metrics"),
            timeout=10, message="metrics",
        )  # fmt: skip
        assert listening_address(metrics) == expected
    finally:
        await served.process.stop(timeout=10)
