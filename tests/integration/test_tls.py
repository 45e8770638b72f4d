"""Authentication and transport security, tested against real servers of our own.

- PostgreSQL TLS: a private cluster (tests/support/pg.py) with ``ssl=on``, a throwaway
  CA (tests/support/tls.py) and a ``pg_hba.conf`` that accepts TCP only over TLS:
  ``scram-sha-256`` for a password user, ``cert`` (client certificate, CN = user) for
  another. duetime's ``db.connect``, ``db.create_pool`` and ``duetime migrate`` (a
  subprocess) work with ``sslmode=verify-full&sslrootcert=…`` (and ``sslcert``/
  ``sslkey``); a wrong CA, a missing client certificate or no TLS at all fail with one
  ``ServiceUnavailable`` line that never shows the password.
- etcd TLS: a private etcd with ``--cert-file/--key-file/--trusted-ca-file
  --client-cert-auth``; the elector (through ``tests.support.election``) campaigns,
  holds and resigns over TLS with ``etcd_ca_file``/``etcd_cert_file``/``etcd_key_file``,
  ``duetime status``'s reader sees the leader; a wrong CA, no client certificate or
  plain gRPC fail at once with an error saying which. TLS and user/password auth together work.
- etcd user/password auth: a private etcd with a root user and ``auth enable``; the
  election wins with credentials, fails with a clear, password-free error without.
- RabbitMQ TLS: documented only (amqps:// URL parameters), no private broker here.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from scheduler import db
from scheduler.config import load_settings
from scheduler.errors import ConfigError, LeadershipLost, ServiceUnavailable
from scheduler.leadership.etcd_client import EtcdTLS, etcd_tls
from scheduler.status import read_election_key
from tests.support.election import SingleKey
from tests.support.etcd import PrivateEtcd
from tests.support.pg import PG_BIN, PrivatePostgres
from tests.support.procs import duetime_argv
from tests.support.tls import Pki, make_pki
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(90)
ROOT_PASSWORD = "etcd-r00t-pw"
PG_PASSWORD = "pg-s3cret-pw"
CERT_USER = "duetime_cert"  # the client certificate's CN; pg_hba `cert` maps it to this role


def etcdctl(endpoint: str, *args: str, user: str | None = None, tls: Pki | None = None) -> str:
    argv = ["etcdctl", f"--endpoints={endpoint}", "--dial-timeout=3s", "--command-timeout=5s"]
    if user:
        argv.append(f"--user={user}")
    if tls is not None:
        argv += [f"--cacert={tls.ca}", f"--cert={tls.client_cert}", f"--key={tls.client_key}"]
    proc = subprocess.run([*argv, *args], capture_output=True, text=True, timeout=15)
    assert proc.returncode == 0, f"etcdctl {' '.join(args)} failed: {proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"), client_name=CERT_USER)


# -- PostgreSQL -------------------------------------------------------------------------

PG_HBA = f"""\
local     all  all                       trust
hostssl   all  {CERT_USER}  127.0.0.1/32  cert
hostssl   all  all          127.0.0.1/32  scram-sha-256
hostnossl all  all          127.0.0.1/32  reject
"""


@pytest.fixture(scope="module")
async def tls_pg(pki: Pki) -> AsyncIterator[PrivatePostgres]:
    """A private cluster with TLS on; role ``duetime_app`` (password, owns database
    ``duetime``) and role ``duetime_cert`` (client certificate only)."""
    if not (PG_BIN / "initdb").exists():
        pytest.fail(f"PostgreSQL server binaries not found in {PG_BIN} (DUETIME_TEST_PG_BIN)")
    cluster = PrivatePostgres(
        settings={
            "ssl": "on",
            "ssl_cert_file": "{dir}/server.pem",
            "ssl_key_file": "{dir}/server.key",
            "ssl_ca_file": "{dir}/ca.pem",  # verifies client certificates
            "password_encryption": "scram-sha-256",
        },
        hba=PG_HBA,
        files={"server.pem": pki.server_cert, "server.key": pki.server_key, "ca.pem": pki.ca},
    )
    try:
        await asyncio.to_thread(cluster.start)
        admin = await asyncpg.connect(cluster.admin_dsn, timeout=10)
        try:
            await admin.execute(f"CREATE ROLE duetime_app LOGIN PASSWORD '{PG_PASSWORD}'")
            await admin.execute(f"CREATE ROLE {CERT_USER} LOGIN")
            await admin.execute("CREATE DATABASE duetime OWNER duetime_app")
        finally:
            await admin.close()
        yield cluster
    finally:
        await asyncio.to_thread(cluster.stop)


def app_dsn(pg: PrivatePostgres, ca: Path, **extra: str) -> str:
    return pg.tcp_dsn(
        "duetime_app", "duetime", PG_PASSWORD, sslmode="verify-full", sslrootcert=str(ca), **extra
    )


async def _ssl_state(conn: db.Conn) -> tuple[bool, str | None]:
    row = await conn.fetchrow("SELECT ssl, client_dn FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
    assert row is not None
    return row["ssl"], row["client_dn"]


async def test_postgres_verify_full_connect_and_pool(tls_pg: PrivatePostgres, pki: Pki) -> None:
    dsn = app_dsn(tls_pg, pki.ca)
    conn = await db.connect(dsn, timeout=5)
    try:
        assert await _ssl_state(conn) == (True, None)
    finally:
        await conn.close()
    pool = await db.create_pool(dsn, min_size=2, max_size=2, timeout=5)
    try:
        async with pool.acquire() as c1, pool.acquire() as c2:
            assert (await _ssl_state(c1))[0] and (await _ssl_state(c2))[0]
    finally:
        await pool.close()


def run_migrate(dsn: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DUETIME_")}
    env.update(DUETIME_DATABASE_URL=dsn, DUETIME_LOG_FORMAT="json")
    return subprocess.run(
        duetime_argv("migrate"), env=env, capture_output=True, text=True, timeout=60
    )


async def test_postgres_migrate_over_verify_full(tls_pg: PrivatePostgres, pki: Pki) -> None:
    proc = await asyncio.to_thread(run_migrate, app_dsn(tls_pg, pki.ca))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert PG_PASSWORD not in proc.stdout + proc.stderr
    conn = await db.connect(app_dsn(tls_pg, pki.ca), timeout=5)
    try:
        assert await conn.fetchval("SELECT count(*) FROM duetime.schema_migrations") > 0
        assert await conn.fetchval("SELECT to_regclass('duetime.jobs') IS NOT NULL")
    finally:
        await conn.close()


async def test_postgres_client_certificate(tls_pg: PrivatePostgres, pki: Pki) -> None:
    dsn = tls_pg.tcp_dsn(
        CERT_USER, "postgres", sslmode="verify-full", sslrootcert=str(pki.ca),
        sslcert=str(pki.client_cert), sslkey=str(pki.client_key),
    )  # fmt: skip
    conn = await db.connect(dsn, timeout=5)
    try:
        assert await _ssl_state(conn) == (True, f"/CN={CERT_USER}")
    finally:
        await conn.close()
    pool = await db.create_pool(dsn, min_size=1, max_size=1, timeout=5)
    try:
        assert await pool.fetchval("SELECT current_user") == CERT_USER
    finally:
        await pool.close()
    # the same role without its certificate: pg_hba's `cert` method refuses it
    no_cert = tls_pg.tcp_dsn(CERT_USER, "postgres", sslmode="verify-full", sslrootcert=str(pki.ca))
    with pytest.raises(ServiceUnavailable) as info:
        await db.connect(no_cert, timeout=5)
    assert "certificate" in str(info.value).lower(), info.value


def assert_one_redacted_line(message: str, *fragments: str) -> None:
    assert "\n" not in message.strip(), message
    assert PG_PASSWORD not in message, message
    assert "duetime_app:***@127.0.0.1" in message, message
    for fragment in fragments:
        assert fragment in message, message


async def test_postgres_wrong_ca_fails_with_one_redacted_line(
    tls_pg: PrivatePostgres, pki: Pki
) -> None:
    dsn = app_dsn(tls_pg, pki.wrong_ca)
    started = time.monotonic()
    with pytest.raises(ServiceUnavailable) as connect_error:
        await db.connect(dsn, timeout=5)
    with pytest.raises(ServiceUnavailable) as pool_error:
        await db.create_pool(dsn, min_size=1, max_size=1, timeout=5)
    assert time.monotonic() - started < 10
    for info in (connect_error, pool_error):
        assert_one_redacted_line(str(info.value), "certificate verify failed")
    proc = await asyncio.to_thread(run_migrate, dsn)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    assert_one_redacted_line(proc.stderr, "certificate verify failed")


async def test_postgres_without_tls_is_refused(tls_pg: PrivatePostgres, pki: Pki) -> None:
    dsn = tls_pg.tcp_dsn("duetime_app", "duetime", PG_PASSWORD, sslmode="disable")
    with pytest.raises(ServiceUnavailable) as info:
        await db.connect(dsn, timeout=5)
    assert_one_redacted_line(str(info.value), "no encryption")


# -- etcd TLS ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
async def tls_etcd(pki: Pki) -> AsyncIterator[PrivateEtcd]:
    async with PrivateEtcd(
        cert_file=pki.server_cert, key_file=pki.server_key, trusted_ca_file=pki.ca
    ) as etcd:
        yield etcd


def tls_env(etcd: PrivateEtcd, ca: Path, pki: Pki, *, client_cert: bool = True) -> dict[str, str]:
    env = {"DUETIME_ETCD_ENDPOINTS": etcd.endpoint, "DUETIME_ETCD_CA_FILE": str(ca)}
    if client_cert:
        env |= {"DUETIME_ETCD_CERT_FILE": str(pki.client_cert)}
        env |= {"DUETIME_ETCD_KEY_FILE": str(pki.client_key)}
    return env


def tls_election(etcd: PrivateEtcd, unique: str, tls: EtcdTLS | None, **kw: str) -> SingleKey:
    return SingleKey(
        etcd.endpoints, f"tls-{unique}", f"node-{unique}", ttl=3.0, call_timeout=2.0,
        tls=tls, **kw,
    )  # fmt: skip


async def test_election_campaign_hold_resign_over_tls(
    tls_etcd: PrivateEtcd, pki: Pki, unique: str
) -> None:
    settings = load_settings(
        env={**tls_env(tls_etcd, pki.ca, pki), "DUETIME_ETCD_PREFIX": f"tls-{unique}"}
    )
    e = tls_election(tls_etcd, unique, etcd_tls(settings))
    hold: asyncio.Task[None] | None = None
    try:
        term = await asyncio.wait_for(e.campaign(), 10)
        first_window = e.term_valid_until()
        assert first_window is not None
        hold = asyncio.create_task(e.hold(term))
        # a renewal over TLS moves the trust window forward (renew every TTL/3 = 1 s)
        await wait_for(lambda: (e.term_valid_until() or 0) > first_window, timeout=5)
        view = await read_election_key(settings)  # what `duetime status` reads, over TLS
        assert (view.reachable, view.leader, view.epoch) == (True, f"node-{unique}", term.epoch)
        await e.resign(term)
        with pytest.raises(LeadershipLost):
            await asyncio.wait_for(hold, 5)
    finally:
        if hold is not None:
            hold.cancel()
        await e.close()
    view = await read_election_key(settings)
    assert view.reachable and view.leader is None  # resigned: key deleted


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("wrong-ca", "etcd's certificate was not accepted"),
        ("no-client-cert", "etcd refused this client's certificate"),
        ("plain", "Socket closed"),
    ],
)
async def test_election_tls_refusals_are_clear_and_bounded(
    tls_etcd: PrivateEtcd, pki: Pki, unique: str, case: str, expected: str
) -> None:
    tls = {
        "wrong-ca": EtcdTLS.from_files(
            str(pki.wrong_ca), str(pki.client_cert), str(pki.client_key)
        ),
        "no-client-cert": EtcdTLS.from_files(str(pki.ca)),
        "plain": None,
    }[case]
    e = tls_election(tls_etcd, unique, tls)
    started = time.monotonic()
    try:
        with pytest.raises(ServiceUnavailable) as info:
            await e.current_leader()
    finally:
        await e.close()
    assert time.monotonic() - started < 5  # fails, never hangs
    assert expected in str(info.value), info.value
    if case != "plain":  # the same reason reaches `duetime status`, as a warning
        env = tls_env(tls_etcd, pki.wrong_ca if case == "wrong-ca" else pki.ca, pki,
                      client_cert=case != "no-client-cert")  # fmt: skip
        view = await read_election_key(load_settings(env=env), timeout=2)
        assert not view.reachable and view.error is not None and expected in view.error


async def test_election_tls_with_password_auth(pki: Pki, unique: str) -> None:
    """The point of TLS for etcd auth: the password and token no longer cross in clear."""
    async with PrivateEtcd(
        cert_file=pki.server_cert, key_file=pki.server_key, trusted_ca_file=pki.ca
    ) as etcd:
        for args in (("user", "add", f"root:{ROOT_PASSWORD}"), ("auth", "enable")):
            await asyncio.to_thread(etcdctl, etcd.client_url, *args, tls=pki)
        tls = EtcdTLS.from_files(str(pki.ca), str(pki.client_cert), str(pki.client_key))
        e = tls_election(etcd, unique, tls, username="root", password=ROOT_PASSWORD)
        try:
            term = await asyncio.wait_for(e.campaign(), 10)
            leader = await e.current_leader()
            assert leader is not None and leader.epoch == term.epoch
            await e.resign(term)
        finally:
            await e.close()
        anonymous = tls_election(etcd, unique, tls)
        try:
            # without a password etcd takes the user name from the client certificate's
            # CN (duetime_cert), a user that has no role here
            with pytest.raises(ServiceUnavailable, match="permission denied"):
                await anonymous.current_leader()
        finally:
            await anonymous.close()


def test_etcd_tls_settings_errors_name_the_setting(tmp_path: Path, pki: Pki) -> None:
    missing = tmp_path / "nope.pem"
    with pytest.raises(ConfigError, match=f"etcd_ca_file {missing} cannot be read"):
        EtcdTLS.from_files(str(missing))
    with pytest.raises(ConfigError, match=r"etcd_key_file .* is not a PEM file"):
        EtcdTLS.from_files(str(pki.ca), str(pki.client_cert), str(pki.client_cert))
    with pytest.raises(ConfigError, match="set together"):
        load_settings(env={"DUETIME_ETCD_CA_FILE": str(pki.ca),
                           "DUETIME_ETCD_CERT_FILE": str(pki.client_cert)})  # fmt: skip
    with pytest.raises(ConfigError, match="need etcd_ca_file"):
        load_settings(env={"DUETIME_ETCD_CERT_FILE": str(pki.client_cert),
                           "DUETIME_ETCD_KEY_FILE": str(pki.client_key)})  # fmt: skip
    assert etcd_tls(load_settings(env={})) is None  # default: plain gRPC, as before
    tls = etcd_tls(load_settings(env={"DUETIME_ETCD_CA_FILE": str(pki.ca)}))
    assert tls is not None and tls.cert is None and "PRIVATE" not in repr(tls)


# -- etcd user/password auth ------------------------------------------------------------


@pytest.fixture
async def auth_etcd() -> AsyncIterator[PrivateEtcd]:
    if shutil.which("etcdctl") is None:
        pytest.fail("etcdctl is needed to enable etcd auth (it ships with etcd)")
    async with PrivateEtcd() as etcd:
        await asyncio.to_thread(etcdctl, etcd.endpoint, "user", "add", f"root:{ROOT_PASSWORD}")
        await asyncio.to_thread(etcdctl, etcd.endpoint, "auth", "enable")
        yield etcd


def election(etcd: PrivateEtcd, unique: str, **auth: str | None) -> SingleKey:
    return SingleKey(
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
