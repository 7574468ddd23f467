"""Automatic recovery: a driver that died is restarted from the latest checkpoint under the job's restart strategy,
until the failure-rate limit says stop. A broken checkpoint is reported, never restarted in a loop."""

from __future__ import annotations

import re
from datetime import timedelta

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from dashboard.checkpoint_dir.files import committed_batches
from dashboard.models import (
    IN_FLIGHT_ACTIONS,
    ActionKind,
    Checkpoint,
    HostStatus,
    Job,
    Recovery,
    RestartStrategy,
    Run,
    RunStatus,
)
from dashboard.selectors.incidents import recovery_incidents
from dashboard.selectors.savepoints import savepoint_newest_verified
from dashboard.services.audit import audit_record
from dashboard.services.enqueue import SUPERVISE_JOBS, enqueue_at
from dashboard.services.errors import ActionRefused
from dashboard.services.hosts import host_alive, spare_ready
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


def host_crashed(run: Run) -> bool:
    """Whether the run was lost because the shared driver it ran in died (every job in it lost at once), rather than
    by anything of the job's own: its query failing, its own driver dying, its lease lapsing in a driver that lives."""
    if run.status != RunStatus.LOST or run.driver_host_id is None:
        return False
    host = run.driver_host
    return host is not None and (host.status == HostStatus.GONE or not host_alive(host))


def record_failure(job: Job, run: Run) -> Recovery:
    """The failure of ``run`` under the job's restart strategy. A crash of the shared driver the job ran in is not
    the job's own failure: it restarts at once, its back-off does not grow, and it does not count towards the next
    own failure's delay; it still counts towards the failure-rate limit (a shared driver that crashes again and again
    stops its jobs as any crash loop does)."""
    now = timezone.now()
    window_start = now - timedelta(minutes=job.failure_rate_window_minutes)
    within = job.recoveries.filter(failed_at__gte=window_start)
    earlier = within.count()
    crash = host_crashed(run)
    text = f"{run.message}\n{run.error}"
    recovery = Recovery(
        job=job,
        failed_run=run,
        cause=run.message or f"The driver ended as {run.status}.",
        trace=run.error,
        failed_at=run.ended_at or now,
        attempt=within.filter(host_crash=False).count() + 1,
        batches_replayed=in_flight_batches(job),
        host_crash=crash,
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
        delay = 0.0 if crash or spare_takes_over(job, run) else restart_delay(job, recovery.attempt)
        recovery.restart_at = recovery.failed_at + timedelta(seconds=delay)
    with transaction.atomic():
        recovery.save()
        if recovery.gave_up:
            Job.objects.filter(id=job.id).update(failed_reason=job.failed_reason)
        incidents_publish(job.id, recovery_incidents(recovery))
    return recovery


def recoveries_supervise(*, standby_only: bool = False) -> list[str]:
    """Record each job's failure under its restart strategy, and request the restarts that are due. Jobs with standby
    on first (a crash of the shared driver: the spare takes theirs over first), or only those (``standby_only``)."""
    notes = []
    now = timezone.now()
    jobs = (
        Job.objects.exclude(restart_strategy=RestartStrategy.NONE).filter(failed_reason="").order_by("-standby", "id")
    )
    if standby_only:
        jobs = jobs.filter(standby=True)
    for job in jobs:
        # a blue/green upgrade's new version is not the job's run until it takes over: the job's last run is blue
        last = job.runs.exclude(Q(green__has_key="action") & ~Q(green__has_key="handover")).order_by("-id").first()
        if last is None or last.status not in (RunStatus.LOST, RunStatus.FAILED) or last.stop_requested_at:
            continue
        if Recovery.objects.filter(failed_run=last).exists():
            continue
        recovery = record_failure(job, last)
        if recovery.restart_at is not None and recovery.restart_at > now:
            enqueue_at(SUPERVISE_JOBS, recovery.restart_at)  # restarted when due, not at the beat's next round
        notes.append(
            f"{job.name}: run {last.id} failed, "
            + ("gave up" if recovery.gave_up else f"restart at {recovery.restart_at:%H:%M:%S}")
        )
    due = Recovery.objects.filter(gave_up=False, restart_run=None, restart_at__lte=now).order_by("-job__standby", "id")
    if standby_only:
        due = due.filter(job__standby=True)
    for recovery in due.select_related("job"):
        job = recovery.job
        if busy := job.actions.filter(status__in=IN_FLIGHT_ACTIONS).exclude(kind=ActionKind.BLUE_GREEN).first():
            # a restore, rollback or rescale owns the job now (and starts it itself): the restart waits for it; a
            # blue/green runs beside the job and waits for the job's restart itself (blue_green._follow)
            notes.append(f"{job.name}: restart waits for {busy.get_kind_display().lower()} #{busy.id}")
            continue
        restart: Run | None
        try:
            restart = job_request_start(job=job)
        except ActionRefused as exc:  # the operator started it already: that run counts as the restart
            restart = job.own_runs.order_by("-id").first()
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
