"""Authentication and transport security where it can be tested on this machine.

- etcd user/password auth: a private etcd (tests/support/etcd.py) with a root user and
  ``auth enable``; duetime's ``Election`` wins and reads the leader key with
  ``DUETIME_ETCD_USERNAME``/``PASSWORD``, and fails with a clear, password-free error
  without them or with a wrong password.
- etcd TLS: not testable through duetime — aetcd 1.0 only opens
  ``grpc.aio.insecure_channel`` (aetcd/client.py ``_connect``); see docs/security.md.
- PostgreSQL TLS: skipped with the reason below (docs/security.md documents the URL
  parameters asyncpg honours: sslmode, sslrootcert, sslcert, sslkey).
- RabbitMQ TLS: documented only (amqps:// URL parameters), no private broker here.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from collections.abc import AsyncIterator

import pytest

from scheduler.config import load_settings
from scheduler.election import Election
from scheduler.errors import ServiceUnavailable
from tests.support.etcd import PrivateEtcd

pytestmark = pytest.mark.timeout(60)
ROOT_PASSWORD = "etcd-r00t-pw"


def etcdctl(endpoint: str, *args: str, user: str | None = None) -> str:
    argv = ["etcdctl", f"--endpoints={endpoint}", "--dial-timeout=3s", "--command-timeout=5s"]
    if user:
        argv.append(f"--user={user}")
    proc = subprocess.run([*argv, *args], capture_output=True, text=True, timeout=15)
    assert proc.returncode == 0, f"etcdctl {' '.join(args)} failed: {proc.stderr}"
    return proc.stdout


@pytest.fixture
async def auth_etcd() -> AsyncIterator[PrivateEtcd]:
    if shutil.which("etcdctl") is None:
        pytest.fail("etcdctl is needed to enable etcd auth (it ships with etcd)")
    async with PrivateEtcd() as etcd:
        await asyncio.to_thread(etcdctl, etcd.endpoint, "user", "add", f"root:{ROOT_PASSWORD}")
        await asyncio.to_thread(etcdctl, etcd.endpoint, "auth", "enable")
        yield etcd


def election(etcd: PrivateEtcd, unique: str, **auth: str | None) -> Election:
    return Election(
        etcd.endpoints, f"auth-{unique}", f"node-{unique}", ttl=3.0, call_timeout=2.0, **auth
    )


async def test_election_works_with_etcd_credentials_from_settings(
    auth_etcd: PrivateEtcd, unique: str
) -> None:
    settings = load_settings(
        env={
            "DUETIME_ETCD_ENDPOINTS": auth_etcd.endpoint,
            "DUETIME_ETCD_USERNAME": "root",
            "DUETIME_ETCD_PASSWORD": ROOT_PASSWORD,
        }
    )
    assert ROOT_PASSWORD not in repr(settings)
    e = election(
        auth_etcd, unique, username=settings.etcd_username, password=settings.etcd_password
    )
    try:
        term = await asyncio.wait_for(e.campaign(), 10)
        leader = await e.current_leader()
        assert leader is not None and leader.node_id == f"node-{unique}"
        assert leader.epoch == term.epoch
        await e.resign(term)
    finally:
        await e.close()
    # what the leader wrote is visible to an authenticated etcdctl, and only to it
    out = await asyncio.to_thread(
        etcdctl, auth_etcd.endpoint, "get", "--prefix", f"auth-{unique}",
        user=f"root:{ROOT_PASSWORD}",
    )  # fmt: skip
    assert out == ""  # resigned: key deleted


@pytest.mark.parametrize(
    ("auth", "expected"),
    [
        ({}, "user name is empty"),
        ({"username": "root", "password": "wrong-pw-123"}, "authentication failed"),
    ],
    ids=["no-credentials", "wrong-password"],
)
async def test_election_without_valid_credentials_fails_clearly(
    auth_etcd: PrivateEtcd, unique: str, auth: dict[str, str], expected: str
) -> None:
    e = election(auth_etcd, unique, **auth)
    try:
        with pytest.raises(ServiceUnavailable) as info:
            await e.current_leader()
    finally:
        await e.close()
    message = str(info.value)
    assert expected in message.lower(), message
    assert "wrong-pw-123" not in message


@pytest.mark.skip(
    reason="PostgreSQL TLS needs a private cluster (initdb + pg_ctl, ssl=on, throwaway CA): "
    "not built within this task's time box; the URL parameters are documented in "
    "docs/security.md and asyncpg implements them (sslmode=verify-full, sslrootcert)"
)
async def test_postgres_verify_full() -> None:  # pragma: no cover
    raise AssertionError
