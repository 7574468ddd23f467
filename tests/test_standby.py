"""A warm standby takes over the moment the running driver dies: kill -9 of the active driver, and the standby (its
Spark already started and its pipeline already run once) commits the next batch under a new fencing token, with
every event counted once. It never takes over a job that was asked to stop, and ends when its job stays down."""

from __future__ import annotations

import os
import signal
import time

import pytest

from dashboard.models import Recovery, RunStatus, StandbyDriver, StandbyStatus
from dashboard.services.runs import job_request_start
from tests.conftest import wait_for
from tests.test_chaos import Producer, drain_and_stop, running_with_progress, sink_total

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def ready_standby(job, after: int = 0) -> StandbyDriver | None:
    return job.standbys.filter(status=StandbyStatus.READY, id__gt=after).first()


def test_a_standby_takes_over_a_killed_driver_and_counts_every_event_once(make_job, redis, stream_name, celery_worker):
    # a cold restart would wait 30 s: a successor sooner than that can only be the standby
    job = make_job(parallelism=1, trigger_interval_seconds=1, standby=True, restart_strategy="fixed-delay",
                   restart_delay_seconds=30)  # fmt: skip
    producer = Producer(redis, stream_name, rate=100, poison_every=4)
    producer.start()
    job_request_start(job=job)
    first = wait_for(lambda: running_with_progress(job), 120, 1, "the first run to commit")
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

    behind = wait_for(lambda: ready_standby(job, standby.id), 180, 0.5, "a new standby behind the one that took over")
    drain_and_stop(job, producer, redis)
    assert sink_total(job) == producer.sent, "every event exactly once across the takeover"
    # a stop is not a death: the standby lets the driver go, and ends when the job stays down
    wait_for(lambda: StandbyDriver.objects.get(id=behind.id).status == StandbyStatus.ENDED, 60, 0.5, "the idle end")
    assert job.runs.order_by("-id").first().status == RunStatus.STOPPED, "no run started after the stop"
    assert job.runs.count() == 2
