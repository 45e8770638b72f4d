"""Workflows: jobs that wait for other jobs (DESIGN §16; docs/api.md "Workflows" and
"Coming from Celery canvas")::

    from duetime.workflow import chain, chord, group, step

    run = await store.enqueue_workflow(chain(step("fetch"), step("parse"), step("store")))
    duetime.enqueue_workflow(conn, chord([step("resize", {"n": i}) for i in range(10)],
                                         step("zip")))

These are ``scheduler.workflow``'s objects: like the rest of ``duetime``, this module
holds no code of its own.
"""

from __future__ import annotations

from scheduler.workflow import Step, StepRef, Workflow, WorkflowJobs, chain, chord, group, step

__all__ = ["Step", "StepRef", "Workflow", "WorkflowJobs", "chain", "chord", "group", "step"]
