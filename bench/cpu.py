"""CPU time from ``/proc``: per process, per program (all ``postgres`` backends), the machine.

A benchmark on a shared 2-core machine has to say *who* was on the CPU while it ran,
not only how fast it went: ``CpuMeter.start()`` and ``stop()`` bracket a window and
give each group's CPU in cores (CPU seconds / wall seconds) and the machine's busy
share. A process that starts inside the window counts from zero (a backend opened for
the run); one that ends inside it is not counted (its last CPU time is gone with it).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

TICK = os.sysconf("SC_CLK_TCK")
#: Programs (``/proc/<pid>/comm``) whose CPU is summed, besides the pids given.
SERVICES = {"postgres": ("postgres",), "rabbitmq": ("beam.smp",), "etcd": ("etcd",)}


def process_cpu(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` (all its threads), None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICK


def program_cpu(names: Iterable[str]) -> dict[int, float]:
    """CPU seconds of every process whose ``comm`` is one of ``names``, by pid."""
    wanted = set(names)
    out: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/comm") as f:
                if f.read().strip() not in wanted:
                    continue
        except OSError:
            continue
        cpu = process_cpu(int(entry))
        if cpu is not None:
            out[int(entry)] = cpu
    return out


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the machine since boot (``/proc/stat``)."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    total = sum(values[:8])  # guest time is already inside user
    return (total - idle) / TICK, total / TICK


@dataclass
class CpuMeter:
    """Brackets a window; ``pids`` names the processes under test (group -> pids)."""

    pids: dict[str, list[int]]
    _start: dict[str, dict[int, float]] = field(default_factory=dict)
    _machine: tuple[float, float] = (0.0, 0.0)
    _wall: float = 0.0

    def _sample(self) -> dict[str, dict[int, float]]:
        sample = {
            group: {p: c for p in pids if (c := process_cpu(p)) is not None}
            for group, pids in self.pids.items()
        }
        for group, names in SERVICES.items():
            sample[group] = program_cpu(names)
        return sample

    def start(self) -> None:
        self._start = self._sample()
        self._machine = machine_cpu()
        self._wall = time.monotonic()

    def stop(self) -> dict[str, float]:
        """Cores used per group over the window, plus ``machine_busy_cores``,
        ``machine_cores`` and ``others_cores`` (busy, but none of the groups: other
        programs on a shared machine); a measured group's busiest process as
        ``<group>_max_process_cores``."""
        end = self._sample()
        busy, total = machine_cpu()
        wall = max(time.monotonic() - self._wall, 1e-6)
        out: dict[str, float] = {}
        for group, now in end.items():
            before = self._start.get(group, {})
            deltas = [cpu - before.get(pid, 0.0) for pid, cpu in now.items()]
            out[f"{group}_cores"] = round(sum(deltas) / wall, 3)
            if group in self.pids and deltas:
                out[f"{group}_max_process_cores"] = round(max(deltas) / wall, 3)
        cores = (total - self._machine[1]) / wall
        out["machine_busy_cores"] = round((busy - self._machine[0]) / wall, 3)
        counted = sum(out[f"{g}_cores"] for g in end)
        out["others_cores"] = round(max(0.0, out["machine_busy_cores"] - counted), 3)
        out["machine_cores"] = round(cores, 2)
        return out
