"""The exception tree, drawn so callers know what to catch::

    DuetimeError                 base of everything duetime raises on purpose
    ├── ConfigError              bad configuration; message lists every bad value
    ├── InvalidInput             bad user input (time, payload, cron, queue name, ...)
    ├── JobNotFound              no job with that id
    ├── InvalidTransition        e.g. cancelling a job that already finished
    ├── JobFailed                JobStore.result: the job ended dead (its last error)
    ├── JobCancelled             JobStore.result: the job was cancelled (and by whom)
    ├── UniqueKeyTaken           enqueue(on_conflict="error"): a job holds the unique key
    ├── Fenced                   a newer leader fenced this epoch: stop acting now
    ├── LeadershipLost           the etcd lease can no longer be proven alive
    └── ServiceUnavailable       PostgreSQL / RabbitMQ / etcd cannot be reached

CLI commands map ``DuetimeError`` to one line on stderr and exit code 2 (bad input)
or 1 (service trouble); anything else is a bug and keeps its traceback. ``describe``
is how a log line names any exception.
"""

from __future__ import annotations


class DuetimeError(Exception):
    """Base class for errors duetime raises on purpose."""

    exit_code = 2


class ConfigError(DuetimeError):
    """Configuration is invalid; the message names every bad value and its source."""


class InvalidInput(DuetimeError):
    """User-supplied input (CLI, API) is invalid."""


class JobNotFound(DuetimeError):
    def __init__(self, job_id: int) -> None:
        super().__init__(f"job {job_id} not found")
        self.job_id = job_id


class WorkflowNotFound(JobNotFound):
    """No job carries this ``workflow_id`` (migration 0025)."""

    def __init__(self, workflow_id: int) -> None:
        DuetimeError.__init__(self, f"no workflow {workflow_id} (no job carries that workflow_id)")
        self.job_id = workflow_id


class InvalidTransition(DuetimeError):
    """A state change that the job's current status does not allow."""


class JobFailed(DuetimeError):
    """``JobStore.result``: the job ended ``dead``; ``error`` is its last error."""

    def __init__(self, job_id: int, error: str | None) -> None:
        super().__init__(f"job {job_id} failed: {error or 'no error recorded'}")
        self.job_id = job_id
        self.error = error


class JobCancelled(DuetimeError):
    """``JobStore.result``: the job was cancelled (``cancelled_by`` says by whom)."""

    def __init__(self, job_id: int, cancelled_by: str | None) -> None:
        by = f" by {cancelled_by}" if cancelled_by else ""
        super().__init__(f"job {job_id} was cancelled{by}")
        self.job_id = job_id
        self.cancelled_by = cancelled_by


class UniqueKeyTaken(DuetimeError):
    """``JobStore.enqueue(..., on_conflict="error")`` found the unique key held by
    ``holder_id``: a live job of the same queue and producer, or one whose
    ``unique_for`` window has not ended. Naming the holder leaks nothing, because keys
    are scoped by producer (docs/security.md): the holder is always the caller's own."""

    def __init__(self, queue: str, key: str, holder_id: int | None) -> None:
        held = f"job {holder_id}" if holder_id is not None else "a job no longer stored"
        super().__init__(f"unique key {key!r} of queue {queue!r} is held by {held}")
        self.queue = queue
        self.key = key
        self.holder_id = holder_id


class Fenced(DuetimeError):
    """This leader's epoch is older than the fence: a newer leader exists."""

    exit_code = 1

    def __init__(self, epoch: int, fence_epoch: int | None) -> None:
        super().__init__(f"epoch {epoch} is fenced (fence holds epoch {fence_epoch})")
        self.epoch = epoch
        self.fence_epoch = fence_epoch


class LeadershipLost(DuetimeError):
    exit_code = 1

    def __init__(self, reason: str) -> None:
        super().__init__(f"leadership lost: {reason}")
        self.reason = reason


class ServiceUnavailable(DuetimeError):
    """A service (PostgreSQL, RabbitMQ, etcd) could not be used.

    ``transient`` is False when waiting will not help (credentials refused, database or
    vhost missing, certificate not verified): long-running services retry their start
    only on transient failures (``scheduler.startup``).
    """

    exit_code = 1

    def __init__(self, message: str, *, transient: bool = True) -> None:
        super().__init__(message)
        self.transient = transient


def describe(exc: BaseException) -> str:
    """``"ExcType: message"``, or just the type when the message is empty."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
