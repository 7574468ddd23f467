"""Starting and stopping a job's driver: every state change of a Run goes through here."""

from __future__ import annotations

import logging
import os
from datetime import datetime, timedelta
from pathlib import Path

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser, AnonymousUser, User
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from dashboard.checkpoint_dir.files import committed_batches
from dashboard.checkpoint_dir.journal import journal_parts
from dashboard.models import (
    ACTIVE_RUN_STATUSES,
    IN_FLIGHT_ACTIONS,
    Action,
    ActionKind,
    DriverHost,
    DriverMode,
    HostStatus,
    Job,
    Run,
    RunStatus,
)
from dashboard.selectors.incidents import run_incidents
from dashboard.services.enqueue import KILL_DRIVER, START_RUN, enqueue, enqueue_on, job_actions_wake
from dashboard.services.errors import ActionRefused
from dashboard.services.hosts import host_for_launch, host_silent, shared_master_label
from dashboard.services.incidents import incidents_publish
from dashboard.services.lease import lease_acquire, lease_release
from dashboard.services.processes import kill_group, pid_alive, spawn_process
from dashboard.services.secrets import redact

__all__ = ["kill_group", "pid_alive", "spawn_process"]  # where the drivers' callers have always found them

log = logging.getLogger(__name__)


def _active_run(job: Job) -> Run | None:
    return job.runs.filter(status__in=ACTIVE_RUN_STATUSES).first()


def job_request_start(
    *, job: Job, requested_by: AbstractBaseUser | AnonymousUser | None = None, refuse_during_action: bool = False
) -> Run:
    """Record a start request and queue it for a worker; refused while the job has a run in flight, and, for a
    person's start (`refuse_during_action`), while an action is in flight: an action that starts the job itself
    (restore, rollback, rescale) calls this without it."""
    user = requested_by if isinstance(requested_by, User) else None
    try:
        with transaction.atomic():
            if Job.objects.select_for_update().get(id=job.id).archived_at is not None:
                raise ActionRefused(f"{job.name} is archived (deleted): it is kept with its state, not started.")
            busy = job.actions.filter(status__in=IN_FLIGHT_ACTIONS).first() if refuse_during_action else None
            if busy is not None:
                raise ActionRefused(
                    f"{job.name} has {busy.get_kind_display().lower()} #{busy.id} in flight: wait for it."
                )
            active = _active_run(job)
            if active is not None:
                raise ActionRefused(
                    f"{job.name} already has run #{active.id} ({active.get_status_display().lower()}, "
                    f"requested {active.requested_at:%Y-%m-%d %H:%M:%S} UTC): one driver per checkpoint."
                )
            if unknown := checkpoint_unknown(job):
                raise ActionRefused(unknown)
            run = Run.objects.create(job=job, requested_by=user)
            Job.objects.filter(id=job.id).exclude(failed_reason="").update(failed_reason="")
            enqueue(START_RUN, run.id)
    except IntegrityError:  # the partial unique index: another request got there first
        raise ActionRefused(f"{job.name} is already being started: one driver per checkpoint.") from None
    return run


def run_launch(*, run_id: int) -> Run:
    """Take the checkpoint lease for a pending run and start its driver process. Safe to call twice."""
    with transaction.atomic():
        run = Run.objects.select_for_update().select_related("job").get(id=run_id)
        if run.status != RunStatus.PENDING:
            return run  # already launched (a redelivered task) or finished
        job = run.job
        if missing := checkpoint_missing(job):
            run.status, run.ended_at, run.message = RunStatus.FAILED, timezone.now(), missing
            run.save()
            return run
        token = lease_acquire(job_id=job.id)
        if token is None:
            run.status = RunStatus.REFUSED
            run.ended_at = timezone.now()
            run.message = (
                f"Refused: the checkpoint of {job.name} is leased by another driver until "
                f"{job.lease_expires_at and job.lease_expires_at.strftime('%H:%M:%S')} UTC."
            )
            run.save()
            return run
        run.fencing_token = token
        run.status = RunStatus.STARTING
        run.host = settings.HOST_ID
        for name, value in own_driver_settings(run).items():
            setattr(run, name, value)
        if shares_driver(job):  # the shared driver takes it from here (it polls for runs assigned to it)
            _assign_shared(run)
            run.save()
            return run
        if (waiting := _claim_waiting_driver(run)) is not None:  # it polls for the run, as a shared driver does
            run.pid, run.log_path = waiting.pid, waiting.log_path
            run.save()
            log.info("run %s launched in the driver of run %s (pid %s)", run.id, waiting.id, waiting.pid)
            return run
        run.save()
    try:
        run.pid = spawn_driver(run)
    except OSError as exc:
        lease_release(job_id=job.id, token=token)
        Run.objects.filter(id=run.id).update(status=RunStatus.FAILED, error=str(exc), ended_at=timezone.now())
        raise
    Run.objects.filter(id=run.id).update(pid=run.pid)
    return run


RESTARTING_ACTIONS = (ActionKind.UPGRADE, ActionKind.UPGRADE_ROLLBACK, ActionKind.RESCALE)


def restart_expected(job_id: int, after: datetime | None = None) -> bool:
    """An action in flight stops the job and starts it again (an upgrade, its rollback, a rescale): a driver of its
    own whose run it stopped waits for the next run (``DRIVER_REUSE_SECONDS``) rather than ending. ``after``: only an
    action requested after then (a run's request: not the action that started the run, which stays in flight until
    its first batch)."""
    if settings.DRIVER_REUSE_SECONDS <= 0 or settings.SPARK_MASTER:
        return False
    actions = Action.objects.filter(job_id=job_id, kind__in=RESTARTING_ACTIONS, status__in=IN_FLIGHT_ACTIONS)
    return actions.filter(requested_at__gt=after).exists() if after is not None else actions.exists()


def _claim_waiting_driver(run: Run) -> Run | None:
    """The job's previous run, whose driver of its own waits for this one (``reusable_until``) on this host, with the
    same Spark master (``local[parallelism]``: a rescale of the parallelism needs a new JVM); claimed (no other launch
    may take it, and the driver no longer ends at its deadline). None: a new driver. Inside the launch's transaction,
    so that the driver, which polls for a run with its pid, sees the claim and the run together."""
    waiting = (
        Run.objects.select_for_update()
        .filter(job_id=run.job_id, host=settings.HOST_ID, reusable_until__gt=timezone.now(), driver_host=None)
        .order_by("-id")
        .first()
    )
    if waiting is None or waiting.spark_master != run.spark_master or not pid_alive(waiting.pid):
        return None
    Run.objects.filter(id=waiting.id).update(reusable_until=None)
    return waiting


def own_driver_settings(run: Run) -> dict[str, str]:
    """Where a run's driver of its own writes its log, and the Spark master it runs on."""
    return {
        "log_path": str(settings.LOG_ROOT / f"{run.job.name}-run-{run.id}.log"),
        "spark_master": settings.SPARK_MASTER or f"local[{run.job.task_slots}]",
    }


def shares_driver(job: Job) -> bool:
    """The job's query runs in the host's shared driver: it asks for one. On a cluster the shared driver is one
    application whose executors its jobs share (``shared_master``); a job with a driver of its own is an application of
    its own there, its executors its own."""
    return job.driver == DriverMode.SHARED


def run_holds_process(run: Run) -> bool:
    """The run's driver may still touch the checkpoint: its process lives here, and has not let go of the run's
    query (a shared driver lets go and lives on; so does a driver of its own that waits for the job's next run)."""
    if run.host != settings.HOST_ID or not pid_alive(run.pid):
        return False
    return run.released_at is None


def checkpoint_unknown(job: Job) -> str:
    """Why the job must not start on the checkpoint in its directory: batches are committed there, but this console
    never recorded the job running (no run of it started, no batch recorded). An earlier console, or one on another
    database, left it. Spark would resume it silently, with results, sinks and history carried on from a past this
    console does not know; the operator adopts it (its history imported run by run) or sets it aside instead."""
    batches = committed_batches(job.checkpoint_location)
    if not batches or job.checkpoints.exists() or job.runs.exclude(started_at=None).exists():
        return ""
    journals = len(journal_parts(job.directory / "journal"))
    return (
        f"Not started: {job.checkpoint_location} holds batches {batches[0]}–{batches[-1]} that this console never "
        f"recorded: an earlier console, or one on another database, ran {job.name} there. Starting would resume it "
        f"without a word. Choose on the job's page (or the API): adopt the checkpoint (the job resumes after batch "
        f"{batches[-1]}, and its history is imported run by run from {journals} journal(s)), or set it aside (moved "
        f"beside it, kept; the job starts from nothing)."
    )


def checkpoint_missing(job: Job) -> str:
    """Why the job must not start if its checkpoint vanished after batches were committed to it: Spark would
    silently begin again from nothing and overwrite the results."""
    latest = job.latest_checkpoint
    if latest is None or latest.location != job.checkpoint_dir:
        return ""
    commits = job.checkpoint_location / "commits"
    if commits.is_dir() and any(name.isdigit() for name in os.listdir(commits)):
        return ""
    return (
        f"Not started: the checkpoint directory is missing or empty ({job.checkpoint_location}), but batch "
        f"{latest.batch_id} was committed there. Starting would silently begin again from nothing. Restore a "
        f"savepoint, or put the directory back."
    )


def spawn_driver(run: Run) -> int:
    """The driver is its own process in its own session: it outlives the worker that started it."""
    return spawn_process("workers.driver_process", run.id, Path(run.log_path))


def respawn_in_own_driver(run: Run) -> int:
    """A launched run that its process will not run (a shared driver, or a driver waiting for the job's next run,
    that cannot run its code) goes to a new driver of its own: its log and Spark master as such a driver's, its pid
    the new process's. Returns that pid."""
    own = own_driver_settings(run)
    run.log_path = own["log_path"]
    pid = spawn_driver(run)
    Run.objects.filter(id=run.id).update(pid=pid, driver_host=None, **own)
    return pid


def _assign_shared(run: Run) -> DriverHost:
    """The run goes to this host's serving shared driver (a new one when none serves): its pid, log and Spark master
    as that driver's. Inside the caller's transaction (``host_for_launch``); the caller saves the run."""
    host = host_for_launch()
    run.driver_host, run.pid, run.log_path = host, host.pid, host.log_path
    run.spark_master = shared_master_label(host)
    return host


def respawn_in_shared_driver(run: Run) -> DriverHost:
    """A launched run that a draining shared driver on a cluster will not run goes to the serving shared driver, a
    new one when none serves (``workers/host.py``: there a driver of its own would wait for the cores the draining
    one's application holds). Returns that driver."""
    with transaction.atomic():
        run = Run.objects.select_for_update().get(id=run.id)
        host = _assign_shared(run)
        run.save(update_fields=["driver_host", "pid", "log_path", "spark_master"])
    return host


def job_request_stop(*, job: Job) -> Run:
    """Ask the running driver to drain its batch in flight and stop. Asking twice is harmless."""
    with transaction.atomic():
        run = job.runs.select_for_update().filter(status__in=ACTIVE_RUN_STATUSES).first()
        if run is None:
            raise ActionRefused(f"{job.name} is not running.")
        if run.status == RunStatus.PENDING:
            run.status, run.ended_at, run.message = RunStatus.STOPPED, timezone.now(), "Stopped before it started."
        elif run.stop_requested_at is None:
            run.stop_requested_at = timezone.now()
            if run.status in (RunStatus.STARTING, RunStatus.RUNNING):
                run.status = RunStatus.STOPPING
        run.save()
    return run


def run_started(*, run_id: int, executors: list[str] | None = None) -> bool:
    """The driver's query is running (its executors on the hosts ``executors``, on a cluster): STARTING becomes RUNNING
    (False when a stop or the supervisor got there first)."""
    now = timezone.now()
    started = Run.objects.filter(id=run_id, status=RunStatus.STARTING).update(
        status=RunStatus.RUNNING, started_at=now, last_heartbeat_at=now, executors=executors or []
    )
    if started:
        run = Run.objects.get(id=run_id)
        incidents_publish(run.job_id, run_incidents(run))
    return bool(started)


def run_finish(*, run_id: int, status: str, message: str = "", error: str = "") -> None:
    run = Run.objects.select_related("job").get(id=run_id)
    ended = Run.objects.filter(id=run_id, status__in=(*ACTIVE_RUN_STATUSES, RunStatus.GREEN)).update(
        status=status, message=_storable(message), error=_storable(error), ended_at=timezone.now()
    )
    if run.fencing_token is not None:
        lease_release(job_id=run.job_id, token=run.fencing_token)
    if ended:
        run.refresh_from_db()
        incidents_publish(run.job_id, run_incidents(run)[-1:])  # its end; the start went out when it started
        job_actions_wake(run.job_id)  # an upgrade or a rescale waiting for the stop goes on at once


def _storable(text: str) -> str:
    """A run's message or trace as PostgreSQL's text takes it: without revealed secrets, and a NUL (which a JVM trace
    quoting a plan's literal or a record may hold) written as ``\\0``."""
    return redact(text).replace("\x00", "\\0")


LAUNCH_LIMIT = timedelta(minutes=10)  # a start no worker launched by then was lost


def host_cause(host: DriverHost | None) -> str:
    """What a shared driver that ended itself recorded as its cause (its JVM ran out of memory, say), else empty."""
    if host is None:
        return ""
    message = DriverHost.objects.filter(id=host.id, status=HostStatus.GONE).values_list("message", flat=True).first()
    return message.removeprefix("Ended: ") if message and message.startswith("Ended: ") else ""


def runs_supervise() -> list[str]:
    """Mark runs whose driver is gone as lost; kill drivers that ignored a stop request past the grace period; expire
    starts that never got a driver (a lost task, a worker that died between the lease and the process)."""
    notes = []
    now = timezone.now()
    stale = Run.objects.filter(
        Q(status=RunStatus.PENDING) | Q(status=RunStatus.STARTING, pid__isnull=True),
        requested_at__lt=now - LAUNCH_LIMIT,
    )
    for run in stale:
        run_finish(
            run_id=run.id,
            status=RunStatus.FAILED,
            message=f"No driver was launched for this start within {LAUNCH_LIMIT.seconds // 60} minutes (is a Celery "
            "worker running?); start the job again.",
        )
        notes.append(f"run {run.id} expired: never launched")
    for run in (
        Run.objects.filter(status__in=ACTIVE_RUN_STATUSES)
        .exclude(status=RunStatus.PENDING)
        .select_related("job", "driver_host")
    ):
        local = run.host == settings.HOST_ID
        exited = bool(local and run.pid and not pid_alive(run.pid))
        expired = (
            run.job.lease_token == run.fencing_token and not run.job.lease_is_held() and run.started_at is not None
        )
        if exited or expired:
            message = "The driver process exited without reporting (killed or crashed)."
            if exited and run.driver_host_id is not None:  # every job in that shared driver went with it
                cause = host_cause(run.driver_host) or "it exited without reporting (killed or crashed)."
                message = f"The shared driver #{run.driver_host_id} ended: {cause}"
            if not exited and run.driver_host is not None and not host_silent(run.driver_host):
                # a shared driver that beats: the others' queries are fine there; this one's lease keeper finds
                # itself fenced and stops its query, and its token is stale from now on
                message = "The job's query in the shared driver stopped renewing its lease; it is fenced there."
            elif not exited and local and run.pid and pid_alive(run.pid):
                # alive but silent past its lease (paused, hung): kill it before the lease is free for another, so it
                # can never wake up next to its successor
                kill_group(run.pid)
                message = "The driver stopped renewing its lease (paused or hung past it); it was killed."
            elif not local:
                # another host's driver, silent past its lease (its host lost, paused or cut off): its own host kills
                # it if it is there at all; its token is stale from now on, so it can write nothing either way
                run_kill(run)
                message = f"The driver on {run.host} stopped renewing its lease (its host lost or cut off)."
            run_finish(run_id=run.id, status=RunStatus.LOST, message=message)
            notes.append(f"run {run.id} lost")
        elif (
            run.stop_requested_at
            and (now - run.stop_requested_at).total_seconds() > settings.STOP_GRACE_SECONDS
            and run.pid
            and run.driver_host_id is None  # a shared driver stops a query past its grace itself
        ):
            run_kill(run)
            notes.append(f"run {run.id} killed after the stop grace period")
    return notes


def run_kill(run: Run) -> None:
    """SIGKILL a run's driver wherever it runs: here at once, on another host through that host's queue. Never a
    shared driver for one of its jobs: it fences and stops that query itself, and its host's supervisor kills it
    whole only when it falls silent."""
    if run.driver_host_id is not None:
        return
    if run.host == settings.HOST_ID:
        kill_group(run.pid or 0)
    else:
        enqueue_on(run.host, KILL_DRIVER, run.id)


def run_kill_here(*, run_id: int) -> str:
    """The host queue's side of ``run_kill``: kill the run's driver if it is on this host and alive."""
    run = Run.objects.filter(id=run_id).first()
    if run is None or run.host != settings.HOST_ID or not run.pid:
        return f"run {run_id}: no driver of it on {settings.HOST_ID}"
    if run.driver_host_id is not None:
        return f"run {run_id}: runs in shared driver {run.driver_host_id}, which fences it (not killed)"
    if not pid_alive(run.pid):
        return f"run {run_id}: its driver (pid {run.pid}) is already gone"
    kill_group(run.pid)
    return f"run {run_id}: killed its driver (pid {run.pid}) on {settings.HOST_ID}"
