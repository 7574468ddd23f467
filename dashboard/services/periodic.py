"""Actions the system requests on a schedule (Celery beat): periodic savepoints."""

from __future__ import annotations

from datetime import timedelta

from django.utils import timezone

from dashboard.models import ActionKind, Job, RunStatus, SavepointStatus
from dashboard.services.actions import action_request
from dashboard.services.errors import ActionRefused


def savepoints_periodic() -> list[int]:
    """Request a savepoint for every running job whose interval has passed since its last one."""
    requested = []
    now = timezone.now()
    for job in Job.objects.filter(savepoint_interval_minutes__gt=0):
        if not job.runs.filter(status=RunStatus.RUNNING).exists() or job.latest_checkpoint_id is None:
            continue
        last = job.savepoints.exclude(status=SavepointStatus.FAILED).order_by("-created_at").first()
        if last is not None and now - last.created_at < timedelta(minutes=job.savepoint_interval_minutes):
            continue
        try:
            requested.append(action_request(job=job, kind=ActionKind.SAVEPOINT, origin="periodic").id)
        except ActionRefused:
            continue  # another action is in flight: try at the next tick
    return requested
