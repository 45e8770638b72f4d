"""``duetime worker --processes N``: N worker processes under one supervising command.

One worker process runs its handlers on one core: its event loop, and its plain ``def``
handlers' threads, share one GIL. CPU-bound handlers need more processes, and running
them should stay one command (one systemd unit, one container). The supervisor starts
N children, each the very same ``duetime worker`` command line (``sys.argv``), marked
by ``SUPERVISED_ENV`` so it runs as a plain worker, with:

- its own node id, ``<node_id>-<i>`` (logs, the broker connection's name);
- its own metrics port, ``metrics_port + i`` when one is set (i from 0), since N
  processes cannot share one listening port;
- no systemd notify socket: the supervisor tells systemd READY and pings its watchdog
  (``Type=notify``, ``NotifyAccess=main``, ``KillMode=mixed`` of the shipped unit);
- its own session and process group, so a Ctrl-C in the terminal reaches the
  supervisor alone, which forwards one SIGTERM to each child (a second signal to the
  supervisor forwards a second one: the children's immediate exit); on Linux each
  child also gets SIGTERM if the supervisor dies (``PR_SET_PDEATHSIG``), so a killed
  supervisor leaves no orphans consuming.

A child that exits while the supervisor is not stopping (a crash, an OOM kill, or
status 75: too many abandoned handler threads, ``workers.threads``) is logged
(``worker_process_exited``) and started again after a back-off (1 s, doubling to 30 s
while it keeps dying within ``HEALTHY_AFTER`` seconds of its start). A child that fails
``MAX_QUICK_FAILURES`` times in a row right after starting (a bad ``--import``, a wrong
setting) stops them all: the supervisor exits with that child's status rather than
restarting it forever. SIGTERM/SIGINT: every child stops gracefully (its own grace
period), then the supervisor exits 0; children still running ``grace_period + 15``
seconds later are killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from scheduler.clock import SYSTEM_CLOCK, Clock
from scheduler.config import Settings
from scheduler.log import get_logger
from scheduler.service import notify, watchdog_interval

__all__ = ["SUPERVISED_ENV", "supervise"]

log = get_logger("duetime.worker")

#: Set in each child's environment (its index): it runs as one worker, not a supervisor.
#: Not a DUETIME_* name: those are settings, and unknown ones are refused.
SUPERVISED_ENV = "_DUETIME_WORKER_PROCESS_INDEX"
#: A child that ran this long before exiting was healthy: its back-off starts over.
HEALTHY_AFTER = 10.0
#: Consecutive quick failures of one child after which the supervisor gives up.
MAX_QUICK_FAILURES = 5
FIRST_BACKOFF = 1.0
MAX_BACKOFF = 30.0
#: Seconds beyond the grace period before children that did not stop are killed.
KILL_AFTER_GRACE = 15.0
_SYSTEMD_VARS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the supervisor dies (Linux only)."""
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class _Child:
    index: int
    proc: asyncio.subprocess.Process | None = None
    started: float = 0.0
    quick_failures: int = 0
    backoff: float = FIRST_BACKOFF
    restarts: int = 0
    waiter: asyncio.Task[int] | None = field(default=None, repr=False)


class Supervisor:
    """Starts, watches and stops the child workers (module docstring)."""

    def __init__(
        self,
        command: Sequence[str],
        processes: int,
        settings: Settings,
        *,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.command = list(command)
        self.settings = settings
        self.clock = clock
        self.children = [_Child(i) for i in range(processes)]
        self.stopping = asyncio.Event()
        self.signals = 0
        self.exit_status = 0

    def _env(self, index: int) -> dict[str, str]:
        # systemd's notify socket and watchdog are the supervisor's (NotifyAccess=main)
        env = {k: v for k, v in os.environ.items() if k not in _SYSTEMD_VARS}
        env[SUPERVISED_ENV] = str(index)
        env["DUETIME_NODE_ID"] = f"{self.settings.node_id}-{index}"
        if self.settings.metrics_port is not None:
            env["DUETIME_METRICS_PORT"] = str(self.settings.metrics_port + index)
        return env

    def _argv(self, index: int) -> list[str]:
        """The command, with the per-child settings given as flags too: flags win over
        the environment, and the command line may already name them."""
        argv = [*self.command, "--node-id", f"{self.settings.node_id}-{index}"]
        if self.settings.metrics_port is not None:
            argv += ["--metrics-port", str(self.settings.metrics_port + index)]
        return argv

    async def _start(self, child: _Child) -> None:
        child.proc = await asyncio.create_subprocess_exec(
            *self._argv(child.index),
            env=self._env(child.index),
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
        child.started = self.clock.monotonic()
        child.waiter = asyncio.create_task(child.proc.wait(), name=f"worker-{child.index}")
        log.info(
            "worker_process_started", index=child.index, pid=child.proc.pid, restarts=child.restarts
        )

    def signal(self, signum: int) -> None:
        """SIGTERM/SIGINT: forward one SIGTERM to every child, and stop restarting."""
        self.signals += 1
        self.stopping.set()
        log.info("worker_processes_stopping", signal=signal.Signals(signum).name, n=self.signals)
        for child in self.children:
            if child.proc is not None and child.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    child.proc.send_signal(signal.SIGTERM)

    async def run(self) -> int:
        for child in self.children:
            await self._start(child)
        log.info("worker_processes_running", processes=len(self.children))
        notify("READY=1")
        interval = watchdog_interval()
        pinger = asyncio.create_task(self._ping(interval)) if interval else None
        stop_wait = asyncio.create_task(self.stopping.wait())
        try:
            while not self.stopping.is_set():
                waiters = {c.waiter for c in self.children if c.waiter is not None}
                done, _ = await asyncio.wait(
                    {stop_wait, *waiters}, return_when=asyncio.FIRST_COMPLETED
                )
                for child in self.children:
                    if child.waiter in done and not self.stopping.is_set():
                        await self._exited(child)
        finally:
            notify("STOPPING=1")
            stop_wait.cancel()
            if pinger is not None:
                pinger.cancel()
            await self._stop_all()
        return self.exit_status

    async def _ping(self, interval: float) -> None:
        """systemd's watchdog: the supervisor's loop is alive (each child's own loop is
        watched by its restart on exit, not by systemd)."""
        while True:
            notify("WATCHDOG=1")
            await asyncio.sleep(interval)

    async def _exited(self, child: _Child) -> None:
        assert child.proc is not None and child.waiter is not None
        status = child.waiter.result()
        ran = self.clock.monotonic() - child.started
        child.waiter = None
        if ran >= HEALTHY_AFTER:
            child.quick_failures, child.backoff = 0, FIRST_BACKOFF
        elif status != 0:
            child.quick_failures += 1
        log.warning(
            "worker_process_exited",
            index=child.index,
            pid=child.proc.pid,
            exit_status=status,
            ran_s=round(ran, 1),
            action="restart" if child.quick_failures < MAX_QUICK_FAILURES else "give up",
        )
        if child.quick_failures >= MAX_QUICK_FAILURES:
            log.error(
                "worker_processes_giving_up",
                index=child.index,
                exit_status=status,
                detail=f"exited {child.quick_failures} times in a row within "
                f"{HEALTHY_AFTER:g}s of starting: see its log above",
            )
            self.exit_status = status or 1
            self.stopping.set()
            self.signal(signal.SIGTERM)
            return
        try:
            async with asyncio.timeout(child.backoff):
                await self.stopping.wait()
            return  # told to stop meanwhile
        except TimeoutError:
            pass
        child.backoff = min(MAX_BACKOFF, child.backoff * 2)
        child.restarts += 1
        await self._start(child)

    async def _stop_all(self) -> None:
        running = [c for c in self.children if c.proc is not None and c.proc.returncode is None]
        if not running:
            return
        for child in running:  # a no-op for those signalled already: they are stopping
            if self.signals == 0:
                assert child.proc is not None
                with contextlib.suppress(ProcessLookupError):
                    child.proc.send_signal(signal.SIGTERM)
        deadline = self.settings.worker_grace_period + KILL_AFTER_GRACE
        waits = [c.proc.wait() for c in running if c.proc is not None]
        try:
            async with asyncio.timeout(deadline):
                await asyncio.gather(*waits)
        except TimeoutError:
            for child in running:
                if child.proc is not None and child.proc.returncode is None:
                    log.error("worker_process_killed", index=child.index, pid=child.proc.pid)
                    with contextlib.suppress(ProcessLookupError):
                        child.proc.kill()
            await asyncio.gather(*(c.proc.wait() for c in running if c.proc is not None))
        log.info(
            "worker_processes_stopped",
            exit_statuses=[c.proc.returncode for c in self.children if c.proc is not None],
        )


async def supervise(
    processes: int,
    settings: Settings,
    *,
    command: Sequence[str] | None = None,
    install_signals: Callable[[Supervisor], None] | None = None,
) -> int:
    """Run ``processes`` copies of this ``duetime worker`` command until SIGTERM/SIGINT
    (module docstring); the exit status is 0, or a child's that kept failing."""
    argv = list(command) if command is not None else [sys.executable, "-m", "scheduler.cli"]
    if command is None:
        argv += sys.argv[1:]
    supervisor = Supervisor(argv, processes, settings)
    loop = asyncio.get_running_loop()
    if install_signals is not None:
        install_signals(supervisor)
    else:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, supervisor.signal, signum)
    try:
        return await supervisor.run()
    finally:
        if install_signals is None:
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(signum)
