"""The action engine: an action that has to wait lets its worker go, is visited again when due, resumes after its
worker died, and keeps each step's duration (invariant 10)."""

from __future__ import annotations

import subprocess
import time
from datetime import datetime, timedelta

import pytest
from django.conf import settings
from django.utils import timezone

from dashboard.models import Action, ActionKind, ActionStatus, Run, RunStatus
from dashboard.services.actions import MAX_RESUMES, RESEND, action_advance, action_request, actions_due, actions_resume
from dashboard.services.runs import run_finish

pytestmark = pytest.mark.django_db


def running(job) -> Run:
    return Run.objects.create(job=job, status=RunStatus.RUNNING, started_at=timezone.now())


def test_an_action_that_waits_for_its_driver_lets_the_worker_go_and_goes_on_when_the_driver_stopped(make_job):
    job = make_job()
    run = running(job)
    action = action_request(job=job, kind=ActionKind.STOP_WITH_SAVEPOINT)

    began = time.monotonic()
    visited = action_advance(action_id=action.id)
    assert time.monotonic() - began < 5, "the visit returns instead of waiting for the driver"
    assert (visited.status, visited.step, visited.claimed_by) == (ActionStatus.RUNNING, "stop", "")
    assert visited.progress == "stopping the job: the batch in flight commits first"
    assert visited.wake_at is not None and visited.wake_at <= timezone.now() + timedelta(seconds=1)
    run.refresh_from_db()
    assert run.status == RunStatus.STOPPING and run.stop_requested_at is not None

    # the driver drains and stops; the next visit goes on to the savepoint (this job has no committed batch)
    Run.objects.filter(id=run.id).update(status=RunStatus.STOPPED, ended_at=timezone.now())
    done = action_advance(action_id=action.id)
    assert done.status == ActionStatus.FAILED and "no committed batch" in done.outcome
    assert [p["step"] for p in done.phases] == ["stop", "savepoint"]
    assert [p["label"] for p in done.phases] == ["stop the job", "copy the checkpoint"]
    assert all("ended" in p for p in done.phases), "every phase has ended"
    took = (done.finished_at - datetime.fromisoformat(done.phases[0]["started"])).total_seconds()
    assert sum(p["seconds"] for p in done.phases) <= took + 0.5, "the phases' durations add up to what the action took"
    assert done.phases[0]["seconds"] >= (visited.wake_at - visited.started_at).total_seconds() - 1


def test_two_visits_at_once_advance_an_action_once(make_job):
    job = make_job()
    running(job)
    action = action_request(job=job, kind=ActionKind.STOP_WITH_SAVEPOINT)
    Action.objects.filter(id=action.id).update(
        claimed_by=f"{settings.HOST_ID}:1", claimed_until=timezone.now() + timedelta(minutes=5)
    )
    untouched = action_advance(action_id=action.id)
    assert (untouched.status, untouched.step, untouched.phases) == (ActionStatus.PENDING, "", [])


def test_due_actions_are_queued_once_and_again_after_a_lost_message(make_job):
    job = make_job()
    action = action_request(job=job, kind=ActionKind.SAVEPOINT)
    assert actions_due() == [], "just queued by the request: not due before RESEND"
    Action.objects.filter(id=action.id).update(wake_at=timezone.now())
    assert actions_due() == [action.id]
    assert actions_due() == [], "queued: its wake time moved on"
    Action.objects.filter(id=action.id).update(wake_at=timezone.now() - RESEND)
    claimed = timezone.now() + timedelta(minutes=5)
    Action.objects.filter(id=action.id).update(claimed_by=f"{settings.HOST_ID}:1", claimed_until=claimed)
    assert actions_due() == [], "a worker holds it"


def test_an_action_waiting_for_its_jobs_stop_is_queued_the_moment_the_run_ends_not_at_its_wake_time(make_job):
    job = make_job()
    run = running(job)
    action = action_advance(action_id=action_request(job=job, kind=ActionKind.STOP_WITH_SAVEPOINT).id)
    later = timezone.now() + timedelta(seconds=10)
    Action.objects.filter(id=action.id).update(wake_at=later)
    other = make_job(name="another")
    running(other)
    elsewhere = action_advance(action_id=action_request(job=other, kind=ActionKind.STOP_WITH_SAVEPOINT).id)
    Action.objects.filter(id=elsewhere.id).update(wake_at=later)

    run_finish(run_id=run.id, status=RunStatus.STOPPED)
    sent = Action.objects.get(id=action.id).wake_at
    assert sent is not None and sent >= timezone.now() + RESEND - timedelta(seconds=5), "queued now, as beat does"
    assert Action.objects.get(id=elsewhere.id).wake_at == later, "another job's action waits on"
    assert actions_due() == [], "not sent twice"


def test_an_action_whose_worker_died_mid_step_resumes_and_ends_after_repeated_deaths(make_job):
    job = make_job()
    running(job)
    action = action_request(job=job, kind=ActionKind.STOP_WITH_SAVEPOINT)
    action_advance(action_id=action.id)
    dead = f"{settings.HOST_ID}:{2**22 + 12345}"  # beyond pid_max: no process has it
    Action.objects.filter(id=action.id).update(claimed_by=dead, claimed_until=timezone.now() + timedelta(minutes=5))

    assert actions_resume() == [f"action {action.id} resumed at step stop (its worker {dead} is gone)"]
    action.refresh_from_db()
    assert (action.status, action.claimed_by, action.resumed, action.step) == (ActionStatus.RUNNING, "", 1, "stop")
    assert action.wake_at <= timezone.now(), "due at once"
    assert actions_resume() == [], "a live or free claim is left alone"

    Action.objects.filter(id=action.id).update(claimed_by=dead, resumed=MAX_RESUMES)
    assert actions_resume() == [f"action {action.id} failed: its step kept killing the worker"]
    action.refresh_from_db()
    assert action.status == ActionStatus.FAILED
    assert f"The worker running step 'stop' stopped {MAX_RESUMES + 1} times" in action.outcome
    assert action.finished_at is not None and action.phases[-1]["step"] == "stop" and "ended" in action.phases[-1]


def test_a_claim_past_its_time_on_another_host_is_let_go(make_job):
    job = make_job()
    action = action_request(job=job, kind=ActionKind.SAVEPOINT)
    Action.objects.filter(id=action.id).update(
        status=ActionStatus.RUNNING, claimed_by="other-host:42", claimed_until=timezone.now() - timedelta(seconds=1)
    )
    assert actions_resume() == [f"action {action.id} resumed at step start (its worker other-host:42 is gone)"]


def test_a_rollback_asked_right_after_a_stop_waits_for_the_driver_process_to_exit(make_job, client, django_user_model):
    """A driver of its own drains, closes its sinks and its JVM for some seconds after its run says stopped: a
    rollback (or restore) asked then waits for the process instead of failing, and the API shows the process alive."""
    client.force_login(django_user_model.objects.create_user("viewer", password="x"))
    job = make_job(driver="own")
    exiting = subprocess.Popen(["sleep", "60"])
    try:
        run = Run.objects.create(job=job, status=RunStatus.STOPPED, started_at=timezone.now(), ended_at=timezone.now(),
                                 pid=exiting.pid, host=settings.HOST_ID)  # fmt: skip
        shown = client.get(f"/api/v1/jobs/{job.name}").json()
        assert shown["status"] == "stopped"
        assert shown["driver"] == {"run": run.id, "pid": exiting.pid, "host": settings.HOST_ID,
                                   "shared_driver": None, "process_alive": True}  # fmt: skip
        action = action_request(job=job, kind=ActionKind.ROLLBACK, params={"batch": 0})
        visited = action_advance(action_id=action.id)
        assert visited.status == ActionStatus.RUNNING, visited.outcome
        assert f"run #{run.id} has stopped: waiting for its driver process to exit" in visited.progress
    finally:
        exiting.kill()
        exiting.wait()
    shown = client.get(f"/api/v1/jobs/{job.name}").json()
    assert shown["driver"]["process_alive"] is False
    # the process gone, the rollback goes on: this job has no batch 0 to roll back to, which is now what it says
    done = action_advance(action_id=action.id)
    assert done.status == ActionStatus.FAILED and "still alive" not in done.outcome, done.outcome
    assert "batch 0" in done.outcome, done.outcome


def test_a_rollback_of_a_job_whose_run_is_in_flight_is_refused_not_waited_for(make_job):
    job = make_job()
    run = running(job)
    done = action_advance(action_id=action_request(job=job, kind=ActionKind.ROLLBACK, params={"batch": 0}).id)
    assert done.status == ActionStatus.FAILED
    assert f"has run #{run.id} (running): stop it before rolling back" in done.outcome
