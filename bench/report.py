"""Results: percentiles, machine facts, one JSON line per result, and the lag plot.

Every figure carries the load average next to it (the machine is shared), and every
scenario states its ratio to a baseline measured on the same machine, ideally in the
same run: ratios survive a noisy neighbour better than absolute rates.
"""

from __future__ import annotations

import json
import math
import os
import platform
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

DEFAULT_RESULTS_DIR = Path(__file__).resolve().parent / "results"


def percentiles_ms(seconds: Sequence[float]) -> dict[str, float | None]:
    """p50/p95/p99/max (nearest-rank) of durations given in seconds, in milliseconds."""
    if not seconds:
        return {"p50_ms": None, "p95_ms": None, "p99_ms": None, "max_ms": None}
    ordered = sorted(seconds)

    def rank(q: float) -> float:
        index = max(0, math.ceil(q * len(ordered)) - 1)
        return round(ordered[index] * 1000, 2)

    return {
        "p50_ms": rank(0.50),
        "p95_ms": rank(0.95),
        "p99_ms": rank(0.99),
        "max_ms": round(ordered[-1] * 1000, 2),
    }


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def machine() -> dict[str, Any]:
    mem_gib = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem_gib = round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    return {
        "cpus": os.cpu_count(),
        "mem_gib": mem_gib,
        "python": platform.python_version(),
        "host": platform.node(),
    }


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def rss_mb(pid: int) -> float | None:
    """Resident set size of ``pid`` in MB (VmRSS), None if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def emit(result: dict[str, Any], results_dir: Path) -> None:
    """Print one JSON line and append it to ``<results_dir>/<scenario>.jsonl``."""
    line = json.dumps(result, sort_keys=False, default=str)
    print(line, flush=True)
    results_dir.mkdir(parents=True, exist_ok=True)
    with open(results_dir / f"{result['scenario']}.jsonl", "a") as f:
        f.write(line + "\n")


def latest(results_dir: Path, scenario: str, *, quick: bool) -> dict[str, Any] | None:
    """The last recorded result of ``scenario`` of the same size class, if any."""
    path = results_dir / f"{scenario}.jsonl"
    if not path.exists():
        return None
    found = None
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if bool(record.get("quick")) == quick:
            found = record
    return found


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if not numerator or not denominator:
        return None
    return round(numerator / denominator, 3)


def plot_lag(
    path: Path,
    title: str,
    points: Sequence[tuple[float, float]],
    *,
    xlabel: str = "due time since first due (s)",
) -> Path | None:
    """Scatter of fire lag (ms) over time with p50/p99 lines; None if matplotlib is absent."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    lags = [lag for _, lag in points]
    marks = percentiles_ms([lag / 1000 for lag in lags])
    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=100)
    ax.scatter([t for t, _ in points], lags, s=2, alpha=0.4, color="tab:blue", label="job")
    for key, color in (("p50_ms", "tab:green"), ("p99_ms", "tab:red")):
        value = marks[key]
        if value is not None:
            ax.axhline(value, color=color, linewidth=1.2, label=f"{key[:3]} = {value:g} ms")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fire lag: handler start − due (ms)")
    if lags and max(lags) > 0 and max(lags) / max(min(lags), 0.1) > 100:
        ax.set_yscale("symlog", linthresh=1.0)
    ax.set_ylim(bottom=min(0.0, min(lags, default=0.0)))
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_bars(path: Path, title: str, bars: dict[str, float | None]) -> Path | None:
    """Horizontal bars (rates) for results without a lag series (baseline, scale)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    items = [(k, v) for k, v in bars.items() if v is not None]
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(items) + 1.5), dpi=100)
    ax.barh([k for k, _ in items], [v for _, v in items], color="tab:blue")
    for y, (_, v) in enumerate(items):
        ax.text(v, y, f" {v:,.0f}", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_title(title, fontsize=10)
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
