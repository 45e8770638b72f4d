"""A zombie leader frozen *while PostgreSQL sends it a claim* cannot hold the fence.

The claim is the planner's (``claim_due``): the dispatcher's and the reconciler's read
no payload (the job message is a pointer), so their results stay small, while the
planner reads every due schedule whole, payload included, to copy it into the jobs it
creates. The scenario: 48 schedules firing every second with 512 KiB payloads, new, so
the planner claims them all in one batch (its ``batch_size`` is 1000): a 24 MiB result,
more than the loopback socket buffers hold. The test watches ``pg_stat_activity`` and
SIGSTOPs the leader the moment that claim runs; it then checks the scenario really
happened (the backend is still ``active``/``ClientWrite`` and the fence row is locked)
before measuring. No PostgreSQL timeout ends such a backend
(``scheduler.leadership.policy.session_settings``), so two things can:

- ``terminate``: TCP user timeout off; the new leader's fence update terminates the
  sessions that block it after ``fence_takeover_grace`` (0.5 s), and logs it;
- ``tcp_user_timeout``: 1 s, with a takeover grace longer than that (1.9 s): the kernel
  drops the zombie's connection first, and the new leader terminates nothing.

Either way, asserted from the SIGSTOP: a new leader leads (etcd key, fence and its own
log) within ``TTL + grace + LEAD_SLACK``, and within ``TTL + grace + DISPATCH_SLACK`` it
has planned every schedule of the zombie's interrupted claim and dispatched a job of
each under its own epoch; every job of those schedules was created after the new epoch
was fenced (the zombie's batch committed nothing). After SIGCONT the zombie steps down
at once (its planner's cancelled pass ends in "connection is closed", which must not
keep the duty alive) and none of its writes landed after the new epoch was fenced (the
fence audit of ``tests/chaos/cluster.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import asyncpg
import pytest
from aio_pika.abc import AbstractChannel

from scheduler.leadership.duty_set import DUTY_STOP_TIMEOUT
from tests.chaos.cluster import Node, SchedulerCluster, parse_ts
from tests.chaos.harness import TTL
from tests.support.helpers import declare_queues, delete_job_queue
from tests.support.wait import wait_for

pytestmark = pytest.mark.chaos

START_TIMEOUT = 20.0
SCHEDULES = 48
PAYLOAD_BYTES = 512 * 1024
LEAD_SLACK = 1.0  # etcd watch + campaign + fence update + duties start, on a loaded box
# + claiming the 24 MiB again, planning 10 s of fire times (480 jobs), the first fire
# time (up to the 1 s interval later) and its dispatch
DISPATCH_SLACK = 3.0
ATTEMPTS = 5  # a SIGSTOP that lands after the last bytes left is undone and retried


async def insert_big_schedules(db: asyncpg.Connection, queue: str, attempt: int) -> list[int]:
    """New schedules (plan_at NULL: due for planning at once), every second."""
    rows = await db.fetch(
        "INSERT INTO duetime.schedules (name, task, payload, queue, interval) "
        "SELECT format('zombie-%s-%s', $4::int, g), 'zombie.big', "
        "       jsonb_build_object('n', g, 'blob', repeat('z', $1)), $2, interval '1 second' "
        "  FROM generate_series(1, $3) g RETURNING id",
        PAYLOAD_BYTES, queue, SCHEDULES, attempt,
    )  # fmt: skip
    return [r["id"] for r in rows]


async def drop_schedules(db: asyncpg.Connection, ids: list[int]) -> None:
    """A failed attempt's schedules and the jobs planned for them, so that the next
    attempt's claim holds only its own schedules and no dispatch competes with it."""
    async with db.transaction():
        await db.execute("DELETE FROM duetime.schedules WHERE id = ANY($1::bigint[])", ids)
        await db.execute("DELETE FROM duetime.jobs WHERE schedule_id = ANY($1::bigint[])", ids)


async def claiming_backend(db: asyncpg.Connection, app: str) -> int | None:
    """The pid of ``app``'s backend while it runs the planner's claim, else None
    (``pg_stat_activity`` keeps the first 1 kB of a statement: the claim's comment)."""
    pid = await db.fetchval(
        "SELECT pid FROM pg_stat_activity WHERE application_name = $1 AND state = 'active' "
        "AND query LIKE '%Planner, inside its fenced transaction%' LIMIT 1",
        app,
    )
    return int(pid) if pid is not None else None


async def blocked_sending(db: asyncpg.Connection, pid: int) -> bool:
    state = await db.fetchrow("SELECT state, wait_event FROM pg_stat_activity WHERE pid = $1", pid)
    return state is not None and tuple(state) == ("active", "ClientWrite")


async def fence_locked(db: asyncpg.Connection) -> bool:
    try:
        async with db.transaction():
            await db.execute("SELECT 1 FROM duetime.leader_fence WHERE shard = 0 FOR UPDATE NOWAIT")
    except asyncpg.LockNotAvailableError:
        return True
    return False


async def freeze_mid_claim(
    db: asyncpg.Connection, zombie: Node, queue: str
) -> tuple[float, int, list[int], int]:
    """SIGSTOP ``zombie`` while PostgreSQL runs its planner's claim (≈100 ms for 24 MiB
    here), so that the rest of the result no longer fits the socket buffers and the
    backend blocks.

    Returns (monotonic time of the SIGSTOP, the blocked backend's pid, the ids of the
    schedules of that claim, the attempts it took). Fails the test if no attempt caught
    the claim mid-send."""
    app = f"duetime:{zombie.name}"
    for attempt in range(ATTEMPTS):
        ids = await insert_big_schedules(db, queue, attempt)
        deadline = time.monotonic() + 5.0
        pid = None
        while pid is None and time.monotonic() < deadline:
            pid = await claiming_backend(db, app)
        if pid is not None:
            zombie.proc.sigstop()
            stopped = time.monotonic()
            # the scenario, checked: still sending after a while, the fence row held
            await asyncio.sleep(0.3)  # observation window, not synchronisation
            if await blocked_sending(db, pid) and await fence_locked(db):
                return stopped, pid, ids, attempt + 1
            zombie.proc.sigcont()  # caught the tail of the send: let it finish, try again
        await drop_schedules(db, ids)
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
        "DUETIME_SCHEDULER_TCP_USER_TIMEOUT": tcp_user_timeout,
        "DUETIME_FENCE_TAKEOVER_GRACE": str(grace),
    }
    first = cluster.spawn(f"{unique}-z1", **env)
    zombie, old_epoch = await cluster.wait_leader(START_TIMEOUT)
    assert zombie is first  # the only replica yet: it leads
    standby = cluster.spawn(f"{unique}-z2", **env)
    await cluster.wait_all_up(START_TIMEOUT)
    db = await asyncpg.connect(cluster.dsn, timeout=5)
    await declare_queues(db, queue)
    resumed = False
    try:
        stopped, pid, claim, attempts = await freeze_mid_claim(db, zombie, queue)

        new, new_epoch = await cluster.wait_leader(
            TTL + grace + LEAD_SLACK + 1, exclude=[zombie.name], message="new leader"
        )
        led = time.monotonic() - stopped
        assert new is standby and new_epoch > old_epoch

        async def claim_planned_and_dispatched() -> bool:
            dispatched = await db.fetchval(
                "SELECT count(DISTINCT schedule_id) FROM duetime.jobs "
                "WHERE schedule_id = ANY($1::bigint[]) AND status = 'dispatched'",
                claim,
            )
            return dispatched == len(claim)

        await wait_for(
            claim_planned_and_dispatched, timeout=TTL + grace + DISPATCH_SLACK + 2, interval=0.05
        )
        dispatched = time.monotonic() - stopped
        epochs = await db.fetch(
            "SELECT DISTINCT dispatch_epoch FROM duetime.jobs "
            "WHERE schedule_id = ANY($1::bigint[]) AND dispatch_epoch IS NOT NULL",
            claim,
        )
        assert [r["dispatch_epoch"] for r in epochs] == [new_epoch]
        # the interrupted batch committed nothing: every job of its schedules was created
        # by a planner transaction that began after the new epoch was fenced
        early = await db.fetchval(
            "SELECT count(*) FROM duetime.jobs j, duetime.leader_fence f "
            "WHERE j.schedule_id = ANY($1::bigint[]) AND f.shard = 0 "
            "AND j.created_at < f.elected_at",
            claim,
        )
        assert early == 0

        async def backend_gone() -> bool:
            count = await db.fetchval("SELECT count(*) FROM pg_stat_activity WHERE pid = $1", pid)
            return count == 0

        await wait_for(backend_gone, timeout=2, message="the zombie's blocked backend ended")

        terminated = new.events("fence_blockers_terminated")
        if path == "terminate":
            # The takeover may only ever end the zombie's own fenced session. It is usually
            # what frees the fence here, but one CI run in three on the loaded VM saw the
            # blocked backend end before the grace ran out, with nothing to terminate: the
            # bounds above held either way, and the termination itself is asserted by
            # tests/integration/test_fence_takeover.py.
            sessions = [s for e in terminated for s in e["sessions"]]
            assert {s["pid"] for s in sessions} <= {pid}, terminated
            assert all(s["application_name"] == f"duetime:{zombie.name}" for s in sessions)
        else:
            assert terminated == []  # the kernel dropped the connection first
        print(
            f"\n[zombie] {path}: new leader leading {led:.3f}s and the {len(claim)} "
            f"schedules of the zombie's claim planned and dispatched {dispatched:.3f}s "
            f"after the SIGSTOP (TTL {TTL}, grace {grace}, SIGSTOP attempts {attempts})"
        )
        assert led <= TTL + grace + LEAD_SLACK, f"leading after {led:.3f}s"
        assert dispatched <= TTL + grace + DISPATCH_SLACK, f"dispatched after {dispatched:.3f}s"

        zombie.proc.sigcont()
        resumed = True
        resumed_at = time.time()

        def zombie_resigned() -> bool:
            return any(e["epoch"] == old_epoch for e in zombie.events("resigned"))

        # its planner was frozen inside the claim whose backend is gone: the cancelled
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
            await delete_job_queue(channel, queue)
