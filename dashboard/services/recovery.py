"""Automatic recovery: a driver that died is restarted from the latest checkpoint under the job's restart strategy,
until the failure-rate limit says stop. A broken checkpoint is reported, never restarted in a loop."""

from __future__ import annotations

import re
from datetime import timedelta

from django.db import transaction
from django.utils import timezone

from dashboard.checkpoint_dir.files import committed_batches
from dashboard.models import IN_FLIGHT_ACTIONS, Checkpoint, Job, Recovery, RestartStrategy, Run, RunStatus
from dashboard.selectors.incidents import recovery_incidents
from dashboard.selectors.savepoints import savepoint_newest_verified
from dashboard.services.audit import audit_record
from dashboard.services.errors import ActionRefused
from dashboard.services.hosts import spare_ready
from dashboard.services.incidents import incidents_publish
from dashboard.services.runs import job_request_start

# What Spark says when a checkpoint's files are missing, cut short or unreadable.
BROKEN_CHECKPOINT = re.compile(
    r"FileNotFoundException|NoSuchFileException|CANNOT_LOAD_STATE_STORE|CANNOT_READ_(?:DELTA|SNAPSHOT|CHECKPOINT)|"
    r"Error reading (?:delta|snapshot) file|corrupt|EOFException|Unexpected end of|incomplete log file|"
    r"STATE_STORE_\w*(?:NOT_FOUND|CORRUPT)|does not exist|checkpoint directory is missing",
    re.IGNORECASE,
)


def restart_delay(job: Job, attempt: int) -> float:
    if job.restart_strategy == RestartStrategy.FIXED:
        return float(job.restart_delay_seconds)
    return float(min(job.restart_delay_seconds * 2 ** (attempt - 1), job.restart_max_delay_seconds))


def spare_takes_over(job: Job, run: Run) -> bool:
    """A job with standby on whose shared driver died, with a spare standing by: it restarts in the spare at once, as
    a standby of its own takes over at once (the restart delay is for a job with no standby, or a query that failed).
    The failure-rate limit still applies."""
    return job.standby and run.status == RunStatus.LOST and run.driver_host_id is not None and spare_ready()


def in_flight_batches(job: Job) -> int:
    """Batches planned (offsets written) but not committed: what a restart replays."""
    root = job.checkpoint_location
    offsets = [int(p.name) for p in (root / "offsets").glob("[0-9]*")] if (root / "offsets").is_dir() else []
    commits = committed_batches(root)
    return max(0, (max(offsets) if offsets else -1) - (commits[-1] if commits else -1))


def record_failure(job: Job, run: Run) -> Recovery:
    now = timezone.now()
    window_start = now - timedelta(minutes=job.failure_rate_window_minutes)
    earlier = job.recoveries.filter(failed_at__gte=window_start).count()
    text = f"{run.message}\n{run.error}"
    recovery = Recovery(
        job=job,
        failed_run=run,
        cause=run.message or f"The driver ended as {run.status}.",
        trace=run.error,
        failed_at=run.ended_at or now,
        attempt=earlier + 1,
        batches_replayed=in_flight_batches(job),
    )
    if match := BROKEN_CHECKPOINT.search(text):
        retained = committed_batches(job.checkpoint_location)
        savepoint = savepoint_newest_verified(job)
        offers = []
        if retained:
            offers.append(f"roll back to an earlier batch (batches {retained[0]}–{retained[-1]} are retained)")
        if savepoint is not None:
            offers.append(f"restore savepoint #{savepoint.id} (batch {savepoint.batch_id})")
        offer = " or ".join(offers) or "restore a savepoint once one exists"
        recovery.gave_up = True
        job.failed_reason = (
            f"The checkpoint is broken ({match.group(0)}): restarting would fail the same way. "
            f"Not restarting; {offer} from the job page."
        )
    elif earlier >= job.failure_rate_max:
        recovery.gave_up = True
        job.failed_reason = (
            f"{earlier + 1} failures within {job.failure_rate_window_minutes} minutes (the limit is "
            f"{job.failure_rate_max}): the job stays down. Last cause: {recovery.cause}"
        )
    else:
        delay = 0.0 if spare_takes_over(job, run) else restart_delay(job, recovery.attempt)
        recovery.restart_at = recovery.failed_at + timedelta(seconds=delay)
    with transaction.atomic():
        recovery.save()
        if recovery.gave_up:
            Job.objects.filter(id=job.id).update(failed_reason=job.failed_reason)
        incidents_publish(job.id, recovery_incidents(recovery))
    return recovery


def recoveries_supervise() -> list[str]:
    notes = []
    now = timezone.now()
    jobs = Job.objects.exclude(restart_strategy=RestartStrategy.NONE).filter(failed_reason="")
    for job in jobs:
        last = job.runs.order_by("-id").first()
        if last is None or last.status not in (RunStatus.LOST, RunStatus.FAILED) or last.stop_requested_at:
            continue
        if Recovery.objects.filter(failed_run=last).exists():
            continue
        recovery = record_failure(job, last)
        notes.append(
            f"{job.name}: run {last.id} failed, "
            + ("gave up" if recovery.gave_up else f"restart at {recovery.restart_at:%H:%M:%S}")
        )
    for recovery in Recovery.objects.filter(gave_up=False, restart_run=None, restart_at__lte=now).select_related("job"):
        job = recovery.job
        if busy := job.actions.filter(status__in=IN_FLIGHT_ACTIONS).first():
            # a restore, rollback or rescale owns the job now (and starts it itself): the restart waits for it
            notes.append(f"{job.name}: restart waits for {busy.get_kind_display().lower()} #{busy.id}")
            continue
        restart: Run | None
        try:
            restart = job_request_start(job=job)
        except ActionRefused as exc:  # the operator started it already: that run counts as the restart
            restart = job.runs.order_by("-id").first()
            notes.append(f"{job.name}: {exc}")
        Recovery.objects.filter(id=recovery.id).update(restart_run=restart)
        notes.append(f"{job.name}: restarted as run {restart and restart.id}")
        audit_record(
            None,
            verb="restart",
            job=job.name,
            target=f"run #{restart and restart.id}",
            params={"attempt": recovery.attempt, "cause": recovery.cause[:300]},
            outcome="requested",
            origin="supervisor",
        )
    for recovery in Recovery.objects.filter(recovered_at=None, restart_run__isnull=False):
        first = Checkpoint.objects.filter(run=recovery.restart_run).order_by("batch_id").first()
        if first is not None:  # a record's committed_at is its trigger's start: the batch committed its duration later
            committed = first.committed_at + timedelta(milliseconds=first.duration_ms)
            Recovery.objects.filter(id=recovery.id).update(recovered_at=committed)
    return notes
