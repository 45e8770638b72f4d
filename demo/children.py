"""The demo's child processes: started with a log file each, always reaped.

Each child runs in its own session (process group), so a Ctrl-C in the terminal reaches
only the demo, which then stops its children in order (SIGTERM: replicas resign, workers
finish in-flight jobs) instead of all of them dying at once; ``kill9`` crashes one on
purpose (the failover the demo shows). ``Children.stop_all`` is SIGTERM, a bounded wait,
then SIGKILL for the stubborn; ``kill_all`` is the synchronous last resort, also run at
interpreter exit, so no child outlives the demo unless the demo itself is SIGKILLed.

Logs are the children's JSON lines; ``Child.new_events`` reads only what was appended
since the last call, so following a busy worker's log stays cheap.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import os
import signal
import subprocess
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

_LIVE: weakref.WeakSet[Child] = weakref.WeakSet()


class Child:
    """One child process (a replica or a worker) and its log file."""

    def __init__(
        self, name: str, role: str, argv: Sequence[str], env: Mapping[str, str], log_path: Path
    ) -> None:
        self.name = name
        self.role = role
        self.argv = list(argv)
        self.env = dict(env)
        self.log_path = log_path
        self.starts = 0
        self.pids: list[int] = []
        self._proc: subprocess.Popen[bytes] | None = None
        self._offset = 0
        self._partial = b""

    def start(self) -> Child:
        """Start (or restart) it; the first start truncates the log, restarts append."""
        if self.running():
            raise RuntimeError(f"{self.name} is already running")
        mode = "wb" if self.starts == 0 else "ab"
        with open(self.log_path, mode) as log:
            self._proc = subprocess.Popen(
                self.argv,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.starts += 1
        self.pids.append(self._proc.pid)
        _LIVE.add(self)
        return self

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def returncode(self) -> int | None:
        return None if self._proc is None else self._proc.poll()

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def signal(self, sig: int) -> None:
        """Send ``sig`` to its whole process group (nothing if it is gone: once reaped,
        its pid could belong to someone else)."""
        if self._proc is None or self._proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, sig)

    def kill9(self) -> None:
        """Crash it: SIGKILL, no cleanup, no resignation (what the failover shows)."""
        self.signal(signal.SIGKILL)
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=5)

    def new_events(self) -> list[dict[str, Any]]:
        """JSON log lines appended since the last call (other lines are skipped)."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self._offset)
                chunk = log.read()
        except FileNotFoundError:
            return []
        self._offset += len(chunk)
        data = self._partial + chunk
        lines = data.split(b"\n")
        self._partial = lines.pop()  # an unfinished last line waits for the next call
        events = []
        for line in lines:
            if not line.startswith(b"{"):
                continue
            try:
                event = json.loads(line)
            except ValueError:  # a line cut short by kill -9
                continue
            if isinstance(event, dict):
                events.append(event)
        return events

    def tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def reap(self, timeout: float) -> None:
        """SIGKILL the group if still running, then collect the exit status."""
        if self._proc is None:
            return
        self.signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=timeout)
        _LIVE.discard(self)


class Children:
    """The demo's children, stopped together."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.all: list[Child] = []

    def spawn(self, name: str, role: str, argv: Sequence[str], env: Mapping[str, str]) -> Child:
        child = Child(name, role, argv, env, self.log_dir / f"{name}.log")
        self.all.append(child)
        return child.start()

    def by_role(self, role: str) -> list[Child]:
        return [c for c in self.all if c.role == role]

    def find(self, name: str | None) -> Child | None:
        return next((c for c in self.all if c.name == name), None)

    async def stop_all(self, timeout: float) -> list[str]:
        """SIGTERM everyone, wait up to ``timeout``, SIGKILL the rest; return the names
        of those that needed SIGKILL. Workers first so in-flight jobs finish while a
        leader still runs, then the replicas (the leader resigns on SIGTERM); the
        dashboard, when there is one, before all of them."""
        stubborn: list[str] = []
        for role in ("dashboard", "worker", "scheduler"):
            group = [c for c in self.by_role(role) if c.running()]
            for child in group:
                child.signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            # a Popen exit has no awaitable event: poll it, bounded by the deadline
            while any(c.running() for c in group) and time.monotonic() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
            for child in group:
                if child.running():
                    stubborn.append(child.name)
                child.reap(timeout=5)
        self.kill_all()
        return stubborn

    def kill_all(self) -> None:
        for child in self.all:
            child.reap(timeout=5)


@atexit.register
def _kill_leftovers() -> None:
    """Last line of defence (a second Ctrl-C during shutdown, an unexpected error)."""
    for child in list(_LIVE):
        child.reap(timeout=2)
