"""A job's exceptions, like Flink's Exceptions tab: the root cause of each failure, how often it repeated, and the
batch a down job keeps failing on."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from dashboard.checkpoint_dir.files import PlannedBatch, planned_batch
from dashboard.failures import root_cause, signature
from dashboard.models import ACTIVE_RUN_STATUSES, Job, Run, RunStatus

FAILED = (RunStatus.FAILED, RunStatus.LOST)


@dataclass
class ExceptionGroup:
    cause: str
    count: int
    first: datetime
    last: datetime
    runs: list[int] = field(default_factory=list)
    message: str = ""  # the newest run's line (batch and entries, where known)
    trace: str = ""  # the newest run's full trace


def exception_history(job: Job, limit: int = 200) -> list[ExceptionGroup]:
    """Failures of the last ``limit`` failed runs, grouped by root cause, the most recent first."""
    groups: dict[str, ExceptionGroup] = {}
    failed = Run.objects.filter(job=job, status__in=FAILED).order_by("-id")[:limit]
    for run in failed:
        cause = root_cause(run.error or run.message) or run.message
        at = run.ended_at or run.requested_at
        group = groups.get(signature(cause))
        if group is None:
            groups[signature(cause)] = ExceptionGroup(cause, 1, at, at, [run.id], run.message, run.error)
        else:
            group.count += 1
            group.first = min(group.first, at)
            group.runs.append(run.id)
    return sorted(groups.values(), key=lambda g: g.last, reverse=True)


def failing_batch(job: Job) -> PlannedBatch | None:
    """The batch a down job would replay first, when its last run failed: what 'skip these entries' would skip."""
    last = job.own_runs.order_by("-id").first()
    if last is None or last.status in ACTIVE_RUN_STATUSES or last.status not in FAILED:
        return None
    return planned_batch(job.checkpoint_location)
