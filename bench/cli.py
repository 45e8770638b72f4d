"""The runner behind ``duetime bench SCENARIO [--quick]`` (scheduler/cli/bench.py).

``all`` runs ``baseline`` first and hands it to every other scenario, so each ratio is
taken against limits measured minutes earlier on the same machine; a scenario run alone
uses the latest recorded baseline of the same size class (``quick`` or not) and names
it (``baseline_ref``). Exit status: 0 when every scenario was complete (100 % of its
jobs ran, no duplicate effect), 1 otherwise. Speed targets are reported, never enforced.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.report import DEFAULT_RESULTS_DIR, emit, latest, load_average, machine, plot_bars

SCENARIOS = ("baseline", "worker", "io", "storm", "steady", "coldstart", "recurring", "scale")
# not part of `all`: dashboard (docs/dashboard.md); shards and shardsim start many
# processes for minutes (docs/benchmarks.md "Shards")
# cronstorm waits for a cron instant (up to a minute)
ONLY_ALONE = ("dashboard", "shards", "shardsim", "cronstorm")
SELF_BASELINED = ("baseline", "shards", "shardsim")  # no ratio to a recorded baseline


def _counts(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of counts"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every count must be >= 1")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", choices=(*SCENARIOS, *ONLY_ALONE, "all"), help="what to run")
    parser.add_argument("--quick", action="store_true", help="small sizes (CI: completeness only)")
    parser.add_argument(
        "--results-dir",
        type=Path,
        default=DEFAULT_RESULTS_DIR,
        help="where <scenario>.jsonl and the plots go (default bench/results)",
    )
    parser.add_argument(
        "--server-url",
        default=None,
        help="PostgreSQL server for the scratch databases (default: the "
        "'postgres' database of --database-url's server)",
    )
    g = parser.add_argument_group("sizes (defaults: the issue's; --quick: small)")
    g.add_argument("--jobs", type=int, help="storm N / baseline jobs")
    g.add_argument("--window", type=float, help="storm W seconds")
    g.add_argument("--start-in", type=float, help="storm S seconds ahead")
    g.add_argument("--rate", type=float, help="steady R jobs/s")
    g.add_argument("--duration", type=float, help="steady / recurring D seconds")
    g.add_argument("--schedules", type=int, help="recurring, cronstorm: M schedules")
    g.add_argument("--cron", help="cronstorm: the schedules' expression (seconds first)")
    g.add_argument(
        "--sizes",
        type=lambda s: tuple(int(x) for x in s.split(",")),
        help="scale: comma-separated stored-job counts",
    )
    g.add_argument("--max-load-seconds", type=float, help="scale: skip sizes slower to load")
    g.add_argument("--concurrency", type=int, help="worker concurrency")
    g.add_argument(
        "--limit",
        action="append",
        metavar="TARGET=N|N/s",
        help="storm, baseline: set this limit first (max_running N, or a rate; repeatable)",
    )
    g.add_argument("--workers", type=int, help="storm: worker processes")
    g.add_argument(
        "--stage-ahead",
        type=float,
        help="storm, cronstorm: the scheduler's DUETIME_STAGE_AHEAD (0: staging off)",
    )
    g.add_argument(
        "--share-transaction",
        action="store_true",
        default=None,
        help="storm: the handler's task opts into transaction groups (bench.record_shared)",
    )
    g.add_argument(
        "--shards", type=_counts, help="shards: shard counts K (e.g. 1,2,4); shardsim: first = K"
    )
    g.add_argument("--rounds", type=int, help="shards: repeat the whole sequence N times")
    g.add_argument(
        "--replicas", type=_counts, help="shards: replica counts R (e.g. 2,4); shardsim: first = R"
    )


def _params(cls: Any, args: argparse.Namespace, mapping: dict[str, str]) -> Any:
    base = cls.quick() if args.quick else cls()
    changes = {
        field: getattr(args, flag)
        for flag, field in mapping.items()
        if getattr(args, flag, None) is not None and hasattr(base, field)
    }
    return type(base)(**{**vars(base), **changes})


async def _shardsim(shard_sim: Any, services: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The assignment simulation (``bench.shard_sim``) on the first etcd endpoint."""
    params = shard_sim.Params(
        endpoint=services.etcd_endpoints.split(",")[0],
        log_dir=tempfile.mkdtemp(prefix="duetime-shardsim-"),
    )
    if args.quick:
        params.shards, params.replicas, params.join, params.kill = 8, 4, 1, 1
    if args.shards:
        params.shards = args.shards[0]
    if args.replicas:
        params.replicas = args.replicas[0]
    params.join = min(params.join, params.replicas - 1)
    params.kill = min(params.kill, params.replicas - 1)
    load_start = load_average()
    result = await shard_sim.run_simulation(params)
    safe = result["two_believer_samples"] == 0 and result["belief_overlaps"] == 0
    return {
        **result,
        "scenario": "shardsim",
        "load_avg_start": load_start,
        "load_avg_end": load_average(),
        "targets": {
            "complete": bool(result.get("relead_within_bound")) and safe,
            "relead_within_bound": result.get("relead_within_bound"),
            "never_two_leaders": safe,
            "balanced_after_join": result["after_join"]["max_leaders"]
            <= result["after_join"]["target"],
        },
    }


def _decorate(result: dict[str, Any], args: argparse.Namespace, ref: str | None) -> dict[str, Any]:
    result = {
        "scenario": result["scenario"],
        "quick": args.quick,
        "machine": machine(),
        **{k: v for k, v in result.items() if k != "scenario"},
    }
    if ref is not None and result["scenario"] not in SELF_BASELINED:
        result["baseline_ref"] = ref
    return result


async def run(args: argparse.Namespace, settings: Any) -> int:
    # imported here: ``duetime --help`` and every other command build this parser
    from bench import (
        baseline,
        coldstart,
        cronstorm,
        dashboard,
        recurring,
        scale,
        shard_sim,
        shards,
        steady,
        storm,
        worker,
    )
    from bench.harness import Services
    from scheduler.log import configure_logging

    if args.log_level is None:  # stdout is for results: only warnings on stderr
        configure_logging("warning", settings.log_format)
    services = Services.from_settings(settings, args.server_url)
    out_dir: Path = args.results_dir
    chosen = SCENARIOS if args.scenario == "all" else (args.scenario,)
    suffix = "-quick" if args.quick else ""
    ok = True
    base: dict[str, Any] | None = None
    ref: str | None = None
    if "baseline" not in chosen:
        base = latest(out_dir, "baseline", quick=args.quick)
        ref = f"recorded {base['started_at']}" if base else "none recorded"

    def record(result: dict[str, Any]) -> None:
        nonlocal ok
        emit(_decorate(result, args, ref), out_dir)
        if "skipped" not in result and not result.get("targets", {}).get("complete", False):
            ok = False

    runners: dict[str, Callable[[], Any]] = {
        "storm": lambda: storm.run(
            services,
            _params(
                storm.StormParams,
                args,
                {
                    "jobs": "jobs",
                    "window": "window",
                    "start_in": "start_in",
                    "concurrency": "concurrency",
                    "workers": "workers",
                    "limit": "limits",
                    "stage_ahead": "stage_ahead",
                    "share_transaction": "share_transaction",
                },
            ),
            out_dir / f"storm{suffix}.png",
            base,
        ),
        "worker": lambda: worker.run(
            services,
            _params(worker.WorkerParams, args, {"jobs": "jobs", "concurrency": "concurrency"}),
            base,
        ),
        "io": lambda: worker.run_io(
            services,
            _params(
                worker.WorkerParams, args, {"jobs": "io_jobs", "concurrency": "io_concurrency"}
            ),
        ),
        "coldstart": lambda: coldstart.run(
            services,
            _params(
                coldstart.ColdStartParams, args, {"rate": "rate", "concurrency": "concurrency"}
            ),
            out_dir / f"coldstart{suffix}.png",
            base,
        ),
        "steady": lambda: steady.run(
            services,
            _params(
                steady.SteadyParams,
                args,
                {"rate": "rate", "duration": "duration", "concurrency": "concurrency"},
            ),
            out_dir / f"steady{suffix}.png",
            base,
        ),
        "recurring": lambda: recurring.run(
            services,
            _params(
                recurring.RecurringParams,
                args,
                {"schedules": "schedules", "duration": "duration", "concurrency": "concurrency"},
            ),
            out_dir / f"recurring{suffix}.png",
            base,
        ),
    }
    for name in chosen:
        if name == "baseline":
            base = await baseline.run(
                services,
                _params(baseline.BaselineParams, args, {"jobs": "jobs", "limit": "limits"}),
            )
            ref = f"same run {base['started_at']}"
            record(base)
            plot_bars(
                out_dir / f"baseline{suffix}.png",
                f"baseline (load {base['load_avg_start'][0]}): rates, /s",
                {
                    "claim-only rows": base["claim_only"]["rows_per_s"],
                    "publish-only msgs": base["publish_only"]["msgs_per_s"],
                    "dispatch (claim+publish+mark)": base["dispatch"]["jobs_per_s"],
                    "pipeline claim→publish→consume": base["pipeline"]["jobs_per_s"],
                },
            )
        elif name == "scale":
            params = _params(
                scale.ScaleParams, args, {"sizes": "sizes", "max_load_seconds": "max_load_seconds"}
            )
            results = await scale.run(services, params, base, record)
            done = [r for r in results if "skipped" not in r]
            if done:
                plot_bars(
                    out_dir / f"scale{suffix}.png",
                    f"scale: claim p50 (µs) and dispatch jobs/s by stored jobs (load "
                    f"{load_average()[0]})",
                    {
                        **{
                            f"claim p50 µs @ {r['stored_jobs']:,}": (
                                r["claim_latency"]["claim"]["p50_ms"] or 0
                            )
                            * 1000
                            for r in done
                        },
                        **{
                            f"dispatch jobs/s @ {r['stored_jobs']:,}": r["dispatch"]["jobs_per_s"]
                            for r in done
                        },
                    },
                )
        elif name == "worker":
            result = await runners[name]()
            record(result)
            plot_bars(
                out_dir / f"worker{suffix}.png",
                f"worker alone, jobs/s (load {result['load_avg_start'][0]})",
                {
                    "noop (no ctx.db)": result["noop"]["jobs_per_s"] or 0,
                    "insert (one ctx.db INSERT)": result["insert"]["jobs_per_s"] or 0,
                    "insert, share_transaction": result["insert_shared"]["jobs_per_s"] or 0,
                    "noop, concurrency 10": result["noop_c10"]["jobs_per_s"] or 0,
                    "noop, concurrency 64": result["noop_c64"]["jobs_per_s"] or 0,
                    "bare pipeline (baseline)": result["baseline_pipeline_jobs_per_s"] or 0,
                },
            )
        elif name == "io":
            result = await runners[name]()
            record(result)
            plot_bars(
                out_dir / f"io{suffix}.png",
                f"io: INSERT + {result['params']['await_s']} s await, concurrency "
                f"{result['params']['concurrency']} (load {result['load_avg_start'][0]})",
                {"jobs/s": result["jobs_per_s"] or 0, "ideal": result["ideal_jobs_per_s"]},
            )
        elif name == "dashboard":
            record(await dashboard.run(services, _params(dashboard.DashboardParams, args, {
                "jobs": "jobs", "rate": "rate"})))  # fmt: skip
        elif name == "shards":
            record(await shards.run(services, _params(shards.ShardsParams, args, {
                "shards": "shards", "replicas": "replicas", "jobs": "jobs",
                "rounds": "rounds"})))  # fmt: skip
        elif name == "cronstorm":
            params = _params(cronstorm.CronStormParams, args, {
                "schedules": "schedules", "cron": "cron", "concurrency": "concurrency",
                "stage_ahead": "stage_ahead"})  # fmt: skip
            record(await cronstorm.run(services, params, out_dir / f"cronstorm{suffix}.png"))
        elif name == "shardsim":
            record(await _shardsim(shard_sim, services, args))
        elif name == "recurring" and (why := recurring.available()) is not None:
            emit({"scenario": "recurring", "quick": args.quick, "skipped": why}, out_dir)
        else:
            record(await runners[name]())
    return 0 if ok else 1
