"""Producers and migrations on several shards (real PostgreSQL databases).

The router (``scheduler.shards.router``): explicit shard, stable hash of the idempotency
key, round-robin; ``duetime jobs add --shard``; ``duetime migrate`` on every shard and
``--shard`` on one. Every database here is this module's own and dropped after.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta

import asyncpg
import pytest

from scheduler import db
from scheduler.config import Settings, load_settings
from scheduler.errors import InvalidInput, UniqueKeyTaken
from scheduler.jobspec import JobSpec
from scheduler.shards.router import ShardRouter, shard_for_key, shard_for_unique_key
from tests.conftest import RUN_ID, create_database, drop_database, own_database
from tests.support.cli import run_duetime as duetime

pytestmark = pytest.mark.timeout(120)

SHARDS = ("a", "b")


@pytest.fixture(scope="module")
async def shard_urls(server_dsn: str) -> AsyncIterator[dict[str, str]]:
    async with contextlib.AsyncExitStack() as stack:
        urls = {
            name: await stack.enter_async_context(own_database(server_dsn, f"prod_{name}"))
            for name in SHARDS
        }
        yield urls


@pytest.fixture(scope="module")
async def pools(shard_urls: dict[str, str]) -> AsyncIterator[dict[str, asyncpg.Pool]]:
    opened = {name: await db.create_pool(url, max_size=2) for name, url in shard_urls.items()}
    yield opened
    for pool in opened.values():
        await pool.close()


def settings_for(urls: dict[str, str]) -> Settings:
    return load_settings(
        env={}, overrides={"shards": ",".join(f"{n}={u}" for n, u in urls.items())}
    )


def shards_env(test_env: dict[str, str], urls: dict[str, str]) -> dict[str, str]:
    return {**test_env, "DUETIME_SHARDS": ",".join(f"{n}={u}" for n, u in urls.items())}


async def where(pools: dict[str, asyncpg.Pool], task: str) -> dict[str, int]:
    """Jobs of ``task`` per shard."""
    return {
        name: int(await pool.fetchval("SELECT count(*) FROM duetime.jobs WHERE task = $1", task))
        for name, pool in pools.items()
    }


async def test_router_explicit_key_and_round_robin(
    shard_urls: dict[str, str], pools: dict[str, asyncpg.Pool]
) -> None:
    tag = uuid.uuid4().hex[:8]
    # configuration order must not matter for keys: open the router with b first
    reordered = {"b": shard_urls["b"], "a": shard_urls["a"]}
    async with await ShardRouter.open(settings_for(reordered)) as router:
        assert router.names == ("b", "a")
        explicit = await router.enqueue(f"explicit-{tag}", shard="a", delay=3600)
        assert explicit.shard == "a"
        assert await where(pools, f"explicit-{tag}") == {"a": 1, "b": 0}
        assert (await router.store("a").get(explicit.job.id)).task == f"explicit-{tag}"

        keyed = {}
        for i in range(20):
            key = f"{tag}-key-{i}"
            routed = await router.enqueue(f"keyed-{tag}", idempotency_key=key, delay=3600)
            assert routed.shard == shard_for_key(key, ["a", "b"])
            again = await router.enqueue(f"keyed-{tag}", idempotency_key=key, delay=3600)
            assert again.shard == routed.shard  # same key, same shard, every time
            keyed[key] = routed.shard
        assert set(keyed.values()) == {"a", "b"}  # 20 keys do not all hash to one shard
        found = await where(pools, f"keyed-{tag}")
        assert found == {s: 2 * list(keyed.values()).count(s) for s in ("a", "b")}

        shards = [(await router.enqueue(f"rr-{tag}", delay=3600)).shard for _ in range(6)]
        assert shards in (["a", "b"] * 3, ["b", "a"] * 3)
        assert await where(pools, f"rr-{tag}") == {"a": 3, "b": 3}

        counts = await router.bulk_enqueue(
            [JobSpec(f"bulk-{tag}", idempotency_key=f"{tag}-key-{i}") for i in range(20)]
            + [JobSpec(f"bulk-{tag}") for _ in range(4)]
        )
        keyed_counts = {s: list(keyed.values()).count(s) for s in ("a", "b")}
        assert counts == {s: keyed_counts[s] + 2 for s in ("a", "b")}
        assert await where(pools, f"bulk-{tag}") == counts

        with pytest.raises(InvalidInput, match=r"unknown shard 'c' \(shards: b, a\)"):
            await router.enqueue("x", shard="c")
        async with pools["a"].acquire() as conn:
            with pytest.raises(InvalidInput, match="needs shard="):
                await router.enqueue("x", conn=conn)
            inside = await router.enqueue(f"conn-{tag}", shard="a", conn=conn, delay=3600)
        assert inside.shard == "a" and await where(pools, f"conn-{tag}") == {"a": 1, "b": 0}


async def test_router_unique_key_routes_by_queue_and_key(
    shard_urls: dict[str, str], pools: dict[str, asyncpg.Pool]
) -> None:
    """Uniqueness is enforced per database, so one (queue, unique key) must reach one
    shard on every enqueue, whatever the idempotency keys or the round-robin say."""
    tag = uuid.uuid4().hex[:8]
    async with await ShardRouter.open(settings_for(shard_urls)) as router:
        task = f"unique-{tag}"
        placed: dict[str, str] = {}
        for i in range(12):
            key = f"{tag}-doc-{i}"
            first = await router.enqueue(
                task,
                {"rev": 1},
                unique_key=key,
                delay=3600,
                priority=7,
                idempotency_key=f"{key}-event-1",
            )
            # another idempotency key, and the round-robin advanced: same shard, same job
            await router.enqueue(f"rr-{tag}", delay=3600)
            again = await router.enqueue(
                task, {"rev": 2}, unique_key=key, delay=3600, idempotency_key=f"{key}-event-2"
            )
            assert first.shard == again.shard == shard_for_unique_key("default", key, SHARDS)
            assert again.job.id == first.job.id and again.job.payload == {"rev": 1}
            assert first.job.unique_key == key and first.job.priority == 7
            placed[key] = first.shard
        assert set(placed.values()) == {"a", "b"}  # 12 keys do not all hash to one shard
        assert await where(pools, task) == {s: list(placed.values()).count(s) for s in ("a", "b")}

        key = f"{tag}-doc-0"
        replaced = await router.enqueue(
            task, {"rev": 3}, unique_key=key, on_conflict="replace", delay=7200, priority=-5
        )
        assert replaced.shard == placed[key] and replaced.job.payload == {"rev": 3}
        assert replaced.job.priority == -5
        with pytest.raises(UniqueKeyTaken) as taken:
            await router.enqueue(task, unique_key=key, on_conflict="error")
        assert taken.value.holder_id == replaced.job.id
        digest = f"{tag}-digest"
        windowed = await router.enqueue(
            f"digest-{tag}", unique_key=digest, unique_for=timedelta(hours=1), delay=3600
        )
        await router.store(windowed.shard).cancel(windowed.job.id)
        held = await router.enqueue(f"digest-{tag}", unique_key=digest, delay=3600)
        assert held.job.id == windowed.job.id and held.job.status == "cancelled"

        # the queue is part of the hash: the key space is per queue
        queues = {shard_for_unique_key(f"q{i}-{tag}", key, SHARDS) for i in range(12)}
        assert queues == {"a", "b"}
        # an explicit shard still wins
        pinned = await router.enqueue(task, unique_key=key, shard="a", delay=3600, queue="other")
        assert pinned.shard == "a"


async def test_cli_jobs_add_with_shard(
    test_env: dict[str, str], shard_urls: dict[str, str], pools: dict[str, asyncpg.Pool]
) -> None:
    tag = uuid.uuid4().hex[:8]
    env = shards_env(test_env, shard_urls)
    run = await duetime(env, "jobs", "add", f"cli-{tag}", "--in", "1h", "--shard", "b", "--json")
    assert run.code == 0, run
    job = run.json()
    assert isinstance(job, dict) and job["shard"] == "b" and job["task"] == f"cli-{tag}"
    assert await where(pools, f"cli-{tag}") == {"a": 0, "b": 1}

    run = await duetime(env, "jobs", "add", f"cli-{tag}", "--in", "1h", "--key", f"{tag}-k")
    assert run.code == 0, run
    expected = shard_for_key(f"{tag}-k", SHARDS)
    assert run.out.strip().endswith(f"in shard {expected}")

    run = await duetime(env, "jobs", "add", "x", "--shard", "nope")
    assert run.code == 2
    assert run.error_line() == "unknown shard 'nope' (shards: a, b)"

    # a unique key picks the shard of (queue, key): every add of it meets the holder
    unique = ["jobs", "add", f"uniq-{tag}", "--in", "1h", "--unique-key", f"{tag}-u"]
    held = shard_for_unique_key("default", f"{tag}-u", SHARDS)
    first = await duetime(env, *unique, "--json")
    assert first.code == 0 and first.json()["shard"] == held, first
    again = await duetime(env, *unique, "--key", f"{tag}-other")
    assert again.code == 0, again
    assert again.out.startswith(f"skipped: held by job {first.json()['id']} ")
    assert again.out.strip().endswith(f"in shard {held}")
    assert await where(pools, f"uniq-{tag}") == {s: int(s == held) for s in SHARDS}


async def test_cli_reads_and_changes_name_their_shard(
    test_env: dict[str, str], shard_urls: dict[str, str], pools: dict[str, asyncpg.Pool]
) -> None:
    """Job ids are per shard: with shards, list/show/cancel and the schedule commands
    act on the shard ``--shard`` names, and refuse to guess without it."""
    tag = uuid.uuid4().hex[:8]
    env = shards_env(test_env, shard_urls)
    run = await duetime(env, "jobs", "add", f"ops-{tag}", "--in", "1h", "--shard", "a", "--json")
    assert run.code == 0, run
    job_id = str(run.json()["id"])

    ambiguous = await duetime(env, "jobs", "show", job_id)
    assert ambiguous.code == 2
    assert ambiguous.error_line() == "this cluster has shards a, b: name one with --shard"
    unknown = await duetime(env, "jobs", "list", "--shard", "nope")
    assert unknown.code == 2 and unknown.error_line() == "unknown shard 'nope' (shards: a, b)"

    listed = await duetime(env, "jobs", "list", "--shard", "a", "--task", f"ops-{tag}", "--json")
    assert listed.code == 0, listed
    assert [j["id"] for j in listed.json()] == [int(job_id)]
    elsewhere = await duetime(env, "jobs", "list", "--shard", "b", "--task", f"ops-{tag}", "--json")
    assert elsewhere.code == 0 and elsewhere.json() == []

    cancelled = await duetime(env, "jobs", "cancel", job_id, "--shard", "a", "--json")
    assert cancelled.code == 0, cancelled
    status = await pools["a"].fetchval("SELECT status FROM duetime.jobs WHERE id = $1", int(job_id))
    assert status == "cancelled"

    added = await duetime(env, "schedules", "add", f"s-{tag}", "t", "--every", "1h", "--shard", "b")
    assert added.code == 0, added
    names = await pools["b"].fetch("SELECT name FROM duetime.schedules WHERE name = $1", f"s-{tag}")
    assert len(names) == 1
    assert (
        await pools["a"].fetchval(
            "SELECT count(*) FROM duetime.schedules WHERE name = $1", f"s-{tag}"
        )
        == 0
    )


@contextlib.asynccontextmanager
async def empty_databases(server: str, names: list[str]) -> AsyncIterator[dict[str, str]]:
    """Unmigrated databases, one per shard name, dropped after."""
    suffix = uuid.uuid4().hex[:6]
    created: dict[str, str] = {}
    try:
        for name in names:
            created[name] = await create_database(server, f"duetime_test_{RUN_ID}_m{suffix}_{name}")
        yield created
    finally:
        for name in created:
            await drop_database(server, f"duetime_test_{RUN_ID}_m{suffix}_{name}")


async def migrated(url: str) -> bool:
    conn = await asyncpg.connect(url, timeout=10)
    try:
        return await conn.fetchval("SELECT to_regclass('duetime.jobs') IS NOT NULL")
    finally:
        await conn.close()


async def test_migrate_every_shard_or_one(server_dsn: str, test_env: dict[str, str]) -> None:
    async with empty_databases(server_dsn, ["x", "y", "z"]) as urls:
        env = shards_env(test_env, urls)
        one = await duetime(env, "migrate", "--shard", "y", timeout=60)
        assert one.code == 0, one
        assert one.out.startswith("shard y: applied 0001_")
        assert [await migrated(u) for u in urls.values()] == [False, True, False]

        every = await duetime(env, "migrate", timeout=60)
        assert every.code == 0, every
        lines = every.out.strip().splitlines()
        assert [line.split(":")[0] for line in lines] == ["shard x", "shard y", "shard z"]
        assert lines[0].startswith("shard x: applied 0001_")
        assert lines[1].startswith("shard y: schema up to date at version ")
        assert lines[2].startswith("shard z: applied 0001_")
        assert all([await migrated(u) for u in urls.values()])

        unknown = await duetime(env, "migrate", "--shard", "w", timeout=30)
        assert unknown.code == 2
        assert unknown.error_line() == "--shard 'w' is not a configured shard (x, y, z)"

        broken = {**urls, "gone": urls["x"].rsplit("/", 1)[0] + "/duetime_no_such_db"}
        failed = await duetime(shards_env(test_env, broken), "migrate", timeout=60)
        assert failed.code == 1
        assert failed.error_line().startswith("shard 'gone': cannot connect to PostgreSQL")
        assert "shard x: schema up to date" in failed.out  # the shards before it still ran
