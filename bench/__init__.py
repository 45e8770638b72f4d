"""duetime benchmarks: ``duetime bench SCENARIO [--quick]`` (docs/benchmarks.md).

A package so the CLI (``scheduler/cli/bench.py``) and ``duetime worker --import
bench.tasks`` can import it from the repository checkout; the older stand-alone scripts
beside it (``insert_rate``, ``dispatch_rate``, ``worker_rate``, ``planner_rate``) still
run as scripts, and the scenarios reuse their building blocks.

Every scenario starts its own scheduler replica(s) and worker(s) as processes against
the local services, in a scratch database, etcd prefix and queue of its own, prints one
JSON line per result, appends it to ``bench/results/<scenario>.jsonl`` and plots fire lag
over time next to it.
"""
