"""The systemd deployment files in deploy/systemd: verified by systemd itself, and
checked for the directives operators rely on (notify + watchdog, restart, env file,
hardening, a stop timeout longer than the worker grace period).

``systemd-analyze verify`` needs no running systemd (it works in a container), but it
checks that ``ExecStart``'s binary exists, so the units are verified as copies whose
``ExecStart`` points at this virtualenv's ``duetime``. The tool comes with Debian's
``systemd`` package: without it the verify tests skip with that reason locally, and fail
under CI (``CI`` set), where .ci/run is expected to install it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from scheduler.cli import build_parser
from scheduler.config import FIELDS, Settings, env_name, load_settings

ROOT = Path(__file__).resolve().parents[2]
UNITS = ROOT / "deploy" / "systemd"
SCHEDULER = UNITS / "duetime-scheduler.service"
WORKER = UNITS / "duetime-worker@.service"
DASHBOARD = UNITS / "duetime-dashboard.service"
ENV_EXAMPLE = UNITS / "duetime.env.example"
INSTALLED_BINARY = "/opt/duetime/venv/bin/duetime"
VENV_BINARY = Path(sys.executable).with_name("duetime")
HARDENING_YES = (
    "NoNewPrivileges",
    "ProtectHome",
    "PrivateTmp",
    "PrivateDevices",
    "ProtectKernelTunables",
    "ProtectKernelModules",
    "ProtectControlGroups",
    "RestrictNamespaces",
    "RestrictSUIDSGID",
    "LockPersonality",
)


def parse_unit(path: Path) -> dict[str, list[tuple[str, str]]]:
    """Sections → ordered (key, value) pairs; repeated keys kept (systemd semantics)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    pending = ""
    for raw in path.read_text().splitlines():
        line = pending + raw.strip()
        pending = ""
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
            continue
        assert current is not None, f"{path.name}: directive outside a section: {line}"
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}: not a directive: {line}"
        current.append((key.strip(), value.strip()))
    return sections


def values(unit: dict[str, list[tuple[str, str]]], section: str, key: str) -> list[str]:
    return [v for k, v in unit.get(section, []) if k == key]


def one(unit: dict[str, list[tuple[str, str]]], section: str, key: str) -> str:
    found = values(unit, section, key)
    assert len(found) == 1, f"[{section}] {key}= expected once, found {found}"
    return found[0]


_SPAN = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|s|sec|m|min|h)?")


def timespan(text: str) -> float:
    """systemd time span ('45s', '1min 30s', '90') in seconds."""
    units = {None: 1, "s": 1, "sec": 1, "ms": 0.001, "m": 60, "min": 60, "h": 3600}
    total, pos = 0.0, 0
    compact = text.strip()
    for match in _SPAN.finditer(compact):
        assert compact[pos : match.start()].strip() == "", text
        total += float(match.group(1)) * units[match.group(2)]
        pos = match.end()
    assert pos == len(compact), f"unparsed time span {text!r}"
    return total


@pytest.fixture(params=[SCHEDULER, WORKER, DASHBOARD], ids=["scheduler", "worker", "dashboard"])
def unit_path(request: pytest.FixtureRequest) -> Path:
    return request.param


def test_required_directives(unit_path: Path) -> None:
    unit = parse_unit(unit_path)
    assert one(unit, "Service", "Type") == "notify"
    assert one(unit, "Service", "NotifyAccess") == "main"
    assert timespan(one(unit, "Service", "WatchdogSec")) >= 10  # not a GC pause
    assert one(unit, "Service", "Restart") == "always"
    assert 0 < timespan(one(unit, "Service", "RestartSec")) <= 10
    assert one(unit, "Unit", "StartLimitIntervalSec") == "0"  # never give up restarting
    assert "/etc/duetime/duetime.env" in values(unit, "Service", "EnvironmentFile")
    assert one(unit, "Service", "KillSignal") == "SIGTERM"
    assert one(unit, "Service", "User") == "duetime"
    assert one(unit, "Service", "Group") == "duetime"
    assert one(unit, "Service", "ProtectSystem") == "strict"
    for key in HARDENING_YES:
        assert one(unit, "Service", key) == "yes", key
    families = one(unit, "Service", "RestrictAddressFamilies").split()
    assert set(families) == {"AF_UNIX", "AF_INET", "AF_INET6"}
    assert one(unit, "Service", "CapabilityBoundingSet") == ""
    assert one(unit, "Service", "UMask") == "0077"
    assert "@system-service" in values(unit, "Service", "SystemCallFilter")
    assert one(unit, "Install", "WantedBy") == "multi-user.target"
    assert one(unit, "Service", "ExecStart").startswith(INSTALLED_BINARY + " ")


def test_worker_stop_timeout_exceeds_grace_period() -> None:
    unit = parse_unit(WORKER)
    grace = Settings().worker_grace_period
    stop = timespan(one(unit, "Service", "TimeoutStopSec"))
    assert stop >= grace + 10, f"TimeoutStopSec {stop}s leaves no margin over grace {grace}s"


def test_scheduler_stop_timeout_allows_a_clean_resign() -> None:
    unit = parse_unit(SCHEDULER)
    stop = timespan(one(unit, "Service", "TimeoutStopSec"))
    defaults = Settings()
    assert stop > defaults.lease_ttl + defaults.etcd_timeout + defaults.db_timeout


def _argv(exec_start: str, instance: str) -> list[str]:
    expanded = (
        exec_start.replace("${WORKER_QUEUES}", instance)
        .replace("${WORKER_IMPORTS}", "myapp.tasks")
        .replace("%i", instance)
    )
    argv = expanded.split()
    assert argv[0] == INSTALLED_BINARY
    assert "$" not in expanded and "%" not in expanded, expanded
    return argv[1:]


def test_exec_start_matches_the_cli() -> None:
    """The flags in ExecStart exist: the units and `duetime --help` cannot drift."""
    parser = build_parser()
    scheduler = parser.parse_args(_argv(one(parse_unit(SCHEDULER), "Service", "ExecStart"), "x"))
    assert scheduler.command == "scheduler"
    worker_unit = parse_unit(WORKER)
    assert "WORKER_QUEUES=%i" in values(worker_unit, "Service", "Environment")
    worker = parser.parse_args(_argv(one(worker_unit, "Service", "ExecStart"), "emails"))
    assert worker.command == "worker"
    assert worker.queues == ["emails"] and worker.imports == ["myapp.tasks"]
    dashboard = parser.parse_args(_argv(one(parse_unit(DASHBOARD), "Service", "ExecStart"), "x"))
    assert dashboard.command == "dashboard" and not dashboard.read_only
    assert "/etc/duetime/worker-%i.env" in [
        p.lstrip("-") for p in values(worker_unit, "Service", "EnvironmentFile")
    ]


def test_env_example_documents_every_setting() -> None:
    text = ENV_EXAMPLE.read_text()
    assert "0600" in text
    assigned = re.findall(r"^#?\s*(DUETIME_[A-Z0-9_]+)=", text, flags=re.MULTILINE)
    missing = [env_name(f) for f in FIELDS if env_name(f) not in assigned]
    assert not missing, f"duetime.env.example lacks {missing}"
    unknown = sorted(set(assigned) - {env_name(f) for f in FIELDS} - {"DUETIME_CONFIG"})
    assert not unknown, f"duetime.env.example names variables duetime refuses: {unknown}"
    active = dict(re.findall(r"^(DUETIME_[A-Z0-9_]+)=(.*)$", text, flags=re.MULTILINE))
    settings = load_settings(env=active)  # the uncommented lines are a valid config
    assert settings.etcd_endpoints and len(settings.etcd_endpoints) == 3


# -- systemd's own tools ----------------------------------------------------------------


def _systemd_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        reason = (
            f"{name} not found: install Debian's systemd package "
            "(apt-get install -y systemd); .ci/run must do so in CI"
        )
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return path


def _verifiable_copy(src: Path, dest_dir: Path, name: str) -> Path:
    assert VENV_BINARY.exists(), f"{VENV_BINARY} missing: pip install -e . first"
    text = src.read_text().replace(INSTALLED_BINARY, str(VENV_BINARY))
    dest = dest_dir / name
    dest.write_text(text)
    return dest


@pytest.mark.parametrize(
    ("src", "name"),
    [
        (SCHEDULER, "duetime-scheduler.service"),
        (WORKER, "duetime-worker@.service"),
        (WORKER, "duetime-worker@default.service"),
        (DASHBOARD, "duetime-dashboard.service"),
    ],
)
def test_systemd_analyze_verify(tmp_path: Path, src: Path, name: str) -> None:
    tool = _systemd_tool("systemd-analyze")
    unit = _verifiable_copy(src, tmp_path, name)
    result = subprocess.run(
        [tool, "verify", "--man=no", str(unit)],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    output = (result.stdout + result.stderr).strip()
    assert result.returncode == 0, output
    # verify only warns on unknown keys and bad values; any output is a defect here
    assert output == "", output


@pytest.mark.parametrize(
    "src", [SCHEDULER, WORKER, DASHBOARD], ids=["scheduler", "worker", "dashboard"]
)
def test_systemd_analyze_security_exposure(tmp_path: Path, src: Path) -> None:
    tool = _systemd_tool("systemd-analyze")
    name = "duetime-worker@default.service" if src == WORKER else src.name
    unit = _verifiable_copy(src, tmp_path, name)
    result = subprocess.run(
        [tool, "security", "--offline=true", "--threshold=20", "--no-pager", str(unit)],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    summary = [ln for ln in result.stdout.splitlines() if "Overall exposure" in ln]
    assert result.returncode == 0, f"exposure above 2.0: {summary or result.stderr}"


def test_sysusers_snippet_is_valid() -> None:
    tool = _systemd_tool("systemd-sysusers")
    path = UNITS / "duetime.sysusers"
    result = subprocess.run(
        [tool, "--dry-run", str(path)], capture_output=True, text=True, timeout=60
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "ignoring" not in output and "Failed" not in output, output
