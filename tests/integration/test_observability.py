"""The per-process HTTP endpoints: /metrics, /healthz, /readyz (scheduler/observability.py).

A real server on a free loopback port, a raw HTTP client (so what is on the wire is
what is asserted), and a real PostgreSQL readiness check beside a switchable one.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import socket
import time
from collections.abc import AsyncIterator

import pytest
from prometheus_client.metrics import MetricWrapperBase

import scheduler.metrics as duetime_metrics
from scheduler.errors import ConfigError
from scheduler.observability import (
    Observability,
    amqp_check,
    database_check,
    start_observability,
)
from scheduler.store.status import StatusStore
from tests.support.wait import wait_for


class Response:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    def json(self) -> dict:
        return json.loads(self.body)


async def request(
    url: str,
    path: str,
    *,
    method: str = "GET",
    headers: dict[str, str] | None = None,
    raw: bytes | None = None,
    timeout: float = 5.0,
) -> Response:
    host, port = url.removeprefix("http://").split(":")
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            if raw is None:
                lines = [f"{method} {path} HTTP/1.1", f"Host: {host}"]
                lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
                raw = ("\r\n".join(lines) + "\r\n\r\n").encode()
            writer.write(raw)
            await writer.drain()
            data = await reader.read()
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    parsed = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        parsed[name.strip().lower()] = value.strip()
    return Response(int(status_line.split(" ")[1]), parsed, body)


def exposition_names() -> dict[str, str]:
    """Every metric defined in scheduler/metrics.py: exposed name → type."""
    found = {}
    for value in vars(duetime_metrics).values():
        if isinstance(value, MetricWrapperBase):
            name = value._name + ("_total" if value._type == "counter" else "")
            found[name] = value._type
    return found


@pytest.fixture
async def server() -> AsyncIterator[Observability]:
    obs = Observability(port=0, host="127.0.0.1", check_timeout=0.5, loop_interval=0.05)
    await obs.start()
    try:
        yield obs
    finally:
        await obs.close()


async def test_metrics_exposes_every_duetime_metric(server: Observability) -> None:
    assert server.url is not None
    duetime_metrics.EVENT_LOOP_LAG.observe(0.003)  # a sample, so the histogram has data
    response = await request(server.url, "/metrics")
    assert response.status == 200
    ctype = response.headers["content-type"]
    assert ctype.startswith("text/plain; version="), ctype  # Prometheus text format
    text = response.body.decode()
    names = exposition_names()
    assert len(names) >= 13, names
    missing = [n for n, kind in names.items() if f"# TYPE {n} {kind}\n" not in text]
    assert not missing, f"not exposed: {missing}"
    # process collectors ride along on the default registry
    assert "process_resident_memory_bytes" in text
    count = _sample(text, "duetime_event_loop_lag_seconds_count")
    assert count is not None and count >= 1


def _sample(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


async def test_metrics_openmetrics_negotiation_and_head(server: Observability) -> None:
    assert server.url is not None
    om = await request(
        server.url, "/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"}
    )
    assert om.status == 200
    assert om.headers["content-type"].startswith("application/openmetrics-text")
    assert om.body.rstrip().endswith(b"# EOF")
    head = await request(server.url, "/metrics", method="HEAD")
    assert head.status == 200 and head.body == b""
    assert int(head.headers["content-length"]) > 0


async def test_readyz_flips_from_503_to_200_and_names_failing_checks(
    server: Observability, db_pool
) -> None:
    assert server.url is not None
    amqp_up = False

    def amqp() -> bool:
        return amqp_up

    async def etcd() -> None:
        raise ConnectionError("etcd://root:hunter2@10.0.0.9:2379 refused")

    server.add_check("db", StatusStore(db_pool).ping)  # a real PostgreSQL round trip
    server.add_check("amqp", amqp)
    server.add_check("etcd", etcd)

    first = await request(server.url, "/readyz")
    assert first.status == 503
    body = first.json()
    assert body["status"] == "not_ready"
    assert body["failing"] == ["amqp", "etcd"]
    assert body["checks"]["db"]["ok"] is True
    assert body["checks"]["amqp"]["error"] == "check returned false"
    assert "ConnectionError" in body["checks"]["etcd"]["error"]
    assert "hunter2" not in first.body.decode(), "secrets must be scrubbed"

    amqp_up = True
    server.remove_check("etcd")
    ready = await request(server.url, "/readyz")
    assert ready.status == 200, ready.body
    assert ready.json() == {
        "status": "ready",
        "failing": [],
        "checks": {
            "amqp": {"ok": True, "seconds": ready.json()["checks"]["amqp"]["seconds"]},
            "db": {"ok": True, "seconds": ready.json()["checks"]["db"]["seconds"]},
        },
    }

    server.set_draining()
    draining = await request(server.url, "/readyz")
    assert draining.status == 503
    assert draining.json()["failing"] == ["shutting_down"]


async def test_readyz_check_timeout_is_bounded_and_shared(server: Observability) -> None:
    assert server.url is not None
    calls = 0

    async def hangs() -> None:
        nonlocal calls
        calls += 1
        await asyncio.Event().wait()

    server.add_check("etcd", hangs)
    started = time.monotonic()
    responses = await asyncio.gather(*(request(server.url, "/readyz") for _ in range(5)))
    elapsed = time.monotonic() - started
    assert all(r.status == 503 for r in responses)
    assert responses[0].json()["checks"]["etcd"]["error"] == "timed out after 0.5s"
    assert elapsed < 2.0, elapsed
    assert calls <= 2, "concurrent probes must share one evaluation"


async def test_healthz_reports_loop_lag_and_stalls(server: Observability) -> None:
    assert server.url is not None
    ok = await request(server.url, "/healthz")
    assert ok.status == 200
    assert ok.json()["status"] == "ok"
    assert ok.json()["loop_lag_seconds"] < 1.0

    server.stall_threshold = 0.2
    time.sleep(0.4)  # noqa: ASYNC251 - the fault under test: a blocked event loop
    stalled = await request(server.url, "/healthz")
    assert stalled.status == 503
    assert stalled.json()["status"] == "stalled"
    await wait_for(
        lambda: server.liveness()[0], timeout=2, message="loop lag back under the threshold"
    )
    assert (await request(server.url, "/healthz")).status == 200


async def test_bad_requests_are_bounded(server: Observability) -> None:
    assert server.url is not None
    assert (await request(server.url, "/nope")).status == 404
    post = await request(server.url, "/metrics", method="POST")
    assert post.status == 405 and post.headers["allow"] == "GET, HEAD"
    body = await request(
        server.url, "/metrics", raw=b"GET /metrics HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello"
    )
    assert body.status == 413
    assert (await request(server.url, "/", raw=b"garbage\r\n\r\n")).status == 400
    huge = b"GET /metrics HTTP/1.1\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n"
    assert (await request(server.url, "/", raw=huge)).status == 431


async def test_slow_client_gets_408_and_connection_limit_applies() -> None:
    obs = Observability(port=0, host="127.0.0.1", request_timeout=0.3, max_connections=2)
    await obs.start()
    try:
        assert obs.url is not None
        host, port = obs.url.removeprefix("http://").split(":")
        idle = [await asyncio.open_connection(host, int(port)) for _ in range(2)]
        await wait_for(lambda: len(obs._connections) == 2, timeout=2, message="2 connections")
        over = await request(obs.url, "/healthz")
        assert over.status == 503
        for reader, writer in idle:  # silent clients are answered 408 and dropped
            async with asyncio.timeout(2):
                data = await reader.read()
            assert data.startswith(b"HTTP/1.1 408")
            writer.close()
        assert (await request(obs.url, "/healthz")).status == 200
    finally:
        await obs.close()


async def test_close_cancels_owned_tasks_and_is_idempotent() -> None:
    obs = Observability(port=0, host="127.0.0.1")
    await obs.close()  # before start: harmless
    obs = Observability(port=0, host="127.0.0.1")
    await obs.start()
    assert obs.url is not None
    host, port = obs.url.removeprefix("http://").split(":")
    _reader, writer = await asyncio.open_connection(host, int(port))  # an open request
    await wait_for(lambda: obs._connections, timeout=2, message="connection accepted")
    await obs.close()
    await obs.close()
    leftover = [t for t in asyncio.all_tasks() if (t.get_name() or "").startswith("observability")]
    assert not [t for t in leftover if not t.done()]
    assert not obs._connections
    writer.close()
    with pytest.raises(OSError):
        socket.create_connection((host, int(port)), timeout=1).close()


async def test_start_observability_off_without_port_and_refuses_busy_port(settings) -> None:
    inert = await start_observability(settings)  # settings.metrics_port is None
    assert not inert.enabled and inert.port is None and inert.url is None
    inert.add_check("db", lambda: True)
    await inert.close()

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        taken = dataclasses.replace(settings, metrics_port=port)
        with pytest.raises(ConfigError, match=str(port)):
            await start_observability(taken, host="127.0.0.1")


async def test_ready_made_checks_against_real_services(db_pool, amqp_url: str) -> None:
    from scheduler import broker

    connection = await broker.connect(amqp_url, timeout=5, name="test-observability")
    obs = Observability(port=0, host="127.0.0.1", check_timeout=2.0)
    obs.add_check("db", database_check(db_pool))
    obs.add_check("amqp", amqp_check(connection))
    await obs.start()
    try:
        assert obs.url is not None
        ready = await request(obs.url, "/readyz")
        assert ready.status == 200, ready.body
        await connection.close()
        closed = await request(obs.url, "/readyz")
        assert closed.status == 503
        assert closed.json()["failing"] == ["amqp"]
    finally:
        await obs.close()
        await connection.close()
