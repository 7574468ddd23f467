"""Reads of a job's savepoints."""

from __future__ import annotations

from dashboard.models import Job, Savepoint, SavepointStatus


def savepoint_newest_verified(job: Job) -> Savepoint | None:
    """The savepoint a restore would use: retention never disposes it, and restore drills check it."""
    return job.savepoints.filter(status=SavepointStatus.VERIFIED).order_by("-id").first()
