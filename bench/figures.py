"""Figures the benchmarks compute the same way: when a batch was committed, a job's first commit after a crash, and a
percentile of a few samples. Imported by the benchmarks after they have set Django up."""

from __future__ import annotations

from datetime import timedelta

from dashboard.models import Checkpoint, DriverHost, HostStatus, Job
from statekeeper.polling import wait_for


def committed(record: Checkpoint) -> float:
    """When the batch was committed: its trigger's time plus its duration."""
    return (record.committed_at + timedelta(milliseconds=record.duration_ms)).timestamp()


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile of a few samples, the nearest of them (the p95 of five is their maximum)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def first_commit_after(job: Job, run_id: int, timeout: float = 180) -> float:
    """When a later run of the job than ``run_id`` committed its first batch (a record's committed_at is its trigger's
    start: the commit is its duration later), in seconds since the epoch."""
    first = wait_for(
        lambda: Checkpoint.objects.filter(job=job, run_id__gt=run_id).order_by("run_id", "batch_id").first(),
        timeout, 0.05, f"{job.name}'s first batch after the crash",
    )  # fmt: skip
    return committed(first)


def warm_spare(timeout: float = 300) -> DriverHost:
    """The host's spare shared driver once it has reported its warm queries."""
    return wait_for(
        lambda: DriverHost.objects.filter(status=HostStatus.SPARE, message__contains="; warm for").first(),
        timeout, 0.2, "a spare shared driver with its warm queries",
    )  # fmt: skip
