"""What the demo shows while it runs, and the summary it ends with.

``LiveView`` redraws one rich panel a few times a second on a terminal; ``PlainView``
prints one progress line every couple of seconds (CI logs, pipes). Both print failover
events the moment they happen. Neither reads anything: the runner hands them a
``Snapshot`` and they only format it, so what is shown is exactly what is judged.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Protocol, TextIO

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from demo.rows import Lag, Progress


@dataclass(frozen=True, slots=True)
class ProcessLine:
    name: str
    state: str  # "leader", "standby", "starting", "killed", "consuming", "exited 1", ...


@dataclass(slots=True)
class Snapshot:
    """Everything one frame shows."""

    run_id: str
    queue: str
    jobs: int
    duration: float
    elapsed: float | None  # seconds since the first job was due; None while starting
    phase: str  # starting | running | draining | done
    progress: Progress | None = None
    replicas: list[ProcessLine] = field(default_factory=list)
    workers: list[ProcessLine] = field(default_factory=list)
    events: list[tuple[float, str]] = field(default_factory=list)
    cron_note: str | None = None


class View(Protocol):
    def __enter__(self) -> View: ...
    def __exit__(self, *exc: Any) -> None: ...
    def update(self, snap: Snapshot) -> None: ...
    def event(self, at: float, text: str) -> None: ...


def fmt_seconds(value: float | None) -> str:
    """3 ms, 250 ms, 3.05 s: lag and failover figures at a glance."""
    if value is None:
        return "-"
    if abs(value) < 1:
        return f"{value * 1000:.0f} ms" if abs(value) >= 0.01 else f"{value * 1000:.1f} ms"
    return f"{value:.2f} s"


def fmt_lag(lag: Lag) -> str:
    return f"p50 {fmt_seconds(lag.p50)} · p99 {fmt_seconds(lag.p99)} · max {fmt_seconds(lag.max)}"


def leader_text(progress: Progress | None, ttl: float) -> str:
    if progress is None or not progress.fence.epoch:
        return "none yet"
    fence = progress.fence
    text = f"{fence.leader_node} (epoch {fence.epoch})"
    if fence.renewed_age is not None and fence.renewed_age > ttl / 2:
        text += f", silent for {fence.renewed_age:.1f} s"
    return text


def cron_text(snap: Snapshot) -> str:
    if snap.cron_note:
        return snap.cron_note
    if snap.progress is None or not snap.progress.cron:
        return "no fires yet"
    return " · ".join(f"{c.schedule}: {c.effects} fires" for c in snap.progress.cron)


class LiveView:
    """A rich panel redrawn in place (a terminal)."""

    def __init__(self, ttl: float, console: Console | None = None) -> None:
        self.ttl = ttl
        self.console = console or Console()
        self._live = Live(console=self.console, refresh_per_second=4, transient=False)

    def __enter__(self) -> LiveView:
        self._live.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._live.__exit__(exc_type, exc, tb)

    def event(self, at: float, text: str) -> None:
        pass  # events are part of the panel

    def update(self, snap: Snapshot) -> None:
        self._live.update(self._render(snap))

    def _render(self, snap: Snapshot) -> Panel:
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold cyan", no_wrap=True)
        grid.add_column()
        elapsed = snap.elapsed or 0.0
        bar = ProgressBar(total=snap.duration, completed=min(elapsed, snap.duration), width=30)
        grid.add_row(
            "time", Group(Text(f"{elapsed:5.1f} s of {snap.duration:g} s · {snap.phase}"), bar)
        )
        p = snap.progress
        if p is not None:
            j = p.jobs
            grid.add_row(
                "jobs",
                f"{snap.jobs} published · [yellow]{j.pending} pending[/] · {j.fired} fired · "
                f"[green]{j.succeeded} succeeded[/] · [red]{j.dead} dead[/]",
            )
            grid.add_row("lag", fmt_lag(p.effects.lag) + "  (handler start − due_at)")
            grid.add_row("effects", f"{p.effects.effects} rows · {p.effects.duplicates} duplicates")
        grid.add_row("leader", leader_text(p, self.ttl))
        grid.add_row("cron", cron_text(snap))
        grid.add_row("replicas", _states(snap.replicas))
        counts = p.by_worker if p is not None else {}
        grid.add_row(
            "workers",
            " · ".join(f"{w.name} {w.state} ({counts.get(w.name, 0)} ran)" for w in snap.workers),
        )
        if snap.events:
            lines = Text("\n".join(f"{at:5.1f} s  {text}" for at, text in snap.events[-6:]))
            grid.add_row("events", lines)
        return Panel(
            grid,
            title=f"duetime demo · run {snap.run_id} · queue {snap.queue}",
            border_style="blue",
        )


def _states(lines: list[ProcessLine]) -> str:
    marks = {"leader": "[bold green]● leader[/]", "killed": "[bold red]✗ killed[/]"}
    return " · ".join(f"{line.name} {marks.get(line.state, line.state)}" for line in lines)


class PlainView:
    """One line every ``every`` seconds, events as they happen (CI, pipes)."""

    def __init__(self, ttl: float, out: TextIO | None = None, every: float = 2.0) -> None:
        self.ttl = ttl
        self.out = out or sys.stdout
        self.every = every
        self._last = 0.0

    def __enter__(self) -> PlainView:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def event(self, at: float, text: str) -> None:
        print(f"[{at:6.1f}s] {text}", file=self.out, flush=True)

    def update(self, snap: Snapshot) -> None:
        now = time.monotonic()
        if now - self._last < self.every and snap.phase != "done":
            return
        self._last = now
        p = snap.progress
        at = snap.elapsed if snap.elapsed is not None else 0.0
        if p is None:
            states = ", ".join(f"{x.name} {x.state}" for x in snap.replicas + snap.workers)
            print(f"[{at:6.1f}s] {snap.phase}: {states}", file=self.out, flush=True)
            return
        j = p.jobs
        print(
            f"[{at:6.1f}s] {snap.phase}: pending {j.pending}, fired {j.fired}/{snap.jobs}, "
            f"succeeded {j.succeeded}, dead {j.dead} | lag {fmt_lag(p.effects.lag)} | "
            f"leader {leader_text(p, self.ttl)} | cron fires {sum(c.effects for c in p.cron)}",
            file=self.out,
            flush=True,
        )
