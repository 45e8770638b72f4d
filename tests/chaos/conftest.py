"""The scheduler-only cluster the failover tests start replicas in (``cluster``).

Every test gets its own migrated database, etcd prefix and process group; the group is
killed at teardown whatever happened (``procs`` from tests/conftest.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.chaos.cluster import SchedulerCluster
from tests.chaos.harness import TTL
from tests.support.procs import Processes


@pytest.fixture
async def cluster(
    procs: Processes, test_env: dict[str, str], migrated_dsn: str, etcd_endpoints: str, unique: str
) -> AsyncIterator[SchedulerCluster]:
    async with SchedulerCluster(
        procs,
        test_env,
        dsn=migrated_dsn,
        etcd_endpoint=etcd_endpoints.split(",")[0],
        prefix=f"duetime-test/{unique}",
        ttl=TTL,
    ) as group:
        yield group
