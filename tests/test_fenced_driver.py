"""A driver that lost its lease is gone: paused (SIGSTOP) past its lease while a successor takes over, it never
writes again, and its process ends, killed by the supervisor on its own host, or by itself elsewhere."""

from __future__ import annotations

import contextlib
import os
import signal

import pytest

from dashboard.models import Run, RunStatus
from dashboard.services.runs import job_request_start, pid_alive
from tests.conftest import wait_for
from tests.support import Producer, drain_and_stop, running_with_progress, sink_total

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


# the other host's form takes as long again: selected with -m chaos, to keep the default suite within its budget
# a driver paused past its lease, about a minute each: -m chaos (the fence itself: tests/test_job_start.py)
@pytest.mark.chaos
@pytest.mark.parametrize("host", ["this host", "another host"])
def test_a_driver_paused_past_its_lease_is_gone_within_seconds_and_wrote_nothing(
    host, make_job, redis, stream_name, celery_worker
):
    job = make_job(parallelism=1, trigger_interval_seconds=1, restart_strategy="fixed-delay", restart_delay_seconds=1)
    producer = Producer(redis, stream_name, rate=100)
    producer.start()
    job_request_start(job=job)
    old = wait_for(lambda: running_with_progress(job), 120, 0.5, "the first run to commit")
    if host == "another host":  # the supervisor cannot signal a driver elsewhere: the driver must end itself
        Run.objects.filter(id=old.id).update(host="another-host")
    os.killpg(old.pid, signal.SIGSTOP)
    successor = wait_for(lambda: running_with_progress(job, old.id), 180, 0.5, "a successor to commit")
    with contextlib.suppress(ProcessLookupError):
        os.killpg(old.pid, signal.SIGCONT)  # the old driver wakes up next to its successor, if it is still there
    wait_for(lambda: not pid_alive(old.pid), 10, 0.2, "the old driver's process to be gone")

    drain_and_stop(job, producer, redis)
    assert sink_total(job) == producer.sent, "every event exactly once: the old driver wrote nothing"
    old.refresh_from_db()
    assert old.status == RunStatus.LOST
    if host == "this host":
        assert "it was killed" in old.message, old.message
    assert job.runs.get(id=successor.id).status == RunStatus.STOPPED, "the successor was never fenced"
