"""A warm standby takes over the moment the running driver dies: kill -9 of the active driver, and the standby (its
Spark already started and its pipeline already run once) commits the next batch under a new fencing token, with
every event counted once. It never takes over a job that was asked to stop, and ends when its job stays down."""

from __future__ import annotations

import os
import signal
import socket
import time
from datetime import timedelta

import pytest
from django.utils import timezone

from dashboard.models import Action, ActionKind, Job, Recovery, Run, RunStatus, StandbyDriver, StandbyStatus
from dashboard.services.lease import lease_acquire
from dashboard.services.runs import job_request_start
from dashboard.services.standby import built_for, standby_takeover
from tests.conftest import wait_for
from tests.support import Producer, children_of, drain_and_stop, running_with_progress, sink_total

pytestmark = pytest.mark.django_db(transaction=True)


def ready_standby(job, after: int = 0) -> StandbyDriver | None:
    return job.standbys.filter(status=StandbyStatus.READY, id__gt=after).first()


@pytest.mark.browser
@pytest.mark.chaos  # a standby warmed up, then kill -9: about three minutes, with -m chaos
def test_a_standby_takes_over_a_killed_driver_and_counts_every_event_once(make_job, redis, stream_name, celery_worker):
    # a cold restart would wait 30 s: a successor sooner than that can only be the standby
    job = make_job(parallelism=1, trigger_interval_seconds=1, standby=True, restart_strategy="fixed-delay",
                   restart_delay_seconds=30)  # fmt: skip
    producer = Producer(redis, stream_name, rate=100, poison_every=4)
    producer.start()
    job_request_start(job=job)
    first = wait_for(lambda: running_with_progress(job), 120, 0.5, "the first run to commit")
    standby = wait_for(lambda: ready_standby(job), 180, 0.5, "a standby to be warm")
    assert standby.rss_bytes and standby.rss_bytes > 100 << 20, "its memory cost (Python and JVM) is measured"

    killed_at = time.monotonic()
    os.killpg(first.pid, signal.SIGKILL)
    successor = wait_for(lambda: running_with_progress(job, first.id), 25, 0.1, "the standby to commit a batch")
    took = time.monotonic() - killed_at
    assert successor.pid == standby.pid and f"Standby #{standby.id} took over from run #{first.id}" in successor.message
    assert successor.fencing_token > first.fencing_token
    first.refresh_from_db()
    assert first.status == RunStatus.LOST
    recovery = Recovery.objects.get(failed_run=first)
    assert recovery.restart_run_id == successor.id
    print(f"kill -9 to the standby's first committed batch: {took:.1f} s")  # the benchmark measures it properly
    servers = [pid for pid, cmdline in children_of(standby.pid) if b"workers.spark.fork_server" in cmdline]
    assert len(servers) == 1 and children_of(servers[0]), (
        "the successor's stream reader process was forked from the standby's fork server, not started cold"
    )

    behind = wait_for(lambda: ready_standby(job, standby.id), 180, 0.5, "a new standby behind the one that took over")
    first_batch = successor.checkpoints.order_by("batch_id").first()
    assert behind.started_at >= first_batch.committed_at + timedelta(milliseconds=first_batch.duration_ms), (
        "the next standby's warm-up (a JVM) waits for the successor's first commit: it must not slow the takeover"
    )
    drain_and_stop(job, producer, redis)
    assert sink_total(job) == producer.sent, "every event exactly once across the takeover"
    # a stop is not a death: the standby lets the driver go, and ends when the job stays down
    wait_for(lambda: StandbyDriver.objects.get(id=behind.id).status == StandbyStatus.ENDED, 60, 0.5, "the idle end")
    assert job.runs.order_by("-id").first().status == RunStatus.STOPPED, "no run started after the stop"
    assert job.runs.count() == 2


def _dead_run(job):
    """A running run whose driver process is gone (the lock freed): what a standby may take over."""
    token = lease_acquire(job_id=job.id)
    return Run.objects.create(
        job=job, status=RunStatus.RUNNING, fencing_token=token, pid=2**22 + 17, host=socket.gethostname()
    )


def test_a_standby_never_takes_over_a_stop_an_action_or_a_changed_job(make_job):
    job = make_job(standby=True)
    standby = StandbyDriver.objects.create(job=job, status=StandbyStatus.READY, built_for=built_for(job))
    run = _dead_run(job)
    Run.objects.filter(id=run.id).update(stop_requested_at=timezone.now())
    assert standby_takeover(standby_id=standby.id, lock_wait_ms=1) is None
    assert "asked to stop" in StandbyDriver.objects.get(id=standby.id).message

    Run.objects.filter(id=run.id).update(stop_requested_at=None)
    action = Action.objects.create(job=job, kind=ActionKind.RESCALE, params={"parallelism": 2})
    assert standby_takeover(standby_id=standby.id, lock_wait_ms=1) is None
    assert "in flight" in StandbyDriver.objects.get(id=standby.id).message

    Action.objects.filter(id=action.id).update(status="succeeded")
    Job.objects.filter(id=job.id).update(parallelism=3)  # its SparkSession was built for local[2]
    assert standby_takeover(standby_id=standby.id, lock_wait_ms=1) is None
    assert "changed since this standby started" in StandbyDriver.objects.get(id=standby.id).message
    assert Run.objects.get(id=run.id).status == RunStatus.RUNNING and job.runs.count() == 1, "nothing taken over"

    Job.objects.filter(id=job.id).update(parallelism=2)
    taken = standby_takeover(standby_id=standby.id, lock_wait_ms=1)
    assert taken is not None and taken.fencing_token > run.fencing_token and taken.pid == os.getpid()
    assert Run.objects.get(id=run.id).status == RunStatus.LOST
    assert Recovery.objects.get(failed_run=run).restart_run_id == taken.id
    assert StandbyDriver.objects.get(id=standby.id).status == StandbyStatus.ACTIVE


def test_a_standby_respects_the_failure_rate_limit_and_frees_the_lease(make_job):
    job = make_job(standby=True, failure_rate_max=1)
    standby = StandbyDriver.objects.create(job=job, status=StandbyStatus.READY, built_for=built_for(job))
    earlier = Run.objects.create(job=job, status=RunStatus.LOST, ended_at=timezone.now())
    Recovery.objects.create(job=job, failed_run=earlier, cause="an earlier death", failed_at=timezone.now())
    run = _dead_run(job)
    assert standby_takeover(standby_id=standby.id, lock_wait_ms=1) is None
    job.refresh_from_db()
    assert "2 failures within 30 minutes" in job.failed_reason and not job.lease_is_held()
    assert Run.objects.get(id=run.id).status == RunStatus.LOST and job.runs.count() == 2


def test_a_standby_whose_pipeline_code_changed_on_disk_ends_rather_than_run_the_old_code(make_job):
    from dataclasses import replace

    from dashboard import pipelines
    from workers import job_lock
    from workers.standby import code_changed, wait_for_death

    job = make_job(standby=True)
    standby = StandbyDriver.objects.create(job=job, status=StandbyStatus.READY, built_for=built_for(job))
    imported = pipelines.code_version(job.pipeline)
    assert not code_changed(standby, imported), "the code on disk is the code it imported"
    older = replace(imported, code_hash="0" * 64)  # as if the files changed after the standby imported them
    assert code_changed(standby, older)
    conn = job_lock.lock_connection()
    try:
        assert wait_for_death(standby, conn, loaded=older) is None, "it does not wait to take over with the old code"
    finally:
        conn.close()
    standby.refresh_from_db()
    assert standby.status == StandbyStatus.ENDED
    assert standby.message == (
        f"The console's code (which holds the built-in pipeline {job.pipeline!r}) changed on disk since this standby "
        "imported it."
    ), "a built-in pipeline is the console's code: the message says so"
