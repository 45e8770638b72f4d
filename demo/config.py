"""The demo's knobs (``DemoConfig``, validated) and the fixed settings of its children."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from demo.store import validate_database_name
from scheduler.errors import InvalidInput

#: Cron schedules the demo adds when the schedules store exists (6 fields: seconds first).
DEMO_SCHEDULES = (("every-2s", "*/2 * * * * *"), ("every-5s", "*/5 * * * * *"))

#: Settings the children get beyond the connection settings: quick to watch, not tuned.
CHILD_SETTINGS = {
    "DUETIME_LOG_FORMAT": "json",
    "DUETIME_LOG_LEVEL": "info",
    "DUETIME_VISIBILITY_TIMEOUT": "10",
    "DUETIME_RECONCILE_INTERVAL": "2",
    "DUETIME_WORKER_GRACE_PERIOD": "5",
}
MAX_RESTARTS = 3  # per child: a crashed child is restarted, as systemd's Restart=always does
RESTART_DELAY = 1.0
STOP_TIMEOUT = 10.0  # seconds children get after SIGTERM before SIGKILL
LEAD_IN = 1.0  # seconds between publishing and the first job's due time
#: Where the demo's dashboard listens; a free loopback port when this one is taken.
DASHBOARD_LISTEN = ("127.0.0.1", 8089)


@dataclass(frozen=True, slots=True)
class DemoConfig:
    duration: float = 20.0
    jobs: int = 3000
    replicas: int = 2
    workers: int = 2
    concurrency: int = 8
    database_name: str = "duetime_demo"
    lease_ttl: float = 3.0
    grace: float = 30.0
    log_dir: Path = Path(".run/demo")
    kill_leader: bool = True
    live: bool | None = None  # None: a live view when stdout is a terminal
    summary_json: Path | None = None
    startup_timeout: float = 30.0
    dashboard: bool = True  # serve `duetime dashboard` on DASHBOARD_LISTEN while it runs

    def __post_init__(self) -> None:
        if not 2 <= self.duration <= 3600:
            raise InvalidInput("--duration must be between 2 and 3600 seconds")
        if not 1 <= self.jobs <= 1_000_000:
            raise InvalidInput("--jobs must be between 1 and 1000000")
        if not 1 <= self.replicas <= 5 or not 1 <= self.workers <= 16:
            raise InvalidInput("--replicas must be 1-5 and --workers 1-16")
        if not 1 <= self.lease_ttl <= 60:
            raise InvalidInput("--lease-ttl must be between 1 and 60 seconds")
        if self.grace < 0:
            raise InvalidInput("--grace must be >= 0")
        validate_database_name(self.database_name)


def duetime_argv(*args: str) -> list[str]:
    """The ``duetime`` script beside this interpreter, else the CLI through ``-c``."""
    script = Path(sys.executable).parent / "duetime"
    if script.exists():
        return [str(script), *args]
    bootstrap = "import sys; from scheduler.cli import main; sys.exit(main())"
    return [sys.executable, "-c", bootstrap, *args]
