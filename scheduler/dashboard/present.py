"""What the pages show, computed from store rows (pure: no I/O, no clock of its own).

- Lag percentiles over windows and per minute, from the overview's lag sample, and
  completions per minute (exact, or estimated from the sample's spacing when a minute
  had more completions than the sample holds).
- Fire times in a schedule's zone with DST marks: ``gap`` when the fire time is the
  instant clocks spring forward (where a wall time named inside the skipped stretch
  fires, DESIGN §5b), ``repeat`` when its local time happens twice that day (fall back;
  duetime fires once, at the first occurrence).
- Payloads pretty-printed and capped (``PAYLOAD_CAP`` characters): a 5 MB payload must
  not make a 5 MB page.
- Ages as a person reads them ("3.2s", "4m 10s", "2h 5m").
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol
from zoneinfo import ZoneInfo

PAYLOAD_CAP = 20_000
ERROR_CAP = 4_000


TERMINAL = ("succeeded", "dead", "cancelled")
LIVE = ("pending", "due_now", "dispatched", "dead_last_hour")
KEPT = ("dispatched", "dead_last_hour")  # counted even when pending is not


def queue_counts(
    live: Iterable[Any],
    terminal: Mapping[tuple[str, str], int],
    *,
    exact: bool,
    pending_counted: bool = True,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Rows per queue for the overview table, and the totals of each state.

    ``live`` are ``status.QueueStatus`` rows (exact, per queue); ``terminal`` maps
    (queue, state) to a count when ``exact``, else ("*", state) to an estimate, which
    then has no per-queue split (the cells stay empty). Without ``pending_counted`` the
    pending and due-now cells and totals are None (the backlog was too large to count)."""
    rows: dict[str, dict[str, Any]] = {}
    for q in live:
        rows[q.queue] = {"queue": q.queue, **{k: getattr(q, k) for k in LIVE}}
        # an undeclared queue's pending jobs are held, never dispatched (migration 0008)
        rows[q.queue]["declared"] = getattr(q, "declared", True)
    if exact:
        for queue, _ in terminal:
            rows.setdefault(queue, {"queue": queue, "declared": True, **dict.fromkeys(LIVE, 0)})
    for row in rows.values():
        for state in TERMINAL:
            row[state] = terminal.get((row["queue"], state), 0) if exact else None
    if not pending_counted:
        for row in rows.values():
            row["pending"] = row["due_now"] = None
    totals: dict[str, Any] = {
        k: sum(r[k] for r in rows.values()) if pending_counted or k in KEPT else None for k in LIVE
    }
    for state in TERMINAL:
        totals[state] = sum(n for (_, s), n in terminal.items() if s == state)
    return [rows[q] for q in sorted(rows)], totals


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) by nearest rank; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q * (len(ordered) - 1))))
    return ordered[rank]


@dataclass(frozen=True, slots=True)
class LagSummary:
    samples: int
    p50: float | None
    p99: float | None


def lag_window(samples: Iterable[tuple[int, float]], minutes: int) -> LagSummary:
    """p50/p99 of the samples taken in the last ``minutes`` minutes."""
    values = [lag for ago, lag in samples if ago < minutes]
    return LagSummary(len(values), percentile(values, 0.5), percentile(values, 0.99))


def lag_per_minute(
    samples: Iterable[tuple[int, float]],
) -> dict[str, list[tuple[int, float]]]:
    """Series ``{"p50": [(minutes_ago, seconds)], "p99": [...]}`` for the line chart."""
    by_minute: dict[int, list[float]] = {}
    for ago, lag in samples:
        by_minute.setdefault(ago, []).append(lag)
    out: dict[str, list[tuple[int, float]]] = {"p50": [], "p99": []}
    for ago in sorted(by_minute):
        values = by_minute[ago]
        out["p50"].append((ago, percentile(values, 0.5) or 0.0))
        out["p99"].append((ago, percentile(values, 0.99) or 0.0))
    return out


class _Minute(Protocol):
    @property
    def minutes_ago(self) -> int: ...
    @property
    def sampled(self) -> int: ...
    @property
    def span(self) -> float: ...


@dataclass(frozen=True, slots=True)
class Completions:
    per_minute: dict[int, float]
    estimated: frozenset[int]  # minutes whose count comes from the sample's spacing

    def total(self, minutes: int) -> int:
        return round(sum(n for ago, n in self.per_minute.items() if ago < minutes))

    def any_estimated(self, minutes: int) -> bool:
        return any(ago < minutes for ago in self.estimated)


def completions_per_minute(samples: Iterable[_Minute], *, cap: int) -> Completions:
    """Completions per minute from the overview's per-minute ledger samples: exact for a
    minute with fewer than ``cap`` completions (the sample is all of them); for a busier
    one, ``(cap - 1)`` intervals over the sample's span, scaled to 60 s."""
    counts: dict[int, float] = {}
    estimated = set()
    for m in samples:
        if m.sampled < cap or m.span <= 0:
            counts[m.minutes_ago] = float(m.sampled)
        else:
            counts[m.minutes_ago] = max(float(cap), (m.sampled - 1) * 60.0 / m.span)
            estimated.add(m.minutes_ago)
    return Completions(counts, frozenset(estimated))


def age_parts(seconds: float) -> tuple[int, str, int, str]:
    """An age of a minute or more as its two largest units, e.g. ``(3, "m", 5, "s")``,
    ``(2, "h", 4, "m")``, ``(1, "d", 3, "h")`` (up to 48 hours in hours): how
    the dashboard and ``duetime status`` print ages, each in its own spacing."""
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return minutes, "m", secs, "s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return hours, "h", minutes, "m"
    return hours // 24, "d", hours % 24, "h"


def age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 0:
        return "in " + age(-seconds)
    if seconds < 10:
        return f"{seconds:.1f}s"
    if seconds < 60:
        return f"{seconds:.0f}s"
    big, big_unit, small, small_unit = age_parts(seconds)
    return f"{big}{big_unit} {small}{small_unit}"


def seconds(value: float | None) -> str:
    """A lag: milliseconds below a second."""
    if value is None:
        return "-"
    if abs(value) < 1:
        return f"{value * 1000:.0f} ms"
    return age(value)


def utc(value: datetime | None) -> str:
    if value is None:
        return "-"
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def pretty_json(value: Any, cap: int = PAYLOAD_CAP) -> tuple[str, bool]:
    """Indented JSON, cut at ``cap`` characters; (text, was_cut). The dashboard's pools
    decode deep JSON to a note (``db.decode_jsonb_for_display``); a value that still
    cannot be written out is shown as a note, never an error page."""
    try:
        text = json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True, default=str)
    except (RecursionError, ValueError) as exc:
        return f"(not shown: the value cannot be written as JSON: {type(exc).__name__})", False
    if len(text) > cap:
        return text[:cap], True
    return text, False


def capped(text: str | None, cap: int = ERROR_CAP) -> tuple[str, bool]:
    if text is None:
        return "", False
    return (text[:cap], True) if len(text) > cap else (text, False)


@dataclass(frozen=True, slots=True)
class FireTime:
    utc: datetime
    local: datetime
    mark: str | None  # "gap", "repeat" or None

    @property
    def note(self) -> str:
        if self.mark == "gap":
            return (
                "DST: clocks spring forward at this instant; a time named inside the "
                "skipped stretch fires here"
            )
        if self.mark == "repeat":
            return "DST repeat: this local time happens twice; fires once, the first time"
        return ""


def dst_mark(instant: datetime, zone: ZoneInfo) -> str | None:
    """``gap`` when ``instant`` is the first second after a spring-forward transition
    (where a nominal time in the gap fires), ``repeat`` when its local wall time is
    ambiguous, else None."""
    local = instant.astimezone(zone)
    wall = local.replace(tzinfo=None)
    first = wall.replace(tzinfo=zone, fold=0).utcoffset()
    second = wall.replace(tzinfo=zone, fold=1).utcoffset()
    if first != second and first is not None and second is not None and first > second:
        return "repeat"  # fold=0 takes the earlier (larger, DST) offset in a repeat
    before = (instant - timedelta(seconds=1)).astimezone(zone).utcoffset()
    now = local.utcoffset()
    if before is not None and now is not None and now > before:
        return "gap"  # the offset just grew: clocks sprang forward at this instant
    return None


def fire_times(instants: Iterable[datetime], zone: ZoneInfo) -> list[FireTime]:
    return [FireTime(t.astimezone(UTC), t.astimezone(zone), dst_mark(t, zone)) for t in instants]
