"""The shared driver: several jobs' queries in one process (one JVM), each still a job of its own: its own run, lease,
token, lock and results; one job's stop or fencing leaves the others running; a kill of the process loses them all,
and the restart strategy brings each back with every event counted once. Its jobs' batches start spread over their
trigger interval: the source's gate, the phases the driver gives, and which plans keep Spark's own trigger."""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import signal
import subprocess
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.db import connection
from django.db.models import F
from django.utils import timezone
from pyspark.sql.streaming.datasource import ReadAllAvailable
from statekeeper_sdk import apply

from dashboard import pipelines
from dashboard.models import DriverHost, HostStatus, Job, Recovery, Run, RunStatus
from dashboard.services.hosts import spare_warms
from dashboard.services.lease import lease_acquire
from dashboard.services.processes import exited_within
from dashboard.services.runs import job_request_start, job_request_stop, pid_alive
from dashboard.services.takeover import crash_take_over
from tests.conftest import DriverThread, read_through, send_events, wait_for
from tests.support import Producer, drain_and_stop, running_with_progress, sink_total
from workers.host import STANDBY_FIRST_SECONDS, SharedDriver, phase_gap, spread_phase
from workers.spark.query import JobSpec, events_frame, runs_without_data, session_settings, spread_trigger
from workers.spark.sources.redis_streams import RedisStreamReader

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
    viewer = as_role("viewer")
    page = viewer.get(f"/jobs/{first.name}/").content.decode()
    assert f"the shared driver #{host.id} (pid {host.pid}" in page, "the overview says where the query runs"
    assert f"{second.name}, {third.name}" in page or f"{third.name}, {second.name}" in page, "and beside which jobs"
    # each run's heartbeat carries the one JVM's heap: the same figures for every job in it, of its 2g
    heaps = wait_for(
        lambda: {(r.heap_after_gc_bytes, r.heap_max_bytes) for r in Run.objects.filter(id__in=[r.id for r in runs])}
        if all(Run.objects.filter(id__in=[r.id for r in runs]).values_list("heap_max_bytes", flat=True)) else None,
        30, 0.5, "the runs' heap figures",
    )  # fmt: skip
    assert len(heaps) == 1, f"one JVM, one heartbeat for all its runs: {heaps}"
    ((after_gc, maximum),) = heaps
    assert 1.5 * 2**30 <= maximum <= 2 * 2**30 and 2**20 < after_gc < maximum
    page = viewer.get(f"/jobs/{first.name}/").content.decode()
    assert re.search(r"heap [0-9.]+ MB of 2\.0 GB after GC", page), "the overview shows it"

    # their batches start at phases of the 1 s interval a poll (250 ms) apart, not on one tick of the clock (when their
    # batches take less than the interval: the density benchmark measures it, a loaded test machine would not)
    text = Path(host.log_path).read_text()
    phases = [float(re.search(rf"{job.name}: batches start ([0-9.]+) s into each 1 s", text)[1]) for job in (first, second, third)]  # fmt: skip
    assert all(phase_gap(a, b, 1.0) >= 0.25 for i, a in enumerate(phases) for b in phases[i + 1 :]), phases

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


@pytest.mark.chaos  # kill -9 of the serving driver, about a minute; the default suite's kill of a shared driver and the spare's takeover is tests/test_cluster.py's
def test_a_spare_shared_driver_stands_behind_the_shared_jobs_and_takes_them_when_the_serving_one_dies(
    make_job, redis, stream_name, celery_worker, as_role, settings
):
    (job,) = shared_jobs(
        make_job, stream_name, 1, standby=True, restart_strategy="fixed-delay", restart_delay_seconds=0
    )
    # beside it, a job without standby in the same shared driver: lost in the same crash, restarted in the spare
    (other,) = shared_jobs(make_job, f"{stream_name}-other", 1, restart_strategy="fixed-delay", restart_delay_seconds=0)
    producer, other_producer = (
        Producer(redis, job.source_stream, rate=50),
        Producer(redis, other.source_stream, rate=50),
    )
    producer.start()
    other_producer.start()
    job_request_start(job=job)
    job_request_start(job=other)
    run = wait_for(lambda: running_with_progress(job), 180, 0.5, "the job to commit")
    other_run = wait_for(lambda: running_with_progress(other), 180, 0.5, "the other job to commit")
    spare = wait_for(
        lambda: DriverHost.objects.filter(status=HostStatus.SPARE, message__contains="warm for url-counts (memory)")
        .first(),
        180, 0.5, "a spare shared driver with its warm query for the job's pipeline",
    )  # fmt: skip
    assert not job.standbys.exists(), "no standby process of its own: the spare stands behind the shared jobs"
    scratch = settings.CHECKPOINT_ROOT / ".scratch" / f"spare-{spare.id}-0"
    assert (scratch / "commits").is_dir(), "the warm query ran batches of its own, on a checkpoint of its own"
    page = as_role("viewer").get(f"/jobs/{job.name}/").content.decode()
    assert f"the spare shared driver #{spare.id}" in page and "warm for url-counts (memory)" in page

    os.killpg(run.pid, signal.SIGKILL)
    killed, killed_at = time.monotonic(), timezone.now()
    successor = wait_for(lambda: running_with_progress(job, run.id), 120, 0.5, "the job back")
    print(f"kill -9 of the shared driver to the job committing in the spare: {time.monotonic() - killed:.1f} s")
    assert (successor.driver_host_id, successor.pid) == (spare.id, spare.pid), "restarted in the spare's process"
    other_successor = wait_for(lambda: running_with_progress(other, other_run.id), 120, 0.5, "the other job back")
    assert other_successor.driver_host_id == spare.id
    # the job with standby on went first: the other's query started once it had committed its first batch there (or
    # once STANDBY_FIRST_SECONDS had passed, on a host too slow for that)
    first = successor.checkpoints.order_by("batch_id").first()
    first_done = first.committed_at + timedelta(milliseconds=first.duration_ms)
    turn = min(first_done, killed_at + timedelta(seconds=STANDBY_FIRST_SECONDS)) - timedelta(seconds=0.5)
    assert other_successor.started_at >= turn, (other_successor.started_at, first_done)
    log_text = Path(spare.log_path).read_text()
    assert re.search(rf"run {other_successor.id}: started [0-9.]+ s after the jobs with standby on", log_text)
    assert DriverHost.objects.get(id=spare.id).status == HostStatus.SERVING
    wait_for(lambda: not scratch.exists(), 60, 0.5, "the warm query stopped once the spare serves")
    assert not redis.exists(f"statekeeper:warmup:spare-{spare.id}-0"), "and its scratch input removed"
    wait_for(lambda: DriverHost.objects.filter(status=HostStatus.SPARE).exclude(id=spare.id).exists(), 60, 0.5,
             "a new spare behind it")  # fmt: skip
    drain_and_stop(job, producer, redis)
    assert sink_total(job) == producer.sent, "every event exactly once across the kill"
    drain_and_stop(other, other_producer, redis)
    assert sink_total(other) == other_producer.sent, "the other job's too"
    wait_for(lambda: not DriverHost.objects.filter(status=HostStatus.SPARE).exists(), 30, 0.5,
             "the spare ended with no shared job running")  # fmt: skip


def waiting(target) -> threading.Thread:
    def run() -> None:
        try:
            target()
        finally:
            connection.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_takeovers_other_jobs_start_once_the_jobs_with_standby_on_have_committed_there(
    make_job, settings, monkeypatch
):
    """The order a spare's takeover starts a crash's jobs in (``SharedDriver._standby_jobs_first``), on real rows:
    a job without standby waits while a job with standby on is lost and not yet restarted, and while its run here has
    not committed; then at once. A job with standby on that never comes back holds the others for
    STANDBY_FIRST_SECONDS at the most."""
    from workers import host as host_module

    dead = DriverHost.objects.create(host=settings.HOST_ID, status=HostStatus.GONE, pid=1)
    spare = DriverHost.objects.create(host=settings.HOST_ID, status=HostStatus.SERVING, pid=os.getpid())
    first, other = make_job(driver="shared", standby=True), make_job(driver="shared")
    for job in (first, other):
        Run.objects.create(job=job, status=RunStatus.LOST, driver_host=dead, ended_at=timezone.now())
    other_run = Run.objects.create(job=other, status=RunStatus.STARTING, driver_host=spare)
    driver = SharedDriver(spare.id)
    driver.took_over_at = time.monotonic()
    stop = threading.Event()

    other_waits = waiting(lambda: driver._standby_jobs_first(other_run.id, stop))
    time.sleep(1.0)
    assert other_waits.is_alive(), "the job with standby on is lost and not restarted yet: the other waits"
    first_run = Run.objects.create(job=first, status=RunStatus.STARTING, driver_host=spare)
    driver.threads[first_run.id] = threading.current_thread()  # taken by the spare's main loop
    driver.standby_first.add(first_run.id)
    time.sleep(0.5)
    assert other_waits.is_alive(), "its run here has not committed a batch: the other still waits"
    began = time.monotonic()
    driver.standby_first.discard(first_run.id)  # its first batch committed (``JobDriver.on_first_batch``)
    other_waits.join(2)
    assert not other_waits.is_alive() and time.monotonic() - began < 1.0, "then the other starts at once"

    # a job with standby on lost and never restarted (its restart refused, say): the others wait a bounded time
    Run.objects.filter(id=first_run.id).delete()
    driver.took_over_at = time.monotonic()
    monkeypatch.setattr(host_module, "STANDBY_FIRST_SECONDS", 1.5)
    began = time.monotonic()
    driver._standby_jobs_first(other_run.id, stop)
    assert 1.3 < time.monotonic() - began < 3.0

    # no job with standby on in the crash (or it has committed): no wait at all, and none outside a takeover
    Run.objects.create(job=first, status=RunStatus.RUNNING, driver_host=spare)
    began = time.monotonic()
    driver._standby_jobs_first(other_run.id, stop)
    assert time.monotonic() - began < 0.5
    driver.took_over_at = time.monotonic() - host_module.TAKEOVER_SECONDS - 1
    assert not driver._in_takeover()


def test_a_process_exit_wakes_its_watcher_at_once_and_a_live_one_holds_it_for_the_time_given():
    sleeper = subprocess.Popen(["sleep", "60"])
    began = time.monotonic()
    assert not exited_within(sleeper.pid, 0.3)
    assert 0.25 < time.monotonic() - began < 1.0
    threading.Timer(0.3, sleeper.kill).start()  # a zombie until reaped below: it counts as exited
    began = time.monotonic()
    assert exited_within(sleeper.pid, 10.0)
    assert time.monotonic() - began < 1.0, "woken as it exited, not at the end of the wait"
    sleeper.wait()
    assert exited_within(sleeper.pid, 10.0) and exited_within(None, 10.0)


def crashed_beside_a_spare(host: str) -> tuple[DriverHost, DriverHost]:
    """A serving shared driver whose process has exited, and a spare beating beside it (this process)."""
    gone = subprocess.Popen(["sleep", "60"])
    gone.kill()
    gone.wait()
    dead = DriverHost.objects.create(host=host, status=HostStatus.SERVING, pid=gone.pid)
    spare = DriverHost.objects.create(host=host, status=HostStatus.SPARE, pid=os.getpid(), heartbeat_at=timezone.now())
    return dead, spare


def test_a_spare_takes_a_crash_over_itself_and_launches_the_standby_jobs_restart_first(make_job, settings):
    """``crash_take_over``, on real rows: the crashed shared driver marked gone, its runs lost as a host crash (no
    restart delay), and their restarts requested and launched into the spare, which serves from then on: the job with
    standby on first, though it is the newer job."""
    dead, spare = crashed_beside_a_spare(settings.HOST_ID)
    strategy = {"driver": "shared", "restart_strategy": "fixed-delay", "restart_delay_seconds": 30}
    other, standby = make_job(**strategy), make_job(standby=True, **strategy)
    lost = {}
    for job in (other, standby):
        token = lease_acquire(job_id=job.id)
        lost[job.id] = Run.objects.create(
            job=job, status=RunStatus.RUNNING, driver_host=dead, host=settings.HOST_ID, pid=dead.pid,
            fencing_token=token, started_at=timezone.now(),
        )  # fmt: skip

    seen = []  # at each launch: whether each job's failure is recorded yet, and whether its restart is launched

    def launched() -> None:
        seen.append({
            job.id: (Recovery.objects.filter(failed_run=lost[job.id]).exists(),
                     Run.objects.filter(job=job, status=RunStatus.STARTING).exists())
            for job in (other, standby)
        })  # fmt: skip

    notes = crash_take_over(dead.id, launched)

    assert DriverHost.objects.get(id=dead.id).status == HostStatus.GONE
    assert DriverHost.objects.get(id=spare.id).status == HostStatus.SERVING, "the first launch made the spare serve"
    for job in (other, standby):
        old = Run.objects.get(id=lost[job.id].id)
        assert old.status == RunStatus.LOST and old.recovery.host_crash, notes
        assert old.message == f"The shared driver #{dead.id} ended: it exited without reporting (killed or crashed)."
        assert old.recovery.restart_at == old.recovery.failed_at, "a crash of the shared driver restarts at once"
    restarts = {job.id: Run.objects.get(id=lost[job.id].recovery.restart_run_id) for job in (other, standby)}
    for run in restarts.values():
        assert (run.status, run.driver_host_id, run.pid) == (RunStatus.STARTING, spare.id, spare.pid), notes
    assert restarts[standby.id].id < restarts[other.id].id, "the job with standby on was restarted first"
    assert seen == [
        {standby.id: (True, True), other.id: (False, False)},  # launched before the other's failure was recorded
        {standby.id: (True, True), other.id: (True, True)},
    ]
    again = crash_take_over(dead.id)
    assert not [n for n in again if "lost" in n or "run " in n], "a second look finds nothing more to do"


def test_a_spares_takeover_is_the_crashs_from_its_first_moment_and_runs_once(make_job, settings):
    """Whichever of the spare's watch thread and main loop finds the crash, the takeover runs once, and the runs the
    spare takes from then on are the crash's (the jobs with standby on first), before its main loop sees itself
    serving."""
    dead, spare = crashed_beside_a_spare(settings.HOST_ID)
    driver = SharedDriver(spare.id)
    assert not driver._in_takeover()
    driver._serving_gone(dead.id, dead.pid)
    assert driver._in_takeover() and driver.wake.is_set(), "its main loop woken, the crash's runs to take"
    assert DriverHost.objects.get(id=dead.id).status == HostStatus.GONE
    driver.wake.clear()
    driver._serving_gone(dead.id, dead.pid)
    assert not driver.wake.is_set(), "found a second time: nothing done again"


def test_a_progress_listener_tells_once_at_its_querys_first_batch_not_at_an_idle_trigger_or_another_query():
    from workers.progress import ProgressListener

    class Recorder:
        job_id = 0

        def on_progress(self, progress: dict) -> None:
            pass

    listener = ProgressListener(Recorder())  # type: ignore[arg-type]
    listener.query_id = "q-1"
    told = []
    listener.on_first_batch = lambda: told.append(1)
    listener._deliver('{"id": "q-1", "batchId": 4, "durationMs": {"triggerExecution": 3}}')  # an idle trigger
    listener._deliver('{"id": "q-2", "batchId": 9, "durationMs": {"addBatch": 50}}')  # another query in its session
    assert told == []
    listener._deliver('{"id": "q-1", "batchId": 4, "durationMs": {"addBatch": 120, "triggerExecution": 400}}')
    listener._deliver('{"id": "q-1", "batchId": 5, "durationMs": {"addBatch": 90}}')
    assert told == [1], "told once, at its first batch"


def test_a_spare_warms_one_query_per_pipeline_and_backend_in_the_serving_driver_or_none_when_switched_off(
    make_job, settings
):
    serving = DriverHost.objects.create(host=settings.HOST_ID, status=HostStatus.SERVING)
    no_standby = make_job(name="adhoc", driver="shared", standby=False, state_backend="rocksdb-incremental")
    orders = make_job(name="orders", driver="shared", standby=True, state_backend="rocksdb")
    orders_too = make_job(name="orders-eu", driver="shared", standby=True, state_backend="rocksdb")
    in_memory = make_job(name="clicks", driver="shared", standby=True, state_backend="memory")
    stopped = make_job(
        name="stopped", driver="shared", standby=False, state_backend="memory", pipeline="order-state-machine-v2"
    )
    for job in (orders, orders_too, in_memory, no_standby):
        Run.objects.create(job=job, status=RunStatus.RUNNING, driver_host=serving)
    Run.objects.create(job=stopped, status=RunStatus.STOPPED, driver_host=serving)
    warmed = [(job.pipeline, job.state_backend) for job in spare_warms()]
    # the crash takes the job without a standby down too, and it restarts in the spare: warmed, after those with one
    assert warmed == [
        (orders.pipeline, "rocksdb"),
        (orders.pipeline, "memory"),
        (orders.pipeline, "rocksdb-incremental"),
    ]
    settings.SPARE_WARM_QUERIES = False  # the operator chose 0.55 GB for the spare over a warm takeover
    assert spare_warms() == []


def test_a_spare_whose_jobs_code_changed_on_disk_ends_so_that_a_new_one_imports_it(make_job, settings):
    serving = DriverHost.objects.create(host=settings.HOST_ID, status=HostStatus.SERVING)
    job = make_job(name="orders", driver="shared", standby=True)
    Run.objects.create(job=job, status=RunStatus.RUNNING, driver_host=serving)
    spare = SharedDriver(DriverHost.objects.create(host=settings.HOST_ID, status=HostStatus.SPARE).id)
    on_disk = pipelines.code_version(job.pipeline)
    spare.loaded = {job.pipeline: on_disk}
    assert spare.retire_if_stale() is False, "the code it imported is the code on disk"
    spare.loaded = {job.pipeline: dataclasses.replace(on_disk, code_hash="an-older-release")}
    assert spare.retire_if_stale() is True and spare.spare_over.is_set(), "its warm queries stop"
    ended = DriverHost.objects.get(id=spare.host.id)
    assert ended.status == HostStatus.GONE
    assert (
        ended.message
        == f"Ended: the console's code (which holds the built-in pipeline {job.pipeline!r}) changed since the shared "
        "driver loaded it; a new spare imports it."
    )
    team = pipelines.CodeVersion("orders_team.pipelines:ORDERS", "orders-team 2.1.0", "a-hash")
    assert pipelines.whose_code("team-orders", team) == "the code of 'team-orders'", "a team's own package is named"
    # a launch made it the serving one first: it serves, and hands such a run to a driver of its own
    promoted = SharedDriver(DriverHost.objects.create(host=settings.HOST_ID, status=HostStatus.SPARE).id)
    promoted.loaded = {job.pipeline: dataclasses.replace(on_disk, code_hash="an-older-release")}
    DriverHost.objects.filter(id=promoted.host.id).update(status=HostStatus.SERVING)
    assert promoted.retire_if_stale() is False
    assert DriverHost.objects.get(id=promoted.host.id).status == HostStatus.SERVING


def test_a_gated_source_admits_new_entries_once_an_interval_and_the_first_call_at_once(redis, stream_name, settings):
    # the interval began 30 s ago and ends in 30 s
    reader = RedisStreamReader(
        {
            "url": settings.REDIS_URL,
            "stream": stream_name,
            "format": pipelines.get("url-counts").payload.to_option(),
            "admiteveryms": "60000",
            "admitphasems": str(round(time.time() * 1000 - 30_000) % 60_000),
        }
    )
    start = {"id": "0-0", "n": 0}
    send_events(redis, stream_name, "url-counts", 5)
    first = reader.latestOffset(start, ReadAllAvailable())
    assert first["n"] == 5, "a restarted job's first batch does not wait for its phase"
    send_events(redis, stream_name, "url-counts", 5)
    assert reader.latestOffset(first, ReadAllAvailable()) == first, "no second batch of new entries in one interval"
    reader.admit_phase -= 60_000  # as if the interval had passed
    assert reader.latestOffset(first, ReadAllAvailable())["n"] == 10


def test_the_shared_driver_gives_each_new_job_the_least_crowded_phase():
    phases: list[float] = []
    for _ in range(8):
        phases.append(spread_phase(2.0, phases))
    assert sorted(phases) == [0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75], "eight jobs, eight 250 ms ticks of 2 s"
    assert phases[:2] == [0.0, 1.0], "the second job half an interval from the first"
    for _ in range(32):
        phases.append(spread_phase(10.0, phases[8:]))
    assert collections.Counter(phases[8:]).most_common(1)[0][1] == 2, "forty jobs of 10 s: two on each 500 ms tick"


def test_a_job_that_keeps_sparks_tick_is_counted_on_it_and_the_next_job_keeps_away(settings):
    """A windowed job in the shared driver was given a phase but starts its batches on Spark's tick (its plan is not
    spread): the next job's phase is chosen against the tick it really uses."""
    host = SharedDriver(DriverHost.objects.create(host=settings.HOST_ID, status=HostStatus.SERVING).id)
    assert [host.take_phase(1, 2.0), host.take_phase(2, 2.0)] == [0.0, 1.0]
    host.phase_used(1, 2.0, 0.0)  # spread, at its phase
    host.phase_used(2, 2.0, None)  # not spread: on Spark's tick, 0
    assert host.take_phase(3, 2.0) == 1.0, "half an interval from the two batches that start on the tick"


class WatchedGate(threading.BoundedSemaphore):
    """A start gate of one that notes each take, and at each give the queries of the session that have made progress."""

    def __init__(self, spark) -> None:
        super().__init__(1)
        self.spark, self.events = spark, []

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        taken = super().acquire(blocking, timeout)
        self.events.append(("take", set()))
        return taken

    def release(self, n: int = 1) -> None:
        self.events.append(("give", {q.name for q in self.spark.streams.active if q.lastProgress is not None}))
        super().release(n)


@pytest.mark.spark
@pytest.mark.django_db(transaction=True)
def test_a_start_gate_lets_the_next_query_start_only_once_the_first_has_committed(spark, make_job, redis, stream_name):
    """On a cluster a shared driver starts as many queries at a time as it has cores (no fork server there for the
    Python processes of their starts): a query holds the gate from its start to its first committed batch."""
    jobs = [make_job(parallelism=1, trigger_interval_seconds=0.5, source_stream=f"{stream_name}:{n}") for n in (1, 2)]
    for job in jobs:
        send_events(redis, job.source_stream, "url-counts", 20, seed=1)
    gate = WatchedGate(spark)
    drivers = [DriverThread(spark, job, start_gate=gate) for job in jobs]
    try:
        for job in jobs:
            wait_for(lambda j=job: read_through(j, redis, 20), 180, 0.5, f"{job.name} to read its events")
    finally:
        for driver in drivers:
            driver.stop()
    assert [kind for kind, _ in gate.events] == ["take", "give", "take", "give"], gate.events
    first = next(job.name for job in jobs if job.name in gate.events[1][1])
    assert gate.events[1][1] == {first}, "the first gave the gate once it had committed, before the second started"
    assert gate.acquire(blocking=False), "given back by both"


def spread_spec(pipeline: str, **values: Any) -> JobSpec:
    return JobSpec(**({
        "job_id": 1, "name": "spread", "pipeline": pipeline, "stream": "s", "redis_url": "redis://127.0.0.1:6379/0",
        "backend": "memory", "trigger_seconds": 2, "partitions": 2, "parallelism": 1, "checkpoint": "/nonexistent",
        "batches_retained": 10, "max_records": 0, "dead_letter": "d", "phase_seconds": 0.5,
    } | values))  # fmt: skip


@pytest.mark.parametrize(("pipeline", "spread"), [
    ("url-counts", True), ("minute-windows", False), ("dedup", False), ("customer-spend-daily", False),
    ("order-state-machine", True), ("user-sessions", True), ("user-sessions-timed", False),
])  # fmt: skip
def test_only_a_plan_that_runs_no_batch_without_data_is_spread(spark, pipeline, spread):
    """A watermark (minute-windows, dedup; customer-spend-daily's event-time timers) or a processing-time clock
    (user-sessions-timed's timers) keeps Spark's tick; transformWithState without a clock (order-state-machine,
    user-sessions) is spread."""
    spec = spread_spec(pipeline)
    chosen = pipelines.get(pipeline)
    output = apply(chosen, events_frame(spark, spec, chosen), pipelines.parameter_values(pipeline, {}))
    assert spread_trigger(spec, output) is spread
    assert spread_trigger(dataclasses.replace(spec, trigger_seconds=0.5), output) is False, "too short to spread"


@pytest.mark.spark
@pytest.mark.parametrize(("pipeline", "idle"), [("order-state-machine", "none"), ("minute-windows", "after data"),
                                                ("user-sessions-timed", "every poll")])  # fmt: skip
@pytest.mark.usefixtures("spark_settings_kept")
def test_what_spark_runs_without_new_data_is_what_the_plan_is_judged_by(
    spark, settings, redis, stream_name, tmp_path, pipeline, idle
):
    """Polled as a spread job is (every 250 ms), after one batch of events: a transformWithState without a clock runs
    no batch without data, a watermark one (its move), a processing-time clock one at every poll."""
    chosen = pipelines.get(pipeline)
    spec = spread_spec(
        pipeline, stream=stream_name, redis_url=settings.REDIS_URL, backend="rocksdb", checkpoint=str(tmp_path / "c")
    )
    # on the shared session, its settings put back after (a new session cannot register the source again while the
    # default one has it)
    session_settings(spark, spec, chosen)
    output = apply(chosen, events_frame(spark, spec, chosen), pipelines.parameter_values(pipeline, {}))
    send_events(redis, stream_name, pipeline, 20)
    query = (
        output.writeStream.outputMode(chosen.output_mode).foreachBatch(lambda frame, batch: frame.count())
        .option("checkpointLocation", spec.checkpoint).trigger(processingTime="0.25 seconds").start()
    )  # fmt: skip
    try:
        data = wait_for(lambda: next((p for p in query.recentProgress if p["numInputRows"] == 20), None), 120, 0.5,
                        "the events' batch")["batchId"]  # fmt: skip

        def ran_after() -> set[int]:  # the batches run after it (an idle trigger's progress event has no addBatch)
            return {p["batchId"] for p in query.recentProgress if p["batchId"] > data and "addBatch" in p["durationMs"]}

        least = {"none": 0, "after data": 1, "every poll": 4}[idle]
        wait_for(lambda: len(ran_after()) >= least, 60, 0.25, f"{least} batches without data")  # a loaded host's
        time.sleep(2.5)  # ten polls more
        without_data, seen = ran_after(), [(p["batchId"], p["numInputRows"]) for p in query.recentProgress]
    finally:
        query.stop()
    counts = {"none": len(without_data) == 0, "after data": len(without_data) == 1, "every poll": len(without_data) > 4}
    assert counts[idle], f"{len(without_data)} batches without data: {seen}"
    assert runs_without_data(output) is (idle != "none")
