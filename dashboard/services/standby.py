"""Warm standby drivers: which jobs get one, starting and ending them, and the takeover itself.

A standby is a driver process whose SparkSession is started and whose pipeline has run once on a scratch input; it
blocks on the running driver's lock (workers/job_lock.py). When that driver's process dies the lock frees at once,
and the standby takes over here: in one transaction on the job's row it marks the dead run lost, records the
recovery (the failure-rate limit still counts it), takes the lease with a new fencing token and records its own run.
It never takes over a run that was asked to stop, a job with an action in flight, or a job the restart strategy gave
up on: those go the ordinary way.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta

from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.db.models import Q
from django.utils import timezone

from dashboard.models import (
    IN_FLIGHT_ACTIONS,
    Job,
    Recovery,
    RestartStrategy,
    Run,
    RunStatus,
    StandbyDriver,
    StandbyStatus,
)
from dashboard.services.audit import audit_record
from dashboard.services.lease import lease_acquire, lease_release
from dashboard.services.recovery import record_failure
from dashboard.services.runs import kill_group, pid_alive, run_finish, shares_driver, spawn_process

log = logging.getLogger(__name__)
LIVE = (StandbyStatus.WARMING, StandbyStatus.READY)
# A new standby's warm-up (a JVM, a micro-batch) takes both cores of a small machine for seconds: it waits until the
# run it stands behind has committed a batch (or has run this long without one, as an idle job does), so that it
# never slows the takeover or cold start it would follow.
SETTLE = timedelta(seconds=30)


def built_for(job: Job) -> dict[str, object]:
    """What a standby's SparkSession and imported code fix: a standby built for other values cannot take over."""
    return {
        "pipeline": job.pipeline,
        "parallelism": job.parallelism,
        "state_backend": job.state_backend,
        "spark_master": settings.SPARK_MASTER or f"local[{job.task_slots}]",
    }


def standby_refusal(job: Job) -> str:
    """Why a standby of this job must not take over now; '' when it may."""
    if not job.standby:
        return "standby is off for this job"
    if job.failed_reason:
        return "the restart strategy gave up on this job"
    if job.restart_strategy == RestartStrategy.NONE:
        return "the job's restart strategy is 'none'"
    if busy := job.actions.filter(status__in=IN_FLIGHT_ACTIONS).first():
        return f"{busy.get_kind_display().lower()} #{busy.id} is in flight"
    return ""


def standby_takeover(*, standby_id: int, lock_wait_ms: float) -> Run | None:
    """Called by a standby holding the job's lock: take over the job's dead run, or return None (with the reason in
    the standby's message) when there is nothing to take over."""
    standby = StandbyDriver.objects.select_related("job").get(id=standby_id)
    job = standby.job
    with transaction.atomic():
        job = Job.objects.select_for_update().get(id=job.id)
        dead = job.own_runs.order_by("-id").first()
        refusal = standby_refusal(job)
        if dead is None or dead.stop_requested_at:
            refusal = refusal or "the last run was asked to stop"
        elif dead.status == RunStatus.LOST:
            pending = Recovery.objects.filter(failed_run=dead).first()
            if pending is not None and (pending.gave_up or pending.restart_run_id):
                refusal = refusal or "the supervisor already handled the lost run"
        elif dead.status != RunStatus.RUNNING:
            refusal = refusal or f"the last run is {dead.get_status_display().lower()}, not running"
        if not refusal and built_for(job) != standby.built_for:
            refusal = "the job's pipeline, parallelism or backend changed since this standby started"
        if refusal:
            StandbyDriver.objects.filter(id=standby.id).update(message=f"Did not take over: {refusal}.")
            return None
        assert dead is not None
        if dead.status == RunStatus.RUNNING:
            run_finish(
                run_id=dead.id,
                status=RunStatus.LOST,
                message="The driver process died (its database session ended); the standby took over.",
            )
            dead.refresh_from_db()
        token = lease_acquire(job_id=job.id)
        if token is None:  # the dead driver's lease was not its own to free (another token): leave it to the lease
            StandbyDriver.objects.filter(id=standby.id).update(message="Did not take over: the lease is held.")
            return None
        recovery = Recovery.objects.filter(failed_run=dead).first() or record_failure(job, dead)
        if recovery.gave_up:  # the failure-rate limit stops the job: the lease this took is not needed
            lease_release(job_id=job.id, token=token)
            StandbyDriver.objects.filter(id=standby.id).update(message=f"Did not take over: {job.failed_reason}")
            return None
        now = timezone.now()
        run = Run.objects.create(
            job=job,
            status=RunStatus.STARTING,
            requested_at=now,
            fencing_token=token,
            pid=os.getpid(),
            host=settings.HOST_ID,
            spark_master=standby.built_for.get("spark_master", ""),
            log_path=standby.log_path,
            message=f"Standby #{standby.id} took over from run #{dead.id} ({lock_wait_ms:.0f} ms after its lock freed).",
        )
        Recovery.objects.filter(id=recovery.id).update(restart_run=run, restart_at=now)
        StandbyDriver.objects.filter(id=standby.id).update(status=StandbyStatus.ACTIVE, run=run, message=run.message)
        Job.objects.filter(id=job.id).exclude(failed_reason="").update(failed_reason="")
    audit_record(
        None,
        verb="restart",
        job=job.name,
        target=f"run #{run.id}",
        params={"attempt": recovery.attempt, "cause": recovery.cause[:300], "standby": standby.id},
        outcome="requested",
        origin="standby",
    )
    return run


def standby_spawn(job: Job) -> StandbyDriver:
    standby = StandbyDriver.objects.create(job=job, host=settings.HOST_ID, built_for=built_for(job))
    log_path = settings.LOG_ROOT / f"{job.name}-standby-{standby.id}.log"
    pid = spawn_process("workers.standby_process", standby.id, log_path)
    StandbyDriver.objects.filter(id=standby.id).update(pid=pid, log_path=str(log_path))
    standby.pid, standby.log_path = pid, str(log_path)
    return standby


def standby_end(standby: StandbyDriver, message: str) -> None:
    StandbyDriver.objects.filter(id=standby.id, status__in=LIVE).update(
        status=StandbyStatus.ENDED, ended_at=timezone.now(), message=message
    )


def standbys_stop() -> list[str]:
    """End every standby on this host that has not taken over (they hold no run, so there is nothing to drain)."""
    ended = []
    for standby in StandbyDriver.objects.filter(status__in=LIVE, host=settings.HOST_ID).select_related("job"):
        if standby.pid and pid_alive(standby.pid):
            kill_group(standby.pid)
        standby_end(standby, "Stopped with the console.")
        ended.append(f"standby {standby.id} of {standby.job.name} ended")
    return ended


def standbys_supervise() -> list[str]:
    """Each running job with standby on gets one standby on this host once its run has settled (SETTLE), but for a
    job in the shared driver (the spare shared driver stands behind those: dashboard/services/hosts.py); a standby
    whose process is gone is ended, and one that is no longer wanted is stopped."""
    notes: list[str] = []
    host = settings.HOST_ID
    for standby in StandbyDriver.objects.filter(status__in=LIVE, host=host).select_related("job"):
        job = standby.job
        if not pid_alive(standby.pid):
            standby_end(standby, "The standby process exited.")
            notes.append(f"standby {standby.id} gone")
        elif not job.standby or built_for(job) != standby.built_for or shares_driver(job):
            if standby.pid:
                kill_group(standby.pid)  # no run of its own: nothing to drain
            standby_end(
                standby,
                "No longer wanted (standby turned off, the job's settings changed, or it runs in the shared driver, "
                "whose spare stands behind it).",
            )
            notes.append(f"standby {standby.id} stopped")
    if connection.vendor != "postgresql":  # the driver lock is PostgreSQL's: no standby on SQLite
        return notes
    settled = Q(runs__checkpoints__isnull=False) | Q(runs__started_at__lte=timezone.now() - SETTLE)
    for job in Job.objects.filter(Q(runs__status=RunStatus.RUNNING) & settled, standby=True).distinct():
        if job.standbys.filter(status__in=LIVE).exists() or shares_driver(
            job
        ):  # the spare shared driver is its standby
            continue
        try:
            standby = standby_spawn(job)
        except (OSError, IntegrityError) as exc:
            notes.append(f"{job.name}: standby not started: {exc}")
            continue
        notes.append(f"{job.name}: standby {standby.id} starting (pid {standby.pid})")
    return notes
