"""Job ids past bigint: "not found", never "PostgreSQL unavailable" (docs/security.md)."""

from __future__ import annotations

import asyncio

import pytest

from scheduler.errors import JobNotFound
from scheduler.store.jobs import JobStore
from tests.dashboard.conftest import Cluster
from tests.dashboard.test_hostile import request

pytestmark = pytest.mark.timeout(90)

TOO_BIG = 99999999999999999999  # > 2**63 - 1


async def test_an_id_past_bigint_is_not_found_in_the_store_and_the_dashboard(
    cluster: Cluster,
) -> None:
    store = JobStore(cluster.pool)
    for action in (store.get, store.cancel, store.retry, store.run_now):
        with pytest.raises(JobNotFound):
            await action(TOO_BIG)
    served = await cluster.start_dashboard()
    status, _, body = await asyncio.to_thread(request, f"{served.url}/jobs/{TOO_BIG}")
    assert status == 404, body[:300]
    assert "unavailable" not in body
