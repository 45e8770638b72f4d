"""Serve the dashboard: uvicorn on our own event loop, stopped by ``scheduler.service``.

uvicorn normally installs its own SIGTERM/SIGINT handlers; here ``Service`` owns the
signals (the same contract as every duetime process: first signal = graceful, second =
exit 130, systemd notify and watchdog), so ``Server.capture_signals`` is a no-op and a
stop sets ``should_exit``: uvicorn stops accepting, lets in-flight requests finish
(``GRACE`` seconds at most), runs the lifespan shutdown (closes the pool) and returns.
The socket is bound here, before uvicorn starts, so a busy port or a bad address is a
one-line error instead of a log line and ``sys.exit`` inside uvicorn.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator

import uvicorn
from starlette.types import ASGIApp

from scheduler.config import Settings
from scheduler.dashboard.app import Dashboard, create_app
from scheduler.dashboard.auth import Auth, check_listen
from scheduler.dashboard.hosts import Hosts
from scheduler.errors import ConfigError
from scheduler.log import get_logger
from scheduler.service import Service

log = get_logger(__name__)

GRACE = 5


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.serving = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # signals belong to scheduler.service.Service

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            self.serving.set()


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(128)
    sock.setblocking(False)
    return sock


def server_config(app: ASGIApp, settings: Settings) -> uvicorn.Config:
    """uvicorn's settings for the dashboard. ``X-Forwarded-For``/``-Proto`` are believed
    only from ``DUETIME_DASHBOARD_TRUSTED_PROXIES`` (default none): otherwise any local
    process could pick the client address the audit log and the throttle see."""
    proxies = list(settings.dashboard_trusted_proxies)
    return uvicorn.Config(
        app,
        log_config=None,
        access_log=False,
        lifespan="on",
        proxy_headers=bool(proxies),
        forwarded_allow_ips=proxies or None,
        timeout_graceful_shutdown=GRACE,
        server_header=False,
    )


async def serve(settings: Settings, *, read_only: bool) -> int:
    host, port = check_listen(settings.dashboard_listen, settings.dashboard_token)
    sock = bind(host, port)
    actual = sock.getsockname()[1]
    hosts = Hosts.for_listen(host, actual, settings.dashboard_hosts)
    dash = Dashboard(
        settings, Auth.create(settings.dashboard_token), read_only=read_only, hosts=hosts
    )
    config = server_config(create_app(dash), settings)
    server = _Server(config)
    shown = f"[{host}]" if ":" in host else host
    async with Service(
        "dashboard", metrics_port=settings.metrics_port, metrics_host=settings.metrics_listen
    ) as service:
        task = asyncio.create_task(server.serve(sockets=[sock]), name="uvicorn")
        serving = asyncio.create_task(server.serving.wait())
        await asyncio.wait({task, serving}, return_when=asyncio.FIRST_COMPLETED)
        if not server.serving.is_set():
            serving.cancel()
            await task
            raise ConfigError("the dashboard did not start (see the log above)")
        log.info(
            "dashboard_listening", url=f"http://{shown}:{actual}/", read_only=read_only,
            token=settings.dashboard_token is not None,
        )  # fmt: skip
        service.ready()
        stop = asyncio.create_task(service.stop_event.wait())
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        server.should_exit = True
        await task
        stop.cancel()
    sock.close()
    if not service.stop_event.is_set():  # uvicorn ended without being asked to
        log.error("dashboard_server_exited")
        return 1
    log.info("dashboard_stopped")
    return 0
