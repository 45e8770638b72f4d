"""``baseline``: this machine's raw limits, measured in the same run as the scenarios.

- ``claim_only``: the dispatcher's fenced claim + mark statements, committed, no
  publishing (``bench.dispatch_rate.bench_claim_only``): rows/s, the database's ceiling;
- ``publish_only``: ``Publisher.publish`` with confirms, same batch size
  (``bench.dispatch_rate.bench_publish_only``): confirmed msgs/s, the broker's ceiling;
- ``dispatch``: the real ``Dispatcher.dispatch_batch`` (claim, publish, mark, commit) with
  nobody consuming (``bench.dispatch_rate.bench_dispatch``);
- ``pipeline``: the same dispatcher loop while a bare consumer process
  (``bench.consume_only``) acks every message with no ledger and no handler:
  jobs/s from the first claim to the last ack. The scenarios' end-to-end rates are
  compared to this.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from bench.dispatch_rate import (
    EPOCH,
    bench_claim_only,
    bench_dispatch,
    bench_publish_only,
    purge,
    reset_jobs,
)
from bench.harness import REPO, Sandbox, Services, set_limits, wait_for_line
from bench.report import load_average, now_iso, ratio
from scheduler.duties.base import LeaderTerm
from scheduler.duties.context import DutyContext
from scheduler.duties.dispatcher import Dispatcher, DispatcherConfig
from scheduler.duties.knobs import config_from_settings
from scheduler.store.fence import FenceStore
from tests.support.procs import python_module_argv


@dataclass(frozen=True)
class BaselineParams:
    jobs: int = 20_000
    batch: int = 500
    limits: tuple[str, ...] = ()  # ``--limit``: set before the dispatch and the pipeline

    @classmethod
    def quick(cls) -> BaselineParams:
        return cls(jobs=2000)


async def _pipeline(sb: Sandbox, settings: Any, n: int, batch: int) -> dict[str, Any]:
    await reset_jobs(sb.db, sb.queue, n)
    consumer = sb.procs.spawn(
        python_module_argv(
            "bench.consume_only", "--amqp-url", sb.services.amqp_url, "--queue", sb.queue,
            "--count", str(n), "--timeout", str(max(60.0, n / 200)),
        ),
        name="consume-only",
        cwd=REPO,
    )  # fmt: skip
    await wait_for_line(consumer, "ready", 60)
    # a raw limit: the broker's buffer is not bounded here (twice every job: a queue is
    # refilled only once a quarter of its buffer is free, scheduler.duties.credit)
    config = config_from_settings(
        DispatcherConfig, settings, batch_size=batch, publish_timeout=10.0, buffer=max(1, 2 * n)
    )
    dispatcher = Dispatcher(DutyContext.standalone(settings, sb.db), config=config)
    await dispatcher.setup()
    dispatcher.loop.bind(LeaderTerm(EPOCH, "bench"))
    await dispatcher.read_limits()  # what run_once does first (``--limit``)
    started = time.time()
    published = 0
    try:
        while published < n:
            report = await dispatcher.dispatch_batch()
            if report.claimed == 0:
                break
            published += report.published
        dispatched_s = time.time() - started
    finally:
        await dispatcher.teardown()
    await consumer.wait(max(60.0, n / 200))
    outcome = json.loads(consumer.output().strip().splitlines()[-1])
    end = outcome["last"] or time.time()
    return {
        "jobs": n,
        "consumed": outcome["consumed"],
        "seconds": round(end - started, 3),
        "jobs_per_s": round(outcome["consumed"] / (end - started)),
        "dispatch_part_s": round(dispatched_s, 3),
    }


async def run(services: Services, params: BaselineParams) -> dict[str, Any]:
    load_start = load_average()
    n, batch = params.jobs, params.batch
    async with Sandbox(services, "baseline") as sb:
        settings = sb.settings()
        await FenceStore(sb.db).advance(EPOCH, "bench")
        limits = await set_limits(sb.db, params.limits)
        await purge(services.amqp_url, sb.queue)
        claim = await bench_claim_only(sb.db, sb.queue, n, batch)
        load_claim = load_average()
        publish = await bench_publish_only(settings, sb.queue, n, batch)
        await purge(services.amqp_url, sb.queue)
        load_publish = load_average()
        dispatch = await bench_dispatch(settings, sb.db, sb.queue, n, batch)
        await purge(services.amqp_url, sb.queue)
        load_dispatch = load_average()
        pipeline = await _pipeline(sb, settings, n, batch)
    claim["load_avg"], publish["load_avg"] = load_claim, load_publish
    dispatch["load_avg"], pipeline["load_avg"] = load_dispatch, load_average()
    return {
        "scenario": "baseline",
        "started_at": now_iso(),
        "params": {**vars(params), "limits": limits},
        "claim_only": claim,
        "publish_only": publish,
        "dispatch": dispatch,
        "pipeline": pipeline,
        "ratio_dispatch_to_claim_only": ratio(dispatch["jobs_per_s"], claim["rows_per_s"]),
        "ratio_dispatch_to_publish_only": ratio(dispatch["jobs_per_s"], publish["msgs_per_s"]),
        "ratio_pipeline_to_dispatch": ratio(pipeline["jobs_per_s"], dispatch["jobs_per_s"]),
        "load_avg_start": load_start,
        "load_avg_end": load_average(),
        "targets": {"complete": pipeline["consumed"] == n},
    }
