"""Process scaffolding shared by long-running commands (``duetime scheduler``,
``duetime worker``, ``duetime dashboard``): signals, the event-loop monitor, the HTTP
endpoints, and systemd notify.

Why one place: every service must behave the same way under systemd and to operators.
``/metrics``, ``/healthz`` and ``/readyz`` come from ``scheduler.observability`` (served
on ``metrics_listen``:``metrics_port``, loopback unless configured; readiness turns 503
as soon as shutdown begins). SIGTERM or SIGINT asks for a graceful stop (the ``stop``
event the command's main loop watches); a second signal means "now": it is logged and
the process exits at once with status 130, without running any more cleanup (an
operator pressing Ctrl-C twice, or a stuck shutdown). The systemd protocol is a datagram
to ``$NOTIFY_SOCKET`` (``READY=1`` once serving, ``WATCHDOG=1`` periodically,
``STOPPING=1`` on the way out); the watchdog ping is sent from a task on the event loop,
so a blocked loop stops the pings and systemd's ``WatchdogSec=`` notices the hang — the
same symptom the loop monitor logs.

Usage::

    async with Service(
        "scheduler", metrics_port=settings.metrics_port, metrics_host=settings.metrics_listen
    ) as service:
        service.ready()
        await main_loop(service.stop_event)
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
from collections.abc import Mapping
from types import TracebackType

from scheduler.log import get_logger
from scheduler.loopmon import DEFAULT_THRESHOLD, LoopMonitor
from scheduler.observability import DEFAULT_HOST, Check, Observability

log = get_logger(__name__)

FORCED_EXIT_CODE = 130
HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _notify_address(path: str) -> str | None:
    """``$NOTIFY_SOCKET`` as an AF_UNIX address: '@name' is Linux's abstract namespace."""
    if path.startswith("@"):
        return "\0" + path[1:]
    if path.startswith("/"):
        return path
    return None  # e.g. vsock: addresses systemd uses only inside VMs; not supported


def notify(state: str, *, environ: Mapping[str, str] | None = None) -> bool:
    """Send ``state`` (e.g. ``"READY=1"``) to systemd; False when not under systemd.

    Never raises: a service must not die because its supervisor is unreachable.
    """
    env = os.environ if environ is None else environ
    raw = env.get("NOTIFY_SOCKET")
    if not raw:
        return False
    address = _notify_address(raw)
    if address is None:
        log.warning("sd_notify_unsupported_socket", socket=raw)
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.settimeout(1.0)
            sock.connect(address)
            sock.sendall(state.encode())
    except OSError as exc:
        log.warning("sd_notify_failed", state=state, error=str(exc))
        return False
    return True


def watchdog_interval(environ: Mapping[str, str] | None = None) -> float | None:
    """Seconds between ``WATCHDOG=1`` pings (half of ``$WATCHDOG_USEC``), or None."""
    env = os.environ if environ is None else environ
    usec = env.get("WATCHDOG_USEC", "")
    pid = env.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) <= 0:
        return None
    if pid and pid != str(os.getpid()):
        return None  # the watchdog is meant for another process
    return int(usec) / 1_000_000 / 2


class Service:
    """Signals, loop monitor, metrics endpoint and systemd notify for one process."""

    def __init__(
        self,
        name: str,
        *,
        metrics_port: int | None = None,
        metrics_host: str = DEFAULT_HOST,
        checks: Mapping[str, Check] | None = None,
        loop_lag_threshold: float = DEFAULT_THRESHOLD,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.name = name
        self.environ = os.environ if environ is None else environ
        self.stop_event = asyncio.Event()
        self.signals_received = 0
        self.monitor = LoopMonitor(threshold=loop_lag_threshold)
        # /metrics, /healthz, /readyz on metrics_host:metrics_port (inert when the port
        # is None; the host is settings.metrics_listen, loopback unless configured); add
        # readiness checks with ``service.observability.add_check`` once connections exist.
        self.observability = Observability(port=metrics_port, host=metrics_host, checks=checks)
        self._watchdog: asyncio.Task[None] | None = None
        self._installed: list[signal.Signals] = []

    # -- lifecycle -------------------------------------------------------------------

    async def __aenter__(self) -> Service:
        await self.observability.start()  # first: the only step that can fail (busy port)
        loop = asyncio.get_running_loop()
        for sig in HANDLED_SIGNALS:
            loop.add_signal_handler(sig, self._on_signal, sig)
            self._installed.append(sig)
        self.monitor.start()
        interval = watchdog_interval(self.environ)
        if interval is not None:
            self._watchdog = asyncio.create_task(self._ping(interval), name="sd-watchdog")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        notify("STOPPING=1", environ=self.environ)
        watchdog, self._watchdog = self._watchdog, None
        if watchdog is not None:
            watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watchdog
        await self.monitor.stop()
        await self.observability.close()
        loop = asyncio.get_running_loop()
        for sig in self._installed:
            loop.remove_signal_handler(sig)
        self._installed.clear()

    def ready(self) -> None:
        """Tell systemd the service is up (Type=notify units wait for this)."""
        notify("READY=1", environ=self.environ)
        log.info("service_ready", service=self.name)

    def status(self, text: str) -> None:
        """A one-line status shown by ``systemctl status``."""
        notify(f"STATUS={text}", environ=self.environ)

    # -- internals -------------------------------------------------------------------

    def _on_signal(self, sig: signal.Signals) -> None:
        self.signals_received += 1
        if self.signals_received == 1:
            log.info("shutdown_requested", service=self.name, signal=sig.name)
            self.observability.set_draining()
            self.stop_event.set()
            return
        log.warning(
            "shutdown_forced", service=self.name, signal=sig.name, exit_code=FORCED_EXIT_CODE
        )
        os._exit(FORCED_EXIT_CODE)

    async def _ping(self, interval: float) -> None:
        while True:
            notify("WATCHDOG=1", environ=self.environ)
            await asyncio.sleep(interval)
