"""Automatic recovery: restart strategy, back-off, failure-rate limit, and no crash loop on a broken checkpoint."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
from django.utils import timezone

from dashboard.models import (
    AuditEntry,
    Checkpoint,
    DriverHost,
    HostStatus,
    Job,
    Recovery,
    RestartStrategy,
    Run,
    RunStatus,
)
from dashboard.services.recovery import recoveries_supervise, restart_delay

pytestmark = pytest.mark.django_db


def failed_run(job, message="The driver process exited without reporting (killed or crashed).", error="", **extra):
    return Run.objects.create(
        job=job, message=message, error=error, ended_at=timezone.now(), **{"status": RunStatus.LOST, **extra}
    )


def test_a_lost_driver_is_restarted_after_the_delay_and_its_downtime_recorded(make_job):
    job = make_job()
    lost = failed_run(job)
    recoveries_supervise()
    recovery = Recovery.objects.get(failed_run=lost)
    assert recovery.attempt == 1 and not recovery.gave_up
    assert recovery.restart_at == recovery.failed_at + timedelta(seconds=5)
    assert recovery.restart_run is None, "not before the delay"

    Recovery.objects.filter(id=recovery.id).update(restart_at=timezone.now())
    recoveries_supervise()
    recovery.refresh_from_db()
    assert recovery.restart_run.status == RunStatus.PENDING
    audited = AuditEntry.objects.get(verb="restart")
    assert (audited.origin, audited.job, audited.target) == ("supervisor", job.name, f"run #{recovery.restart_run_id}")

    triggered = recovery.failed_at + timedelta(seconds=12)  # a record's committed_at is its trigger's start
    Checkpoint.objects.create(job=job, run=recovery.restart_run, batch_id=7, committed_at=triggered, duration_ms=1500)
    recoveries_supervise()
    recovery.refresh_from_db()
    assert recovery.downtime_seconds == 13.5, "down until the first batch committed: its trigger plus its duration"


def test_the_job_lost_while_a_blue_green_runs_beside_it_is_restarted_and_its_new_version_is_not_the_jobs_run(make_job):
    """Blue lost while green follows it (a paused shared driver, on the demo stack): blue is restarted under the job's
    strategy while the blue/green upgrade waits for it. Green's own runs, failed or following, are not the job's."""
    from dashboard.models import Action, ActionKind, ActionStatus

    job = make_job()
    blue = failed_run(job)
    action = Action.objects.create(job=job, kind=ActionKind.BLUE_GREEN, status=ActionStatus.RUNNING)
    failed_run(job, message="its shared driver let go of it", status=RunStatus.FAILED, green={"action": action.id})
    Run.objects.create(job=job, status=RunStatus.GREEN, green={"action": action.id})
    recoveries_supervise()
    recovery = Recovery.objects.get(job=job)
    assert recovery.failed_run_id == blue.id, "blue's loss, not green's failure"
    Recovery.objects.filter(id=recovery.id).update(restart_at=timezone.now())
    recoveries_supervise()
    assert Recovery.objects.get(id=recovery.id).restart_run.status == RunStatus.PENDING, "not held for the blue/green"

    taken = make_job(name="taken-over")
    failed_run(taken, green={"action": action.id, "handover": 12})  # green after the handover: the job's run
    recoveries_supervise()
    assert Recovery.objects.filter(job=taken).exists()


def test_a_crash_of_the_shared_driver_restarts_its_jobs_at_once_and_is_not_counted_as_each_jobs_failure(
    make_job, settings, admin_client
):
    """Every job in a shared driver that died is lost at once, by nothing of its own: each restarts at once (the
    spare, or a new shared driver) and its back-off does not grow, round after round. A query that failed in a shared
    driver that lives is the job's own failure: the strategy's delay, doubling."""
    serving = DriverHost.objects.create(host=settings.HOST_ID, status=HostStatus.GONE, pid=2**22 + 1)
    DriverHost.objects.create(host=settings.HOST_ID, status=HostStatus.SPARE, pid=os.getpid())  # a live spare
    standing_by, without = make_job(driver="shared", standby=True), make_job(driver="shared")
    crashed = make_job(driver="shared", standby=True)
    lost = [failed_run(job, driver_host=serving) for job in (standing_by, without)]
    failed = failed_run(crashed, driver_host=serving, status=RunStatus.FAILED, message="The query failed: boom")
    recoveries_supervise()
    recoveries = {r.job_id: r for r in Recovery.objects.filter(failed_run__in=[*lost, failed])}
    waits = {job_id: r.restart_at - r.failed_at for job_id, r in recoveries.items()}
    assert waits[standing_by.id] == waits[without.id] == timedelta(0), "the shared driver died: at once"
    assert waits[crashed.id] == timedelta(seconds=5), "its own query failed: the strategy's delay"
    assert recoveries[without.id].host_crash and not recoveries[crashed.id].host_crash
    assert all(Recovery.objects.get(failed_run=run).restart_run is not None for run in lost), "in the same round"

    DriverHost.objects.filter(status=HostStatus.SPARE).update(status=HostStatus.GONE)
    for _ in range(2):  # the shared driver dies twice more, no spare standing by: a cold start, at once, each time
        again = failed_run(without, driver_host=serving)
        recoveries_supervise()
        recovery = Recovery.objects.get(failed_run=again)
        assert recovery.restart_at == recovery.failed_at and recovery.attempt == 1, "no back-off from host crashes"
    own = failed_run(without, message="The query failed: boom", status=RunStatus.FAILED)
    recoveries_supervise()
    recovery = Recovery.objects.get(failed_run=own)
    assert (recovery.attempt, recovery.restart_at - recovery.failed_at) == (1, timedelta(seconds=5)), (
        "the job's first failure of its own, after three crashes of its shared driver"
    )
    assert Job.objects.get(id=without.id).failed_reason == "", "within the failure-rate limit"
    page = admin_client.get(f"/jobs/{without.name}/runs").content.decode()
    assert page.count("data-host-crash") == 3, "the three crashes of its shared driver are told apart on the page"


def test_exponential_back_off_doubles_up_to_the_cap(make_job):
    job = make_job(restart_delay_seconds=5, restart_max_delay_seconds=30)
    assert [restart_delay(job, n) for n in (1, 2, 3, 4, 5)] == [5, 10, 20, 30, 30]
    job.restart_strategy = RestartStrategy.FIXED
    assert restart_delay(job, 4) == 5


def test_too_many_failures_in_the_window_leave_the_job_failed_with_the_reason(make_job):
    job = make_job(failure_rate_max=2, failure_rate_window_minutes=10)
    for _ in range(2):
        failed_run(job)
        recoveries_supervise()
    last = failed_run(job, message="The query failed: boom")
    recoveries_supervise()
    recovery = Recovery.objects.get(failed_run=last)
    assert recovery.gave_up and recovery.restart_at is None
    job.refresh_from_db()
    assert "3 failures within 10 minutes" in job.failed_reason and "boom" in job.failed_reason
    recoveries_supervise()
    assert not job.runs.filter(status=RunStatus.PENDING).exists(), "it stays down"


def test_a_broken_checkpoint_is_reported_once_and_never_restarted(make_job):
    job = make_job()
    (job.checkpoint_location / "commits").mkdir(parents=True)
    for batch in range(4):
        (job.checkpoint_location / "commits" / str(batch)).write_text("v1\n{}")
    failed_run(
        job,
        message="The query failed: [CANNOT_LOAD_STATE_STORE.CANNOT_READ_DELTA_FILE_NOT_EXISTS] Error reading delta file",
        error="java.io.FileNotFoundException: state/0/1/3.delta",
    )
    recoveries_supervise()
    job.refresh_from_db()
    assert "The checkpoint is broken" in job.failed_reason
    assert "roll back to an earlier batch (batches 0–3 are retained)" in job.failed_reason
    assert Recovery.objects.get(job=job).gave_up
    recoveries_supervise()
    assert job.runs.count() == 1


def test_a_stop_on_request_or_a_job_without_a_strategy_is_not_restarted(make_job):
    stopped = make_job()
    failed_run(stopped, stop_requested_at=timezone.now())
    manual = make_job(restart_strategy=RestartStrategy.NONE)
    failed_run(manual)
    recoveries_supervise()
    assert not Recovery.objects.exists()


def test_starting_a_failed_job_clears_the_reason(make_job):
    from dashboard.services.runs import job_request_start

    job = make_job()
    Job.objects.filter(id=job.id).update(failed_reason="gave up")
    job.refresh_from_db()
    job_request_start(job=job)
    job.refresh_from_db()
    assert job.failed_reason == ""
