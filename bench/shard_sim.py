"""Shard assignment simulation: K shards, R replica processes, one real etcd.

Each replica is a process running only ``scheduler.leadership.elector`` (no database,
no dispatch). It prints one JSON line per change of what it believes it leads (the
full set, with ``time.time()``) and repeats it every 100 ms. The observer (this
process) samples every shard key and member key every ~100 ms, and runs the phases:

1. start ``replicas - join`` processes; wait until every shard is led, nobody leads
   more than ⌈K/R⌉ and nothing moved for ``quiet`` seconds (``converge_s`` from the
   spawn, ``converge_after_registered_s`` from the sample showing every member key);
2. start ``join`` more; time until balanced and quiet again, from the moment all the
   newcomers' member keys are visible (``rebalance_s``), and count the moves;
3. ``kill -9`` ``kill`` processes; for each shard they led, the time until a live
   process reports it gained it (``relead_s``, bound: lease TTL + 1 s);
4. stop the rest with SIGTERM (they resign), delete the prefix.

The safety check does not trust etcd (a key has one value by construction): at each
sample instant it asks which processes *believed* they led each shard, from their own
reports, and counts samples where two did (``two_believer_samples``, must be 0). The
same is checked exactly on the belief intervals (``belief_overlaps``).

Run: ``python -m bench.shard_sim`` (prints one JSON object).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from scheduler.leadership.assignment import target

SAMPLE_INTERVAL = 0.1
REPORT_INTERVAL = 0.1


@dataclass
class Params:
    shards: int = 64
    replicas: int = 16
    join: int = 4
    kill: int = 4
    ttl: float = 5.0
    poll_interval: float = 0.5
    quiet: float = 3.0
    phase_timeout: float = 90.0
    endpoint: str = "127.0.0.1:2379"
    prefix: str = ""
    log_dir: str | None = None


def shard_names(k: int) -> list[str]:
    return [f"s{i:03d}" for i in range(k)]


# -- the replica process ---------------------------------------------------------------


async def replica_main(args: argparse.Namespace) -> None:
    from scheduler.leadership.elector import Elector
    from scheduler.log import configure_logging

    configure_logging("info", "json")
    out = sys.stdout
    node = args.node
    last: list[str] | None = None

    def report(force: bool = False) -> None:
        nonlocal last
        believes = sorted(leadership.leading())
        if force or believes != last:
            last = believes
            out.write(json.dumps({"t": time.time(), "node": node, "believes": believes}) + "\n")
            out.flush()

    async def on_event(event: Any) -> None:
        report()

    leadership = Elector(
        [args.endpoint], args.prefix, node, shard_names(args.shards), ttl=args.ttl,
        poll_interval=args.poll_interval, handler=on_event,
    )  # fmt: skip
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    await leadership.start()
    try:
        while not stop.is_set():
            report(force=True)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(REPORT_INTERVAL):
                    await stop.wait()
    finally:
        await leadership.stop()
        report(force=True)


# -- the observer ----------------------------------------------------------------------


@dataclass
class Proc:
    node: str
    process: asyncio.subprocess.Process
    reports: list[tuple[float, frozenset[str]]] = field(default_factory=list)
    killed_at: float | None = None
    reader: asyncio.Task[None] | None = None


@dataclass
class Sample:
    t: float
    members: frozenset[str]
    holders: dict[str, str]


class Observer:
    def __init__(self, params: Params) -> None:
        import aetcd  # the observer's own client: it reads, never campaigns

        self.p = params
        host, _, port = params.endpoint.rpartition(":")
        self.client = aetcd.Client(host=host, port=int(port), timeout=2.0)
        self.procs: dict[str, Proc] = {}
        self.samples: list[Sample] = []
        self.shards = shard_names(params.shards)
        self._sampler: asyncio.Task[None] | None = None
        self._logs: list[TextIO] = []

    async def spawn(self, node: str) -> None:
        stderr: Any = asyncio.subprocess.DEVNULL
        if self.p.log_dir:
            log = Path(self.p.log_dir, f"{node}.log").open("w")  # noqa: ASYNC230 (once per spawn)
            self._logs.append(log)
            stderr = log
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.shard_sim", "replica", "--node", node,
            "--prefix", self.p.prefix, "--endpoint", self.p.endpoint,
            "--shards", str(self.p.shards), "--ttl", str(self.p.ttl),
            "--poll-interval", str(self.p.poll_interval),
            stdout=asyncio.subprocess.PIPE, stderr=stderr, stdin=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        proc = Proc(node, process)
        proc.reader = asyncio.create_task(self._read(proc), name=f"read-{node}")
        self.procs[node] = proc

    async def _read(self, proc: Proc) -> None:
        assert proc.process.stdout is not None
        async for line in proc.process.stdout:
            with contextlib.suppress(ValueError, KeyError):
                row = json.loads(line)
                proc.reports.append((float(row["t"]), frozenset(row["believes"])))

    async def _sample_loop(self) -> None:
        prefix = self.p.prefix
        start, end = f"{prefix}/members/".encode(), f"{prefix}/shards0".encode()
        while True:
            began = time.monotonic()
            with contextlib.suppress(Exception):
                result = await asyncio.wait_for(self.client.get_range(start, end), 2.0)
                members: set[str] = set()
                holders: dict[str, str] = {}
                for kv in result:
                    key = bytes(kv.key).decode()
                    if key.startswith(f"{prefix}/members/"):
                        members.add(key.rsplit("/", 1)[1])
                    elif key.endswith("/leader"):
                        holders[key.split("/")[-2]] = bytes(kv.value).decode()
                self.samples.append(Sample(time.time(), frozenset(members), holders))
            await asyncio.sleep(max(0.0, SAMPLE_INTERVAL - (time.monotonic() - began)))

    def live(self) -> list[str]:
        return [n for n, p in self.procs.items() if p.killed_at is None]

    def balanced(self, sample: Sample, expect: set[str]) -> bool:
        if sample.members != expect or len(sample.holders) != len(self.shards):
            return False
        if not set(sample.holders.values()) <= expect:
            return False
        counts = [list(sample.holders.values()).count(n) for n in expect]
        return max(counts) <= target(len(self.shards), len(expect))

    async def wait_stable(self, since: float, expect: set[str]) -> tuple[float, Sample]:
        """The time of the first sample of a balanced stretch lasting ``quiet`` seconds."""
        deadline = time.monotonic() + self.p.phase_timeout
        while time.monotonic() < deadline:
            await asyncio.sleep(SAMPLE_INTERVAL)
            window = [s for s in self.samples if s.t >= since]
            if not window:
                continue
            last = window[-1]
            if not self.balanced(last, expect):
                continue
            stretch_start = last
            for s in reversed(window):
                if s.holders != last.holders or s.members != last.members:
                    break
                stretch_start = s
            if last.t - stretch_start.t >= self.p.quiet:
                return stretch_start.t, last
        counts = {}
        if self.samples:
            values = list(self.samples[-1].holders.values())
            counts = {n: values.count(n) for n in expect}
        raise TimeoutError(f"not balanced and quiet within {self.p.phase_timeout}s: {counts}")

    def moves(self, since: float, until: float) -> int:
        """Times a shard got a holder other than its previous one (a first leader of a
        never-led shard is not a move)."""
        last: dict[str, str] = {}
        count = 0
        for sample in self.samples:
            if sample.t > until:
                break
            for shard, holder in sample.holders.items():
                if sample.t >= since and shard in last and last[shard] != holder:
                    count += 1
                last[shard] = holder
        return count

    def spread(self, sample: Sample) -> dict[str, Any]:
        values = list(sample.holders.values())
        counts = [values.count(n) for n in sample.members]
        return {
            "replicas": len(sample.members),
            "target": target(len(self.shards), len(sample.members)),
            "max_leaders": max(counts),
            "min_leaders": min(counts),
            "mean_leaders": round(len(self.shards) / len(sample.members), 3),
        }

    def believers_at(self, t: float) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for node, proc in self.procs.items():
            if proc.killed_at is not None and t >= proc.killed_at:
                continue
            latest: frozenset[str] = frozenset()
            for at, believes in proc.reports:
                if at > t:
                    break
                latest = believes
            for shard in latest:
                out.setdefault(shard, []).append(node)
        return out

    def belief_check(self) -> dict[str, int]:
        two = sum(
            1 for s in self.samples if any(len(v) > 1 for v in self.believers_at(s.t).values())
        )
        intervals: dict[str, list[tuple[float, float, str]]] = {}
        for node, proc in self.procs.items():
            open_at: dict[str, float] = {}
            for at, believes in proc.reports:
                for shard in believes - set(open_at):
                    open_at[shard] = at
                for shard in set(open_at) - believes:
                    intervals.setdefault(shard, []).append((open_at.pop(shard), at, node))
            end = proc.killed_at if proc.killed_at is not None else time.time()
            for shard, at in open_at.items():
                intervals.setdefault(shard, []).append((at, end, node))
        overlaps = 0
        for spans in intervals.values():
            spans.sort()
            for (_, end_a, node_a), (start_b, _, node_b) in itertools.pairwise(spans):
                if start_b < end_a and node_a != node_b:
                    overlaps += 1
        return {"two_believer_samples": two, "belief_overlaps": overlaps}

    async def run(self) -> dict[str, Any]:
        p = self.p
        first = p.replicas - p.join
        result: dict[str, Any] = {"scenario": "shard_sim", "params": asdict(p)}
        self._sampler = asyncio.create_task(self._sample_loop(), name="sampler")
        try:
            t0 = time.time()
            names = [f"r{i:02d}" for i in range(p.replicas)]
            await asyncio.gather(*(self.spawn(n) for n in names[:first]))
            stable_at, sample = await self.wait_stable(t0, set(names[:first]))
            registered = next(s.t for s in self.samples if s.members == set(names[:first]))
            result["converge_s"] = round(stable_at - t0, 3)
            result["converge_after_registered_s"] = round(stable_at - registered, 3)
            result["converge_moves"] = self.moves(t0, stable_at)
            result["after_start"] = self.spread(sample)

            t_join = time.time()
            await asyncio.gather(*(self.spawn(n) for n in names[first:]))
            everyone = set(names)
            while not any(s.t >= t_join and s.members == everyone for s in self.samples):
                if time.time() - t_join > p.phase_timeout:
                    raise TimeoutError("the joiners never registered")
                await asyncio.sleep(SAMPLE_INTERVAL)
            seen = next(s.t for s in self.samples if s.t >= t_join and s.members == everyone)
            stable_at, sample = await self.wait_stable(seen, everyone)
            result["rebalance_s"] = round(stable_at - seen, 3)
            result["rebalance_moves"] = self.moves(seen, stable_at)
            result["after_join"] = self.spread(sample)

            before = self.samples[-1]
            victims = sorted(everyone)[: p.kill]
            orphaned = {s for s, n in before.holders.items() if n in victims}
            t_kill = time.time()
            for node in victims:
                self.procs[node].process.send_signal(signal.SIGKILL)
                self.procs[node].killed_at = t_kill
            survivors = everyone - set(victims)
            stable_at, sample = await self.wait_stable(t_kill, survivors)
            relead = []
            for shard in sorted(orphaned):
                gained = [
                    at for node in survivors for at, b in self.procs[node].reports
                    if at >= t_kill and shard in b
                ]  # fmt: skip
                relead.append(min(gained) - t_kill if gained else float("inf"))
            result["killed_shards"] = len(orphaned)
            result["relead_s_max"] = round(max(relead), 3) if relead else None
            result["relead_s_mean"] = round(sum(relead) / len(relead), 3) if relead else None
            result["relead_bound_s"] = p.ttl + 1.0
            result["relead_within_bound"] = all(r <= p.ttl + 1.0 for r in relead)
            result["after_kill"] = self.spread(sample)
            result["after_kill_stable_s"] = round(stable_at - t_kill, 3)
            result["after_kill_moves"] = self.moves(t_kill, stable_at)
        finally:
            await self.shutdown()
        result.update(self.belief_check())
        result["samples"] = len(self.samples)
        return result

    async def shutdown(self) -> None:
        for proc in self.procs.values():
            if proc.process.returncode is None and proc.killed_at is None:
                proc.process.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                await asyncio.wait_for(proc.process.wait(), 10.0)
            except TimeoutError:
                proc.process.kill()
                await proc.process.wait()
            if proc.reader is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(proc.reader, 2.0)
        if self._sampler is not None:
            self._sampler.cancel()
            await asyncio.gather(self._sampler, return_exceptions=True)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.client.delete_prefix(f"{self.p.prefix}/".encode()), 2.0)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.client.close(), 2.0)
        for log in self._logs:
            log.close()


async def run_simulation(params: Params) -> dict[str, Any]:
    """Run the phases and return the figures (see the module docstring)."""
    if not params.prefix:
        params.prefix = f"duetime-sim/{uuid.uuid4().hex[:10]}"
    if params.join >= params.replicas or params.kill >= params.replicas:
        raise ValueError("need join < replicas and kill < replicas")
    return await Observer(params).run()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.shard_sim", description=__doc__)
    sub = parser.add_subparsers(dest="role")
    rep = sub.add_parser("replica", help="one lightweight replica (started by the observer)")
    rep.add_argument("--node", required=True)
    rep.add_argument("--prefix", required=True)
    rep.add_argument("--endpoint", default=Params.endpoint)
    rep.add_argument("--shards", type=int, default=Params.shards)
    rep.add_argument("--ttl", type=float, default=Params.ttl)
    rep.add_argument("--poll-interval", type=float, default=Params.poll_interval)
    for name in ("shards", "replicas", "join", "kill"):
        parser.add_argument(f"--{name}", type=int, default=getattr(Params, name))
    parser.add_argument("--ttl", type=float, default=Params.ttl)
    parser.add_argument("--poll-interval", type=float, default=Params.poll_interval)
    parser.add_argument("--quiet", type=float, default=Params.quiet)
    parser.add_argument("--endpoint", default=Params.endpoint)
    parser.add_argument("--log-dir", default=None, help="keep each replica's log here")
    args = parser.parse_args(argv)
    if args.role == "replica":
        asyncio.run(replica_main(args))
        return 0
    params = Params(
        shards=args.shards, replicas=args.replicas, join=args.join, kill=args.kill,
        ttl=args.ttl, poll_interval=args.poll_interval, quiet=args.quiet,
        endpoint=args.endpoint, log_dir=args.log_dir or tempfile.mkdtemp(prefix="shard-sim-"),
    )  # fmt: skip
    result = asyncio.run(run_simulation(params))
    result["load_average"] = os.getloadavg()
    print(json.dumps(result, indent=2))
    ok = result.get("relead_within_bound") and result["two_believer_samples"] == 0
    return 0 if ok and result["belief_overlaps"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
