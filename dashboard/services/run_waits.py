"""The waits a step makes on a job's runs: that none is alive before it touches the checkpoint, that a stop or an
exit happened, that a run it started is up."""

from __future__ import annotations

import contextlib

from django.conf import settings

from dashboard.models import ACTIVE_RUN_STATUSES, Action, Job, Run, RunStatus
from dashboard.services.action_keys import remember
from dashboard.services.action_steps import Next, Step, Wait, step_seconds
from dashboard.services.errors import ActionFailed, ActionRefused
from dashboard.services.runs import (
    job_request_start,
    job_request_stop,
    run_holds_process,
    run_launch,
)  # fmt: skip


def active_run(job: Job) -> Run | None:
    return job.runs.filter(status__in=ACTIVE_RUN_STATUSES).first()


def alive_run(job: Job) -> Run | None:
    """A run whose driver may still touch the checkpoint: one in flight, or an ended one whose process on this host
    is still there (a fenced driver on its way out)."""
    if (run := active_run(job)) is not None:
        return run
    return next((r for r in job.runs.order_by("-id")[:5] if run_holds_process(r)), None)


def refuse_while_alive(job: Job, doing: str) -> None:
    """Checkpoint files are changed only while no driver of the job is alive."""
    if (run := alive_run(job)) is not None:
        state = run.get_status_display().lower() if run.is_active else f"{run.status}, its process still alive"
        raise ActionRefused(f"{job.name} has run #{run.id} ({state}): stop it before {doing}; nothing was changed.")


def settled(action: Action, job: Job, doing: str) -> Wait | None:
    """None once no driver of the job is alive. A run in flight is refused (the operator stops it first); a run that
    has ended but whose process is still on its way out (a driver of its own drains, closes its sinks and its JVM for
    some seconds after the API says stopped) is waited for, as a stop with a savepoint waits."""
    run = alive_run(job)
    if run is None:
        return None
    if run.is_active:
        refuse_while_alive(job, doing)
    if step_seconds(action) > settings.STOP_GRACE_SECONDS + 30:
        raise ActionFailed(
            f"run #{run.id} of {job.name} ended but its driver process is still alive; nothing was changed"
        )
    return Wait(f"run #{run.id} has stopped: waiting for its driver process to exit before {doing}", 0.5)


def stopped(action: Action, job: Job) -> Wait | None:
    """None once the job has no run in flight; else ask its driver to drain and stop (asking again is harmless) and
    wait. Fails when it has not stopped within the stop grace (the supervisor kills it past that)."""
    if active_run(job) is None:
        return None
    if step_seconds(action) > settings.STOP_GRACE_SECONDS + 30:
        raise ActionFailed(f"{job.name} did not stop in time; nothing else was changed")
    with contextlib.suppress(ActionRefused):  # it stopped between the look and the request
        job_request_stop(job=job)
    return Wait("stopping the job: the batch in flight commits first", 0.5)


def exited(action: Action, job: Job, seconds: float = 60) -> Wait | None:
    """None once no driver process of the job is alive (a failed driver ends a few seconds after its run ended); the
    checkpoint is touched only after."""
    run = alive_run(job)
    if run is None:
        return None
    if step_seconds(action) > seconds:
        raise ActionFailed(f"run #{run.id} of {job.name} is still alive; nothing was restored")
    return Wait(f"waiting for run #{run.id}'s driver process to end", 0.5)


def stop_step(then: str) -> tuple[str, Step]:
    """A step that stops the job (see ``stopped``) and goes on to ``then``."""
    return "stop the job", lambda action: stopped(action, action.job) or Next(then)


def exit_step(then: str) -> tuple[str, Step]:
    """A step that waits for every driver process of the job to end (see ``exited``) and goes on to ``then``."""
    return "the driver exits", lambda action: exited(action, action.job) or Next(then)


def start_once(action: Action, key: str = "run", launch: bool = False) -> Run:
    """Start the job for this action, once however often the step runs: a run requested by an earlier visit (its
    worker killed between the request and the record of it) is adopted, not refused. With ``launch`` the step starts
    the driver itself (an action that then watches the run gains the queue's latency; the queued start task finds it
    launched and does nothing); either way the action never waits for a task to be picked up."""
    job = action.job
    if (known := action.params.get(key)) is not None:
        return Run.objects.get(id=known)
    began = action.step_started_at
    active = job.runs.filter(status__in=ACTIVE_RUN_STATUSES).first()
    if active is not None and began is not None and active.requested_at >= began:
        run = active
    else:
        run = job_request_start(job=job, requested_by=action.requested_by)
    remember(action, **{key: run.id})
    if launch and run.status == RunStatus.PENDING:
        run_launch(run_id=run.id)
        run.refresh_from_db()
    return run


def run_up(action: Action, run: Run, limit: float = 600) -> Wait | str | None:
    """None once the run's query is running; a Wait while it starts; the reason (a string) when it ended first."""
    run.refresh_from_db()
    if run.status == RunStatus.RUNNING:
        return None
    if not run.is_active:
        return run.message or f"run #{run.id} ended {run.status}"
    if step_seconds(action) > limit:
        return f"run #{run.id} was still {run.status} after {limit:.0f} s"
    return Wait(f"run #{run.id} {run.get_status_display().lower()}: waiting for its query to run", 0.5)
