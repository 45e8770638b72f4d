"""The scheduler-only cluster the failover tests start replicas in (``cluster``), and the
factory of a whole scenario's cluster (``chaos``: replicas, workers, fault proxies).

Every test gets its own migrated database, etcd prefix and process group; the group is
killed at teardown whatever happened (``procs`` from tests/conftest.py).
"""

from __future__ import annotations

import os
import random
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from tests.chaos.cluster import SchedulerCluster
from tests.chaos.harness import TTL, ChaosCluster
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


#: ``make chaos`` (``DUETIME_TEST_SOAK=1``): the soak-sized scenarios
SOAK = os.environ.get("DUETIME_TEST_SOAK") == "1"
#: printed by every scenario; ``DUETIME_TEST_SEED=<n>`` replays its fault plan
SEED = int(os.environ.get("DUETIME_TEST_SEED") or random.SystemRandom().randrange(1, 2**31))

MakeCluster = Callable[..., ChaosCluster]


@pytest.fixture
def chaos(
    tmp_path: Path,
    test_env: dict[str, str],
    migrated_dsn: str,
    amqp_url: str,
    etcd_endpoints: str,
    unique: str,
) -> MakeCluster:
    """Build the scenario's cluster (a fresh database, unique prefix and queue). ``seed``
    and ``soak`` default to the run's; a scenario without random faults fixes them."""

    def make(
        scenario: str,
        *,
        seed: int = SEED,
        soak: bool = SOAK,
        etcd_endpoint: str | None = None,
        **kw: object,
    ) -> ChaosCluster:
        print(f"\n[chaos] {scenario}: seed {seed} (replay: DUETIME_TEST_SEED={seed})")
        return ChaosCluster(
            scenario=scenario,
            seed=seed,
            soak=soak,
            tmp_path=tmp_path,
            base_env=test_env,
            dsn=migrated_dsn,
            amqp_url=amqp_url,
            etcd_endpoint=etcd_endpoint or etcd_endpoints.split(",")[0],
            prefix=f"duetime-test/{unique}",
            queue=f"chaos.{scenario}.{unique}",
            rng=random.Random(f"{seed}:{scenario}"),
            **kw,  # type: ignore[arg-type]
        )

    return make
