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


def test_a_standby_job_whose_shared_driver_died_restarts_in_the_spare_at_once_and_others_after_their_delay(
    make_job, settings
):
    serving = DriverHost.objects.create(host=settings.HOST_ID, status=HostStatus.GONE, pid=2**22 + 1)
    DriverHost.objects.create(host=settings.HOST_ID, status=HostStatus.SPARE, pid=os.getpid())  # a live spare
    standing_by, without = make_job(driver="shared", standby=True), make_job(driver="shared")
    crashed = make_job(driver="shared", standby=True)
    lost = [failed_run(job, driver_host=serving) for job in (standing_by, without)]
    failed = failed_run(crashed, driver_host=serving, status=RunStatus.FAILED, message="The query failed: boom")
    recoveries_supervise()
    waits = {r.job_id: r.restart_at - r.failed_at for r in Recovery.objects.filter(failed_run__in=[*lost, failed])}
    assert waits[standing_by.id] == timedelta(0), "the spare takes over at once, as a standby would"
    assert waits[without.id] == waits[crashed.id] == timedelta(seconds=5), "no standby, or a failed query: the delay"
    assert Recovery.objects.get(failed_run=lost[0]).restart_run is not None, "restarted in the same round"

    DriverHost.objects.filter(status=HostStatus.SPARE).update(status=HostStatus.GONE)
    again = failed_run(standing_by, driver_host=serving)
    recoveries_supervise()
    recovery = Recovery.objects.get(failed_run=again)
    assert recovery.restart_at - recovery.failed_at == timedelta(seconds=10), "no spare: a cold start, after the delay"


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
