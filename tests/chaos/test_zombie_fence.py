"""A zombie leader frozen *while PostgreSQL sends it a claim* cannot hold the fence.

The scenario: jobs with 512 KiB payloads, claimed 48 at a time (24 MiB per claim result,
more than the loopback socket buffers hold). The test watches ``pg_stat_activity`` and
SIGSTOPs the leader the moment its claim runs; it then
checks the scenario really happened (the backend is still ``active``/``ClientWrite`` and
the fence row is locked) before measuring. No PostgreSQL timeout ends such a backend
(``scheduler.replica.session_settings``), so two things can:

- ``terminate``: TCP user timeout off; the new leader's fence update terminates the
  sessions that block it after ``fence_takeover_grace`` (0.5 s), and logs it;
- ``tcp_user_timeout``: 1 s, with a takeover grace longer than that (1.9 s): the kernel
  drops the zombie's connection first, and the new leader terminates nothing.

Either way, asserted from the SIGSTOP: a new leader leads (etcd key, fence and its own
log) within ``TTL + grace + LEAD_SLACK`` and has dispatched every job of the zombie's
interrupted claim under its own epoch within ``TTL + grace + DISPATCH_SLACK``. After
SIGCONT the zombie steps down at once (its dispatcher's cancelled pass ends in
"connection is closed", which must not keep the duty alive) and none of its writes
landed after the new epoch was fenced (the fence audit of ``tests/chaos/cluster.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import asyncpg
import pytest
from aio_pika.abc import AbstractChannel

from scheduler.broker import queue_name
from scheduler.replica import DUTY_STOP_TIMEOUT
from tests.chaos.cluster import Node, SchedulerCluster, parse_ts
from tests.chaos.harness import TTL
from tests.support.wait import wait_for

pytestmark = pytest.mark.chaos

START_TIMEOUT = 20.0
BATCH = 48
PAYLOAD_BYTES = 512 * 1024
LEAD_SLACK = 1.0  # etcd watch + campaign + fence update + duties start, on a loaded box
DISPATCH_SLACK = 3.0  # + claiming and publishing the 24 MiB the zombie was sent
ATTEMPTS = 5  # a SIGSTOP that lands after the last bytes left is undone and retried


async def insert_big_jobs(db: asyncpg.Connection, queue: str, due_in: float) -> list[int]:
    rows = await db.fetch(
        "INSERT INTO duetime.jobs (task, payload, queue, due_at) "
        "SELECT 'zombie.big', jsonb_build_object('n', g, 'blob', repeat('z', $1)), $2, "
        "       now() + make_interval(secs => $3) "
        "  FROM generate_series(1, $4) g RETURNING id",
        PAYLOAD_BYTES, queue, due_in, BATCH,
    )  # fmt: skip
    return [r["id"] for r in rows]


async def claiming_backend(db: asyncpg.Connection, app: str) -> int | None:
    """The pid of ``app``'s backend while it runs the dispatcher's claim, else None
    (``pg_stat_activity`` keeps the first 1 kB of a statement: the claim's comment)."""
    pid = await db.fetchval(
        "SELECT pid FROM pg_stat_activity WHERE application_name = $1 AND state = 'active' "
        "AND query LIKE '%Runs inside the dispatcher''s fenced transaction%' LIMIT 1",
        app,
    )
    return int(pid) if pid is not None else None


async def blocked_sending(db: asyncpg.Connection, pid: int) -> bool:
    state = await db.fetchrow(
        "SELECT state, wait_event FROM pg_stat_activity WHERE pid = $1", pid
    )
    return state is not None and tuple(state) == ("active", "ClientWrite")


async def fence_locked(db: asyncpg.Connection) -> bool:
    try:
        async with db.transaction():
            await db.execute(
                "SELECT 1 FROM duetime.leader_fence WHERE shard = 0 FOR UPDATE NOWAIT"
            )
    except asyncpg.LockNotAvailableError:
        return True
    return False


async def freeze_mid_claim(
    db: asyncpg.Connection, zombie: Node, queue: str
) -> tuple[float, int, list[int]]:
    """SIGSTOP ``zombie`` while PostgreSQL runs its claim (≈100 ms for 24 MiB here), so
    that the rest of the result no longer fits the socket buffers and the backend blocks.

    Returns (monotonic time of the SIGSTOP, the blocked backend's pid, the job ids of
    that claim). Fails the test if no attempt caught the claim mid-send."""
    app = f"duetime:{zombie.name}"
    for _ in range(ATTEMPTS):
        ids = await insert_big_jobs(db, queue, due_in=0.5)
        deadline = time.monotonic() + 5.0
        pid = None
        while pid is None and time.monotonic() < deadline:
            pid = await claiming_backend(db, app)
        if pid is None:
            continue
        zombie.proc.sigstop()
        stopped = time.monotonic()
        # the scenario, checked: still sending after a while, the fence row held
        await asyncio.sleep(0.3)  # observation window, not synchronisation
        if await blocked_sending(db, pid) and await fence_locked(db):
            return stopped, pid, ids
        zombie.proc.sigcont()  # caught the tail of the send: let it finish, try again
        await wait_for(
            lambda: zombie.leading_epoch() is not None, timeout=5, message="still leading"
        )
    pytest.fail(f"no SIGSTOP in {ATTEMPTS} attempts left the claim blocked in ClientWrite")


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("path", "tcp_user_timeout", "grace"),
    [("terminate", "0", 0.5), ("tcp_user_timeout", "1", 1.9)],
)
async def test_zombie_blocked_sending_a_claim_does_not_hold_the_fence(
    cluster: SchedulerCluster,
    channel: AbstractChannel,
    unique: str,
    path: str,
    tcp_user_timeout: str,
    grace: float,
) -> None:
    queue = f"zombie{unique}"
    env = {
        "DUETIME_CLAIM_BATCH_SIZE": str(BATCH),
        "DUETIME_SCHEDULER_TCP_USER_TIMEOUT": tcp_user_timeout,
        "DUETIME_FENCE_TAKEOVER_GRACE": str(grace),
    }
    first = cluster.spawn(f"{unique}-z1", **env)
    zombie, old_epoch = await cluster.wait_leader(START_TIMEOUT)
    assert zombie is first  # the only replica yet: it leads
    standby = cluster.spawn(f"{unique}-z2", **env)
    await cluster.wait_all_up(START_TIMEOUT)
    db = await asyncpg.connect(cluster.dsn, timeout=5)
    resumed = False
    try:
        stopped, pid, claim = await freeze_mid_claim(db, zombie, queue)

        new, new_epoch = await cluster.wait_leader(
            TTL + grace + LEAD_SLACK + 1, exclude=[zombie.name], message="new leader"
        )
        led = time.monotonic() - stopped
        assert new is standby and new_epoch > old_epoch

        async def claim_dispatched() -> bool:
            epochs = await db.fetch(
                "SELECT dispatch_epoch FROM duetime.jobs WHERE id = ANY($1::bigint[]) "
                "AND status = 'dispatched'",
                claim,
            )
            return len(epochs) == len(claim)

        await wait_for(claim_dispatched, timeout=TTL + grace + DISPATCH_SLACK + 2, interval=0.05)
        dispatched = time.monotonic() - stopped
        epochs = await db.fetch(
            "SELECT DISTINCT dispatch_epoch FROM duetime.jobs WHERE id = ANY($1::bigint[])",
            claim,
        )
        assert [r["dispatch_epoch"] for r in epochs] == [new_epoch]
        async def backend_gone() -> bool:
            count = await db.fetchval("SELECT count(*) FROM pg_stat_activity WHERE pid = $1", pid)
            return count == 0

        await wait_for(backend_gone, timeout=2, message="the zombie's blocked backend ended")

        terminated = new.events("fence_blockers_terminated")
        if path == "terminate":
            assert [s["pid"] for e in terminated for s in e["sessions"]] == [pid], terminated
            assert terminated[0]["sessions"][0]["application_name"] == f"duetime:{zombie.name}"
        else:
            assert terminated == []  # the kernel dropped the connection first
        print(
            f"\n[zombie] {path}: new leader leading {led:.3f}s and the zombie's claim of "
            f"{len(claim)} jobs dispatched {dispatched:.3f}s after the SIGSTOP "
            f"(TTL {TTL}, grace {grace})"
        )
        assert led <= TTL + grace + LEAD_SLACK, f"leading after {led:.3f}s"
        assert dispatched <= TTL + grace + DISPATCH_SLACK, f"dispatched after {dispatched:.3f}s"

        zombie.proc.sigcont()
        resumed = True
        resumed_at = time.time()

        def zombie_resigned() -> bool:
            return any(e["epoch"] == old_epoch for e in zombie.events("resigned"))

        # its dispatcher was frozen inside the claim whose backend is gone: the cancelled
        # pass ends in asyncpg's "connection is closed", which must not keep the duty (and
        # the term) alive until the replica's stop timeout (DUTY_STOP_TIMEOUT)
        await wait_for(
            zombie_resigned, timeout=TTL + 2, message=f"zombie resigned\n{zombie.proc.tail(30)}"
        )
        resigned = next(e for e in zombie.events("resigned") if e["epoch"] == old_epoch)
        took = parse_ts(str(resigned["timestamp"])) - resumed_at
        print(f"[zombie] {path}: zombie resigned {took:.3f}s after SIGCONT")
        assert took < DUTY_STOP_TIMEOUT / 2, took
        rows = await cluster.audit()
        fenced = next(i for i, r in enumerate(rows) if r["new_epoch"] == new_epoch)
        late = [
            dict(r)
            for r in rows[fenced:]
            if r["app"] == f"duetime:{zombie.name}" or r["new_epoch"] < new_epoch
        ]
        assert late == [], late
    finally:
        if not resumed:
            zombie.proc.sigcont()
        await db.close()
        with contextlib.suppress(Exception):
            await channel.queue_delete(queue_name(queue))
