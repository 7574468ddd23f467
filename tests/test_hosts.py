"""Celery workers on two hosts (two host identities on this machine, one beat for both): a driver on the other host
is judged by its lease, not a pid, a kill reaches it through its own host's queue, and losing a whole host moves its
job to the other one, exactly once."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from dashboard.models import RunStatus
from dashboard.services.runs import job_request_start, pid_alive, run_kill
from statekeeper.processes import celery_beat_command
from tests.conftest import (
    CeleryWorkers,
    end_workers_and_their_processes,
    start_console_process,
    stop_process_group,
    wait_for,
)
from tests.support import Producer, drain_and_stop, running_with_progress, sink_total

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def two_hosts(checkpoint_root: Path, tmp_path: Path) -> Iterator[dict[str, CeleryWorkers]]:
    hosts = {
        name: CeleryWorkers(checkpoint_root, tmp_path / f"{name}.log", {"STATEKEEPER_HOST_ID": name}, beat=False)
        for name in ("host-a", "host-b")
    }
    beat = start_console_process(celery_beat_command(tmp_path / "beat"), checkpoint_root, tmp_path / "beat.log")
    yield hosts
    stop_process_group(beat)
    for workers in hosts.values():
        end_workers_and_their_processes(workers)


@pytest.mark.chaos  # two hosts, a kill and a lost host: about 100 s, with -m chaos
def test_a_kill_goes_through_the_drivers_host_and_a_lost_host_hands_its_job_over_exactly_once(
    make_job, redis, stream_name, two_hosts
):
    job = make_job(parallelism=1, trigger_interval_seconds=1, restart_strategy="fixed-delay", restart_delay_seconds=1)
    producer = Producer(redis, job.source_stream)
    producer.start()
    job_request_start(job=job)
    first = wait_for(lambda: running_with_progress(job), 180, 0.5, "the first run to commit")
    assert first.host in two_hosts

    # this process is neither host: the kill is queued to the driver's host, whose worker kills the process there
    run_kill(first)
    wait_for(lambda: not pid_alive(first.pid), 30, 0.5, f"the driver on {first.host} to be killed")
    second = wait_for(lambda: running_with_progress(job, first.id), 180, 0.5, "a restart after the kill")
    assert job.runs.get(id=first.id).status == RunStatus.LOST

    # the whole host of the running driver is lost: its worker and its driver, at once
    lost_host = second.host
    two_hosts[lost_host].kill()
    os.killpg(second.pid, signal.SIGKILL)
    third = wait_for(lambda: running_with_progress(job, second.id), 180, 0.5, "the job to move to the other host")
    assert third.host != lost_host and third.host in two_hosts
    # judged by its lease from the other host, where its pid means nothing
    assert job.runs.get(id=second.id).message.startswith(f"The driver on {lost_host} stopped renewing its lease")

    drain_and_stop(job, producer, redis)
    assert sink_total(job) == producer.sent, "every event counted exactly once"
    statuses = {r.id: r.status for r in job.runs.all()}
    assert statuses[first.id] == statuses[second.id] == RunStatus.LOST
    assert {s for i, s in statuses.items() if i not in (first.id, second.id)} == {RunStatus.STOPPED}
    assert job.runs.filter(id__gt=second.id).count() == 1, "one successor for the lost host, not one per host"
