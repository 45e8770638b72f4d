"""Per-process HTTP endpoints for operators: ``/metrics``, ``/healthz``, ``/readyz``.

Every duetime process (scheduler replica, worker) calls ``start_observability`` once
it has its settings; with ``metrics_port`` unset the handle is inert, so callers never
branch on it.

- ``/metrics``: Prometheus text (or OpenMetrics when the scraper asks for it) of the
  default registry, which holds every metric of ``scheduler.metrics`` plus process and
  Python runtime collectors.
- ``/healthz`` (liveness): 200 while the event loop is responsive, else 503; a loop
  blocked outright cannot answer at all, which a prober treats as a failure too
  (systemd's watchdog is the stronger net for that case).
- ``/readyz`` (readiness): 200 only when every registered check passes; 503 carries a
  JSON body naming each failing check and why. After ``set_draining()`` (shutdown
  began) readiness is 503 ``shutting_down``.

What each answer means is ``scheduler.health``; this module is the server.

Why asyncio streams and not ``prometheus_client.start_http_server`` or aiohttp: the
former answers from a thread the process can neither stop nor bound and says nothing
about the loop; the latter is a new dependency for three GET routes. The server here is
deliberately small and bounded: request heads are capped at ``MAX_HEAD_BYTES`` and
must arrive within ``request_timeout``, one request per connection, at most
``max_connections`` served at once (excess requests get 503, and beyond four times
that connections are dropped unread), and every task it creates is
tracked and cancelled by ``close()`` (safe before ``start()`` and twice).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Mapping
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.exposition import choose_encoder

import scheduler.metrics  # noqa: F401  (registers every duetime metric in REGISTRY)
from scheduler.config import Settings
from scheduler.errors import ConfigError
from scheduler.health import Check, CheckResult, LoopWatch, Readiness, ReadinessReport
from scheduler.log import get_logger

__all__ = [
    "DEFAULT_HOST",
    "Check",
    "CheckResult",
    "Observability",
    "ReadinessReport",
    "amqp_check",
    "broker_connected",
    "database_check",
    "start_observability",
]

log = get_logger(__name__)

DEFAULT_HOST = "127.0.0.1"  # metrics_listen: 0.0.0.0 for a scraper on another machine
MAX_HEAD_BYTES = 8192
HARD_CONNECTION_FACTOR = 4  # beyond max_connections x this, connections are dropped unread
JSON_TYPE = "application/json"
_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    413: "Content Too Large",
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
}


class Observability:
    """The HTTP endpoints of one process. ``port=None`` makes an inert handle."""

    def __init__(
        self,
        *,
        port: int | None,
        host: str = DEFAULT_HOST,
        checks: Mapping[str, Check] | None = None,
        check_timeout: float = 2.0,
        request_timeout: float = 5.0,
        max_connections: int = 32,
        loop_interval: float = 0.5,
        stall_threshold: float = 5.0,
        registry: CollectorRegistry = REGISTRY,
    ) -> None:
        if check_timeout <= 0 or request_timeout <= 0 or loop_interval <= 0:
            raise ValueError("timeouts and intervals must be positive")
        self.host = host
        self.requested_port = port
        self.request_timeout = request_timeout
        self.max_connections = max_connections
        self._registry = registry
        self._readiness = Readiness(checks, timeout=check_timeout)
        self._loop = LoopWatch(interval=loop_interval, stall_threshold=stall_threshold)
        self._server: asyncio.Server | None = None
        self._monitor: asyncio.Task[None] | None = None
        self._connections: set[asyncio.Task[Any]] = set()
        self._closed = False

    @property
    def stall_threshold(self) -> float:
        """Seconds of loop lag beyond which ``/healthz`` answers 503 (settable)."""
        return self._loop.stall_threshold

    @stall_threshold.setter
    def stall_threshold(self, seconds: float) -> None:
        self._loop.stall_threshold = seconds

    # -- public API --------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return self.requested_port is not None

    @property
    def port(self) -> int | None:
        """The bound port (useful with ``port=0``); None while not serving."""
        if self._server is None or not self._server.sockets:
            return None
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def url(self) -> str | None:
        port = self.port
        if port is None:
            return None
        host = "127.0.0.1" if self.host in ("0.0.0.0", "", "::") else self.host
        return f"http://{host}:{port}"

    def add_check(self, name: str, check: Check) -> None:
        """Register (or replace) a readiness check, e.g. once a connection exists."""
        self._readiness.add(name, check)

    def remove_check(self, name: str) -> None:
        self._readiness.remove(name)

    def set_draining(self) -> None:
        """Shutdown began: readiness answers 503 from now on (liveness stays 200)."""
        self._readiness.draining = True

    async def start(self) -> Observability:
        if not self.enabled or self._server is not None:
            return self
        if self._closed:
            raise RuntimeError("observability server already closed")
        try:
            self._server = await asyncio.start_server(
                self._on_connection, self.host, self.requested_port, limit=MAX_HEAD_BYTES
            )
        except OSError as exc:
            raise ConfigError(
                f"cannot serve metrics on {self.host}:{self.requested_port}: {exc.strerror or exc}"
                " (DUETIME_METRICS_PORT; each process on a host needs its own port)"
            ) from None
        self._monitor = asyncio.create_task(self._loop.run(), name="observability:loop-lag")
        log.info("observability_started", host=self.host, port=self.port)
        return self

    async def close(self) -> None:
        """Stop serving and cancel every task this server owns. Safe twice."""
        self._closed = True
        self._readiness.draining = True
        server, self._server = self._server, None
        if server is not None:
            server.close()
        owned = (self._monitor, self._readiness.take_evaluation())
        tasks: list[asyncio.Task[Any]] = [t for t in owned if t is not None]
        tasks.extend(self._connections)
        self._monitor = None
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), timeout=self.request_timeout)
            log.info("observability_stopped")

    async def __aenter__(self) -> Observability:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def readiness(self) -> ReadinessReport:
        """Run the checks (sharing an evaluation already in flight) and report."""
        return await self._readiness.report()

    def liveness(self) -> tuple[bool, dict[str, Any]]:
        return self._loop.liveness()

    # -- internals ---------------------------------------------------------------------

    async def _on_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            if len(self._connections) > HARD_CONNECTION_FACTOR * self.max_connections:
                return  # abuse: drop without reading
            await self._serve_one(reader, writer)
        except (ConnectionError, TimeoutError):
            pass
        except asyncio.CancelledError:
            # close() cancels open connections; ending normally keeps asyncio's stream
            # callback (which calls task.exception()) from logging a spurious error.
            if not self._closed:
                raise
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), timeout=1.0)

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(self.request_timeout):
                head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            await self._respond(writer, 431, b'{"error":"request head too large"}\n', "GET")
            return
        except asyncio.IncompleteReadError:
            return  # client went away mid-request
        except TimeoutError:
            await self._respond(writer, 408, b'{"error":"request timeout"}\n', "GET")
            return
        try:
            method, path, headers = _parse_head(head)
        except ValueError as exc:
            await self._respond(writer, 400, _json({"error": str(exc)}), "GET")
            return
        if headers.get("content-length", "0") not in ("", "0") or "transfer-encoding" in headers:
            await self._respond(
                writer, 413, b'{"error":"request bodies are not accepted"}\n', "GET"
            )
            return
        if len(self._connections) > self.max_connections:
            await self._respond(writer, 503, b'{"error":"too many connections"}\n', method)
            return
        if method not in ("GET", "HEAD"):
            await self._respond(
                writer, 405, b'{"error":"use GET"}\n', method, {"Allow": "GET, HEAD"}
            )
            return
        status, body, ctype = await self._route(path, headers)
        await self._respond(writer, status, body, method, {"Content-Type": ctype})

    async def _route(self, path: str, headers: Mapping[str, str]) -> tuple[int, bytes, str]:
        if path == "/metrics":
            encoder, ctype = choose_encoder(headers.get("accept", ""))
            return 200, encoder(self._registry), ctype
        if path == "/healthz":
            alive, info = self.liveness()
            return (200 if alive else 503), _json(info), JSON_TYPE
        if path == "/readyz":
            report = await self.readiness()
            return (200 if report.ready else 503), _json(report.to_dict()), JSON_TYPE
        return (
            404,
            _json({"error": "not found", "paths": ["/metrics", "/healthz", "/readyz"]}),
            (JSON_TYPE),
        )

    async def _respond(
        self,
        writer: asyncio.StreamWriter,
        status: int,
        body: bytes,
        method: str,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        lines = [
            f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}",
            f"Content-Length: {len(body)}",
            "Connection: close",
            "Cache-Control: no-store",
        ]
        merged = {"Content-Type": JSON_TYPE, **(headers or {})}
        lines.extend(f"{k}: {v}" for k, v in merged.items())
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        if method != "HEAD":
            writer.write(body)
        async with asyncio.timeout(self.request_timeout):
            await writer.drain()


def _json(value: Any) -> bytes:
    return (json.dumps(value, sort_keys=True) + "\n").encode()


def _parse_head(head: bytes) -> tuple[str, str, dict[str, str]]:
    """Request line and headers of an HTTP/1.x request head (names lower-cased)."""
    try:
        text = head.decode("latin-1")
    except UnicodeDecodeError:  # pragma: no cover - latin-1 decodes every byte
        raise ValueError("undecodable request") from None
    request_line, *header_lines = text.rstrip("\r\n").split("\r\n")
    parts = request_line.split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise ValueError("malformed request line")
    method, target, _ = parts
    path = target.split("?", 1)[0]
    headers: dict[str, str] = {}
    for line in header_lines:
        name, sep, value = line.partition(":")
        if not sep or not name.strip():
            raise ValueError("malformed header line")
        headers[name.strip().lower()] = value.strip()
    return method.upper(), path, headers


def database_check(pool: Any) -> Check:
    """Readiness of PostgreSQL: one trivial query on ``pool`` (an asyncpg pool)."""
    from scheduler.store.status import StatusStore

    return StatusStore(pool).ping


def broker_connected(connection: Any) -> bool:
    """The aio-pika connection is up right now: not closed and, for a robust connection
    (which stays "open" while it reconnects), connected."""
    if connection is None or connection.is_closed:
        return False
    connected = getattr(connection, "connected", None)  # asyncio.Event on aio-pika >= 9
    return connected is None or connected.is_set()


def amqp_check(connection: Any) -> Check:
    """Readiness of RabbitMQ: the (robust) aio-pika connection is up right now."""

    def check() -> bool:
        return broker_connected(connection)

    return check


async def start_observability(
    settings: Settings,
    checks: Mapping[str, Check] | None = None,
    *,
    host: str | None = None,
    **options: Any,
) -> Observability:
    """Serve the endpoints on ``settings.metrics_listen``:``settings.metrics_port``;
    inert when the port is unset.

    ``checks`` maps a dependency name to its readiness check; more can be added later
    with ``handle.add_check``. Call ``handle.set_draining()`` when shutdown begins and
    ``await handle.close()`` last. Raises ``ConfigError`` when the port is taken.
    """
    handle = Observability(
        port=settings.metrics_port,
        host=settings.metrics_listen if host is None else host,
        checks=checks,
        **options,
    )
    return await handle.start()
