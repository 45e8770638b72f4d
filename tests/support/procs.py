"""Child processes for tests: start, signal, wait, and always reap.

A ``ChildProcess`` runs one command in its own session (so signals reach everything it
spawned), with stdout and stderr captured to a file that is printed in failure
messages. Chaos tests use the signal helpers to crash (``kill9``), pause (``sigstop``)
and resume (``sigcont``) a replica or worker; ``stop`` is the polite SIGTERM-then-kill.

Cleanup is not optional: ``ChildProcess`` and ``Processes`` are (async) context
managers that SIGKILL whatever is still running, and an ``atexit`` hook kills any child
a crashed test left behind, so no test run leaves orphans holding ports or leases.
Logs are kept for the post-mortem: pass pytest's ``tmp_path`` as ``log_dir`` to have
pytest manage them (otherwise they stay in a ``/tmp/duetime-proc*`` directory).

Typical fixture::

    @pytest.fixture
    def procs(tmp_path):
        with Processes(tmp_path) as group:
            yield group

    async def test_x(procs):
        leader = procs.spawn(duetime_argv("scheduler"), name="a", env={...})
        ...
        leader.kill9()
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import os
import signal
import subprocess
import sys
import tempfile
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

REPO_ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent

_LIVE: weakref.WeakSet[ChildProcess] = weakref.WeakSet()
_COUNTER = itertools.count(1)


def python_module_argv(module: str, *args: str) -> list[str]:
    """``python -m module args...`` with the interpreter running the tests."""
    return [sys.executable, "-m", module, *args]


def duetime_argv(*args: str) -> list[str]:
    """The ``duetime`` console script from the test interpreter's environment."""
    script = VENV_BIN / "duetime"
    if not script.exists():  # not installed as a script: run the CLI module instead
        return python_module_argv("scheduler.cli", *args)
    return [str(script), *args]


class ChildProcess:
    """One child process with captured output. Create with ``start()`` or ``spawn()``."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        name: str | None = None,
        env: Mapping[str, str] | None = None,
        inherit_env: bool = True,
        cwd: str | os.PathLike[str] | None = None,
        log_dir: str | os.PathLike[str] | None = None,
        separate_stderr: bool = False,
    ) -> None:
        if not argv:
            raise ValueError("argv must not be empty")
        self.argv = [str(a) for a in argv]
        self.name = name or f"{Path(self.argv[0]).name}-{next(_COUNTER)}"
        base = dict(os.environ) if inherit_env else {}
        base.setdefault("PYTHONUNBUFFERED", "1")  # output reaches the file before a kill -9
        self.env = {**base, **(env or {})}
        self.cwd = Path(cwd) if cwd is not None else REPO_ROOT
        directory = (
            Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="duetime-proc-"))
        )
        directory.mkdir(parents=True, exist_ok=True)
        self.stdout_path = directory / f"{self.name}.log"
        self.stderr_path = directory / f"{self.name}.err" if separate_stderr else self.stdout_path
        self._proc: subprocess.Popen[bytes] | None = None

    # -- lifecycle -----------------------------------------------------------------

    def start(self) -> ChildProcess:
        """Start the process (once). Output is appended, so restarts keep history."""
        if self._proc is not None and self._proc.poll() is None:
            raise RuntimeError(f"{self.name} is already running (pid {self._proc.pid})")
        with contextlib.ExitStack() as files:
            out = files.enter_context(open(self.stdout_path, "ab"))
            err = (
                subprocess.STDOUT
                if self.stderr_path == self.stdout_path
                else files.enter_context(open(self.stderr_path, "ab"))
            )
            self._proc = subprocess.Popen(
                self.argv,
                env=self.env,
                cwd=self.cwd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,  # own process group: signals reach grandchildren
            )
        _LIVE.add(self)
        return self

    @property
    def pid(self) -> int:
        return self._require().pid

    @property
    def returncode(self) -> int | None:
        """None while running; negative signal number if killed by a signal."""
        return None if self._proc is None else self._proc.poll()

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def output(self) -> str:
        """Everything the process wrote so far (stdout, and stderr unless separate)."""
        return _read(self.stdout_path)

    def errors(self) -> str:
        return _read(self.stderr_path)

    def tail(self, lines: int = 40) -> str:
        text = self.output()
        if self.stderr_path != self.stdout_path:
            text += self.errors()
        return "\n".join(text.splitlines()[-lines:])

    # -- signals -------------------------------------------------------------------

    def send(self, sig: int, *, group: bool = True) -> None:
        """Send ``sig`` to the process group (default) or the process alone."""
        proc = self._require()
        try:
            if group:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)
        except ProcessLookupError:  # already gone: nothing to signal
            pass

    def sigterm(self) -> None:
        self.send(signal.SIGTERM)

    def kill9(self) -> None:
        """Crash it: SIGKILL, no cleanup code runs (the failure chaos tests simulate)."""
        self.send(signal.SIGKILL)

    def sigstop(self) -> None:
        """Freeze it (a GC pause, a stalled VM): sockets stay open, nothing runs."""
        self.send(signal.SIGSTOP)

    def sigcont(self) -> None:
        self.send(signal.SIGCONT)

    # -- waiting -------------------------------------------------------------------

    async def wait(self, timeout: float) -> int:
        """Wait up to ``timeout`` seconds for exit; return the exit code.

        Raises ``AssertionError`` with the output tail if it is still running.
        """
        proc = self._require()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (code := proc.poll()) is None:
            if loop.time() >= deadline:
                raise AssertionError(
                    f"{self.name} (pid {proc.pid}) still running after {timeout:.1f}s; "
                    f"output tail:\n{self.tail()}"
                )
            await asyncio.sleep(0.02)
        return code

    async def stop(self, timeout: float = 5.0) -> int | None:
        """SIGTERM (resuming it if paused), wait ``timeout``, then SIGKILL. Return code."""
        if self._proc is None:
            return None
        if self._proc.poll() is None:
            self.sigterm()
            self.sigcont()  # a stopped process only acts on SIGTERM once continued
            try:
                return await self.wait(timeout)
            except AssertionError:
                pass
        self.kill()
        return self._proc.poll()

    def kill(self) -> None:
        """SIGKILL the whole group and reap it. Safe to call at any time, repeatedly."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self.kill9()
        # The leader may be dead while children of the group live on: kill them too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=5)
        _LIVE.discard(self)

    def _require(self) -> subprocess.Popen[bytes]:
        if self._proc is None:
            raise RuntimeError(f"{self.name} was not started")
        return self._proc

    # -- context managers ------------------------------------------------------------

    def __enter__(self) -> ChildProcess:
        if self._proc is None:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.kill()

    async def __aenter__(self) -> ChildProcess:
        return self.__enter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.kill()

    def __repr__(self) -> str:
        state = (
            "not started" if self._proc is None else f"pid={self._proc.pid} rc={self.returncode}"
        )
        return f"ChildProcess({self.name!r}, {state})"


class Processes:
    """A set of child processes killed together at cleanup (fixture-friendly)."""

    def __init__(self, log_dir: str | os.PathLike[str] | None = None) -> None:
        self.log_dir = (
            Path(log_dir)
            if log_dir is not None
            else Path(tempfile.mkdtemp(prefix="duetime-procs-"))
        )
        self._children: list[ChildProcess] = []

    def spawn(
        self,
        argv: Sequence[str],
        *,
        name: str | None = None,
        env: Mapping[str, str] | None = None,
        **kwargs: object,
    ) -> ChildProcess:
        child = ChildProcess(argv, name=name, env=env, log_dir=self.log_dir, **kwargs)  # type: ignore[arg-type]
        self._children.append(child)
        return child.start()

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(list(self._children))

    async def stop_all(self, timeout: float = 5.0) -> None:
        """Polite shutdown of every child, SIGKILL for the stubborn ones."""
        await asyncio.gather(*(c.stop(timeout) for c in self._children))

    def kill_all(self) -> None:
        for child in self._children:
            child.kill()

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill_all()

    async def __aenter__(self) -> Processes:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.kill_all()


def spawn(argv: Sequence[str], **kwargs: object) -> ChildProcess:
    """Create and start a ``ChildProcess``; use it as a context manager to reap it."""
    return ChildProcess(argv, **kwargs).start()  # type: ignore[arg-type]


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


@atexit.register
def _kill_leftovers() -> None:
    """Last line of defence: no child outlives the test session."""
    for child in list(_LIVE):
        child.kill()
