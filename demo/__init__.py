"""``duetime demo``: the whole system on one machine, watched live.

The demo is an ordinary duetime user: it publishes jobs with ``JobStore.bulk_enqueue``
and schedules with ``ScheduleStore``, runs ``duetime scheduler`` and ``duetime worker``
as child processes, and judges the outcome only from what the handlers wrote through
``ctx.db`` (the effects table), so its "0 lost, 0 duplicates" is the guarantee of
DESIGN §1 checked end to end, not a counter the system reports about itself.

Modules:

- ``config``   — ``DemoConfig`` and the settings the children get;
- ``tasks``    — the handlers the demo's workers run (``--import demo.tasks``);
- ``store``    — the demo database: create/drop, the effects table, progress and
  summary reads (statements in ``demo.sql``, rows in ``rows``);
- ``children`` — child processes with log files, always reaped;
- ``view``     — the live view (rich on a terminal, plain lines otherwise);
- ``summary``  — the verdict (lost, duplicates, lag, failover) and its printout;
- ``runner``   — the run itself: services check, start, publish, kill the leader,
  drain, judge, stop.

The package sits beside ``scheduler/`` and ``workers/``, not inside them: the service
runs without it, and the one way in from the core is ``duetime demo``
(``scheduler/cli/demo.py``), which imports it only when that command runs. It is
installed with duetime so that ``duetime demo`` works from any install. The demo's
workers import it too (for ``tasks``), so this ``__init__`` imports nothing.
"""
