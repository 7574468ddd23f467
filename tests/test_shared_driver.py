"""The shared driver: several jobs' queries in one process (one JVM), each still a job of its own: its own run, lease,
token, lock and results; one job's stop or fencing leaves the others running; a kill of the process loses them all,
and the restart strategy brings each back with every event counted once."""

from __future__ import annotations

import os
import signal
import time

import pytest
from django.db.models import F

from dashboard.models import DriverHost, HostStatus, Job, Run, RunStatus
from dashboard.services.runs import job_request_start, job_request_stop, pid_alive
from tests.conftest import wait_for
from tests.test_chaos import Producer, drain_and_stop, running_with_progress, sink_total

pytestmark = pytest.mark.django_db(transaction=True)


def shared_jobs(make_job, stream_name: str, count: int, **overrides) -> list[Job]:
    return [
        make_job(
            source_stream=f"{stream_name}-{i}", driver="shared", parallelism=1, trigger_interval_seconds=1, **overrides
        )  # fmt: skip
        for i in range(count)
    ]


def committed_after(run: Run, batches: int) -> bool:
    """The run has committed ``batches`` more batches than it had when this was first asked."""
    run.refresh_from_db()
    return run.checkpoints.count() >= batches


def test_two_jobs_share_one_driver_and_a_stop_or_a_fencing_ends_only_its_own(
    make_job, redis, stream_name, celery_worker, as_role
):
    first, second, third = shared_jobs(make_job, stream_name, 3)
    producers = [Producer(redis, job.source_stream, rate=50) for job in (first, second, third)]
    for producer in producers:
        producer.start()
    for job in (first, second, third):
        job_request_start(job=job)
    runs = [wait_for(lambda j=job: running_with_progress(j), 180, 0.5, f"{job.name} to commit") for job in (first, second, third)]  # fmt: skip
    host = DriverHost.objects.get()
    assert {run.pid for run in runs} == {host.pid} and {run.driver_host_id for run in runs} == {host.id}
    assert host.status == HostStatus.SERVING and pid_alive(host.pid)
    page = as_role("viewer").get(f"/jobs/{first.name}/").content.decode()
    assert f"the shared driver #{host.id} (pid {host.pid}" in page, "the overview says where the query runs"
    assert f"{second.name}, {third.name}" in page or f"{third.name}, {second.name}" in page, "and beside which jobs"

    # fenced: another token took the first job's lease; only its query stops
    Job.objects.filter(id=first.id).update(lease_token=F("lease_token") + 1)
    fenced = wait_for(lambda: Run.objects.filter(id=runs[0].id).exclude(status=RunStatus.RUNNING).first(), 60, 0.5,
                      "the fenced job's run to end")  # fmt: skip
    assert fenced.status == RunStatus.FAILED and "fenced" in fenced.message
    wait_for(lambda: Run.objects.get(id=runs[0].id).released_at is not None, 30, 0.5, "the run's query released")

    # stopped: the second job drains and stops; the third runs on in the same process
    job_request_stop(job=second)
    wait_for(lambda: Run.objects.get(id=runs[1].id).status == RunStatus.STOPPED, 120, 0.5, "the second job to stop")
    before = runs[2].checkpoints.count()
    wait_for(lambda: committed_after(runs[2], before + 3), 60, 0.5, "the third job to commit 3 more batches")
    assert Run.objects.get(id=runs[2].id).status == RunStatus.RUNNING and pid_alive(host.pid)

    producers[1].halt.set()
    producers[1].join()
    assert sink_total(second) <= producers[1].sent
    drain_and_stop(third, producers[2], redis)
    assert sink_total(third) == producers[2].sent, "every event exactly once beside the others' stop and fencing"
    producers[0].halt.set()


@pytest.mark.chaos  # kill -9 of the shared driver and both restarts: about two minutes, with -m chaos
def test_a_killed_shared_driver_loses_every_job_and_each_comes_back_exact(make_job, redis, stream_name, celery_worker):
    jobs = shared_jobs(make_job, stream_name, 2, restart_strategy="fixed-delay", restart_delay_seconds=1)
    producers = [Producer(redis, job.source_stream, rate=50) for job in jobs]
    for producer in producers:
        producer.start()
    for job in jobs:
        job_request_start(job=job)
    runs = [wait_for(lambda j=job: running_with_progress(j), 180, 0.5, f"{job.name} to commit") for job in jobs]
    os.killpg(runs[0].pid, signal.SIGKILL)
    killed = time.monotonic()
    successors = [wait_for(lambda j=job, r=run: running_with_progress(j, r.id), 240, 0.5, f"{job.name} back")
                  for job, run in zip(jobs, runs, strict=True)]  # fmt: skip
    print(f"kill -9 of the shared driver to both jobs committing again: {time.monotonic() - killed:.1f} s")
    assert {Run.objects.get(id=run.id).status for run in runs} == {RunStatus.LOST}
    assert (
        len({run.driver_host_id for run in successors}) == 1 and successors[0].driver_host_id != runs[0].driver_host_id
    )
    for job, producer in zip(jobs, producers, strict=True):
        drain_and_stop(job, producer, redis)
        assert sink_total(job) == producer.sent, f"{job.name}: every event exactly once across the kill"
