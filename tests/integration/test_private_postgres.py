"""The private clusters that fault tests start (tests/support/pg.py, pgpair.py) survive
their picked port being taken before they bind it: a port is picked free when the
cluster is made and bound seconds later (after initdb, after a base backup), and the
kernel may hand it meanwhile to any client connection as its ephemeral port. CI's
switchover test once failed at setup that way ('Address already in use')."""

from __future__ import annotations

import socket

import asyncpg
import pytest

from tests.support.pg import PG_BIN, PrivatePostgres

pytestmark = pytest.mark.timeout(90)


async def test_a_start_whose_port_was_taken_meanwhile_binds_another() -> None:
    if not (PG_BIN / "initdb").exists():
        pytest.fail(f"PostgreSQL server binaries not found in {PG_BIN} (DUETIME_TEST_PG_BIN)")
    cluster = PrivatePostgres()
    picked = cluster.port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        squatter.bind(("127.0.0.1", picked))  # what a client's ephemeral port does
        squatter.listen()
        with cluster:
            assert cluster.port != picked
            conn = await asyncpg.connect(cluster.tcp_dsn("postgres"), timeout=10)
            try:
                assert await conn.fetchval("SELECT current_setting('port')::int") == cluster.port
            finally:
                await conn.close()
