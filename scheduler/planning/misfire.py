"""Misfire policies: what happens to fire times that were missed (DESIGN §5b).

A fire time is missed when the planner finds it already past (downtime, a leader gap,
a schedule resumed late). The policy decides which of them still run: ``skip`` (the
default) none, ``fire_once`` one catch-up run, ``fire_all`` every one up to a cap. The
rest are counted and logged by the planner, never dropped silently; this module only
decides, over a list of missed times it is given.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from datetime import datetime
from typing import NamedTuple

from scheduler.cron import ScheduleSpecError, did_you_mean

__all__ = [
    "DEFAULT_MISFIRE_CAP",
    "MAX_MISFIRE_CAP",
    "MISFIRE_POLICIES",
    "MisfirePlan",
    "misfire_plan",
    "parse_misfire_policy",
]

MISFIRE_POLICIES = ("skip", "fire_once", "fire_all")
#: How many missed fire times ``fire_all`` runs when a schedule names no cap, and the
#: largest cap a schedule may name (a long outage must not flood the workers).
DEFAULT_MISFIRE_CAP = 100
MAX_MISFIRE_CAP = 1000


class MisfirePlan(NamedTuple):
    """Which missed fire times to materialize now, and how many are dropped (to log)."""

    fire: list[datetime]
    skipped: int


def parse_misfire_policy(policy: str) -> str:
    """Normalize a policy name ('fire-once' -> 'fire_once'), or say what is accepted."""
    name = policy.strip().lower().replace("-", "_") if isinstance(policy, str) else ""
    if name not in MISFIRE_POLICIES:
        raise ScheduleSpecError(
            f"unknown misfire policy {policy!r}{did_you_mean(name, MISFIRE_POLICIES)}; "
            f"accepted: {', '.join(MISFIRE_POLICIES)}"
        )
    return name


def misfire_plan(policy: str, missed: Sequence[datetime], cap: int) -> MisfirePlan:
    """Decide what to do with fire times that were missed (downtime, or found late).

    - ``skip``: fire none; all are skipped (the schedule jumps to its next future time).
    - ``fire_once``: one catch-up run, as the LAST missed time; the rest are skipped.
    - ``fire_all``: every missed time, but at most ``cap``: the MOST RECENT ``cap`` ones,
      so a long outage cannot flood workers with stale runs and the catch-up is the
      same fire time ``fire_once`` would pick; the older ones are skipped.

    ``missed`` must be strictly increasing (as ``fire_times_between`` returns it).
    """
    name = parse_misfire_policy(policy)
    if any(later <= earlier for earlier, later in itertools.pairwise(missed)):
        raise ValueError("missed fire times must be strictly increasing")
    if name == "skip":
        return MisfirePlan([], len(missed))
    if name == "fire_once":
        return MisfirePlan(list(missed[-1:]), max(len(missed) - 1, 0))
    if cap < 1:
        raise ValueError(f"fire_all needs a cap >= 1, got {cap}")
    fire = list(missed[-cap:])
    return MisfirePlan(fire, len(missed) - len(fire))
