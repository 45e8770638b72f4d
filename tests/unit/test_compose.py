"""deploy/compose: no Docker engine here, so the compose file is checked statically —
it parses, references only services and files that exist, passes duetime only settings
and flags it accepts, and its Dockerfile copies only paths that exist.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from scheduler.cli import build_parser
from scheduler.config import load_settings

yaml = pytest.importorskip("yaml", reason="PyYAML is a dev dependency (pip install pyyaml)")

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_DIR = ROOT / "deploy" / "compose"
COMPOSE = COMPOSE_DIR / "docker-compose.yml"


@pytest.fixture(scope="module")
def compose() -> dict:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    return data


def _duetime_services(compose: dict) -> dict[str, dict]:
    return {n: s for n, s in compose["services"].items() if s.get("image") == "duetime:local"}


def test_services_and_images(compose: dict) -> None:
    services = compose["services"]
    assert set(services) == {
        "postgres", "rabbitmq", "etcd", "migrate",
        "scheduler-1", "scheduler-2", "worker-1", "worker-2",
    }  # fmt: skip
    assert services["postgres"]["image"] == "postgres:15"
    assert services["rabbitmq"]["image"].startswith("rabbitmq:3.13")
    assert re.fullmatch(r"quay\.io/coreos/etcd:v3\.5\.\d+", services["etcd"]["image"])


def test_dependencies_exist_and_order_startup(compose: dict) -> None:
    services = compose["services"]
    for name, service in services.items():
        for dep in service.get("depends_on", {}):
            assert dep in services, f"{name} depends on unknown service {dep}"
    assert services["migrate"]["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    for name in ("scheduler-1", "scheduler-2", "worker-1", "worker-2"):
        deps = services[name]["depends_on"]
        assert deps["migrate"] == {"condition": "service_completed_successfully"}, name
        assert deps["etcd"]["condition"] == "service_healthy"
        assert deps["rabbitmq"]["condition"] == "service_healthy"
    for name in ("postgres", "rabbitmq", "etcd"):
        assert services[name]["healthcheck"]["test"], f"{name} needs a healthcheck"


def test_duetime_environment_is_accepted(compose: dict) -> None:
    node_ids = set()
    for name, service in _duetime_services(compose).items():
        env = {k: str(v) for k, v in service["environment"].items()}
        settings = load_settings(env=env)  # unknown DUETIME_* or bad values raise
        assert settings.database_url.startswith("postgresql://duetime:")
        assert settings.metrics_port == 9464
        if name != "migrate":
            node_ids.add(env["DUETIME_NODE_ID"])
    assert len(node_ids) == 4, "every long-running process needs its own node id"


def test_commands_parse_with_the_cli(compose: dict) -> None:
    parser = build_parser()
    commands = {n: s["command"] for n, s in _duetime_services(compose).items()}
    assert parser.parse_args(commands["migrate"]).command == "migrate"
    for name in ("scheduler-1", "scheduler-2"):
        assert parser.parse_args(commands[name]).command == "scheduler"
    for name in ("worker-1", "worker-2"):
        args = parser.parse_args(commands[name])
        assert args.command == "worker" and args.imports == ["example_tasks"]
        grace = load_settings(env={}).worker_grace_period
        stop = compose["services"][name]["stop_grace_period"]
        assert float(stop.rstrip("s")) > grace


def test_build_context_and_dockerfile(compose: dict) -> None:
    build = compose["services"]["scheduler-1"]["build"]
    context = (COMPOSE_DIR / build["context"]).resolve()
    assert context == ROOT
    dockerfile = context / build["dockerfile"]
    assert dockerfile.is_file()
    for line in dockerfile.read_text().splitlines():
        parts = line.split()
        if parts[:1] == ["COPY"] and not any(p.startswith("--from") for p in parts):
            for source in parts[1:-1]:
                assert (context / source).exists(), f"Dockerfile copies missing {source}"
    ignore = dockerfile.with_name(dockerfile.name + ".dockerignore").read_text()
    assert "!scheduler/" in ignore and "!workers/" in ignore


def test_example_tasks_register() -> None:
    """The worker containers' --import module registers its tasks (fresh interpreter)."""
    code = (
        "import example_tasks; from workers import default_registry as r; print(sorted(r.names()))"
    )
    env = {**os.environ, "PYTHONPATH": f"{COMPOSE_DIR}{os.pathsep}{ROOT}"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.returncode == 0, out.stderr
    assert "example.hello" in out.stdout and "example.sleep" in out.stdout
