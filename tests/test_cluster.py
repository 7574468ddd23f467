"""Jobs on a real Spark standalone cluster (a master and a worker from the PySpark wheel's ``spark-class``): the
driver runs where the Celery worker starts it, the tasks in an executor on the worker. Killing the executor and the
driver while events flow loses and duplicates nothing; the long form (``-m cluster`` with the rest, or ``-m chaos``)
runs a savepoint, a rescale, the inspector and a restore there."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from dashboard.models import ActionKind, Alert, AlertKind, DriverHost, HostStatus, Run, RunStatus, SavepointStatus
from dashboard.selectors.cluster import CORES_WAIT, free_cores_warning
from dashboard.services.alerts import alerts_evaluate
from dashboard.services.runs import job_request_start, job_request_stop, pid_alive
from tests.conftest import CeleryWorkers, end_workers_and_their_processes, send_events, wait_for
from tests.support import Producer, drain_and_stop, execute, running_with_progress, sink_total
from workers.spark import cluster

pytestmark = [pytest.mark.cluster, pytest.mark.django_db(transaction=True)]


@pytest.fixture(scope="session")
def spark_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[cluster.Standalone]:
    started = cluster.start(tmp_path_factory.mktemp("spark-cluster"), workers=1, cores=2, memory="2g")
    yield started
    cluster.stop(started)


@pytest.fixture
def cluster_worker(spark_cluster: cluster.Standalone, checkpoint_root: Path, tmp_path: Path) -> Iterator[CeleryWorkers]:
    """A Celery worker whose drivers run their jobs on the cluster."""
    env = {"STATEKEEPER_SPARK_MASTER": spark_cluster.master_url, "STATEKEEPER_SPARK_MASTER_UI": spark_cluster.ui_url}
    workers = CeleryWorkers(checkpoint_root, tmp_path / "worker.log", env)
    yield workers
    end_workers_and_their_processes(workers)


def our_app(spark_cluster: cluster.Standalone, job) -> dict:
    """The job's application on the master ({} until it has registered)."""
    apps = cluster.master_status(spark_cluster.ui_url)["activeapps"]
    return next((app for app in apps if app["name"] == f"statekeeper-{job.name}"), {})


@pytest.mark.chaos  # the default run kills an executor and a driver in the shared jobs' test below
def test_a_job_on_the_cluster_survives_an_executor_and_a_driver_kill_exactly_once(
    make_job, redis, stream_name, spark_cluster, cluster_worker
):
    job = make_job(parallelism=1, trigger_interval_seconds=1, restart_strategy="fixed-delay", restart_delay_seconds=1)
    producer = Producer(redis, job.source_stream)
    producer.start()
    job_request_start(job=job)
    run = wait_for(lambda: running_with_progress(job), 180, 0.5, "the first run to commit on the cluster")
    assert run.spark_master == spark_cluster.master_url
    assert run.executors, "the hosts its executors run on are recorded"
    assert our_app(spark_cluster, job)["cores"] == 1, "the job's parallelism is its cores on the cluster"

    # the executor dies mid-stream: the worker starts another, the failed tasks are retried, the job goes on
    executors = cluster.executor_processes(spark_cluster)
    assert len(executors) == 1
    os.kill(executors[0], signal.SIGKILL)
    wait_for(lambda: set(cluster.executor_processes(spark_cluster)) - set(executors), 120, 0.5, "a new executor")
    committed = job.checkpoints.count()
    wait_for(lambda: job.checkpoints.count() >= committed + 3, 120, 0.5, "batches after the executor's loss")
    assert job.runs.get(id=run.id).status == RunStatus.RUNNING, "an executor's loss does not end the run"

    # the driver dies: a new one starts against the cluster from the checkpoint
    os.killpg(run.pid, signal.SIGKILL)
    successor = wait_for(lambda: running_with_progress(job, run.id), 180, 0.5, "a successor on the cluster")
    assert successor.spark_master == spark_cluster.master_url
    wait_for(lambda: not pid_alive(run.pid), 30, 1, "the killed driver to be gone")

    drain_and_stop(job, producer, redis)
    assert sink_total(job) == producer.sent, "every event counted exactly once"
    assert {r.status for r in job.runs.exclude(id=run.id)} == {RunStatus.STOPPED}


def test_shared_jobs_on_the_cluster_share_one_application_and_a_spare_takes_them_over_exactly_once(
    make_job, redis, stream_name, spark_cluster, cluster_worker, settings
):
    """Jobs set to the shared driver run in one application on the cluster, its one executor holding the cores they
    share, as the shared driver shares local[N]; they go on through the loss of that executor; its spare waits holding
    no core, and takes them over after a kill -9 of the shared driver once the master has freed its cores."""
    settings.SPARK_MASTER, settings.SPARK_MASTER_UI = spark_cluster.master_url, spark_cluster.ui_url
    jobs = [
        make_job(driver="shared", standby=True, trigger_interval_seconds=1),
        make_job(driver="shared", trigger_interval_seconds=1, source_stream=f"{stream_name}:second"),
    ]
    producers = [Producer(redis, job.source_stream, rate=50) for job in jobs]
    for job, producer in zip(jobs, producers, strict=True):
        producer.start()
        job_request_start(job=job)
    runs = [wait_for(lambda j=job: running_with_progress(j), 240, 0.5, f"{job.name} to commit") for job in jobs]
    host = DriverHost.objects.get(id=runs[0].driver_host_id)
    assert runs[1].driver_host_id == host.id, "both jobs in the one shared driver"
    assert runs[0].spark_master == f"{spark_cluster.master_url} (shared driver {host.id})"
    assert runs[0].executors, "the hosts of the shared application's executors are recorded on its runs"
    apps = cluster.master_status(spark_cluster.ui_url)["activeapps"]
    assert [(app["name"], app["cores"]) for app in apps] == [(f"statekeeper-shared-{host.id}", 2)], (
        "one application for both jobs, not one each"
    )
    assert len(cluster.executor_processes(spark_cluster)) == 1, "one executor, shared"
    # no core is free now: one more shared job joins the application, one of its own would wait for cores
    assert free_cores_warning(make_job(driver="shared", source_stream=f"{stream_name}:third")) == ""
    assert "0 free core(s) of 2" in free_cores_warning(make_job(driver="own", source_stream=f"{stream_name}:own"))

    spare = wait_for(
        lambda: DriverHost.objects.filter(status=HostStatus.SPARE, message__contains="No warm queries on a cluster")
        .first(),
        240, 1, "the spare shared driver, started",
    )  # fmt: skip
    spare_app = wait_for(
        lambda: next(
            (a for a in cluster.master_status(spark_cluster.ui_url)["activeapps"] if a["name"].endswith(f"-{spare.id}")),
            None,
        ),
        60, 1, "the spare's application on the master",
    )  # fmt: skip
    assert spare_app["cores"] == 0, "the spare holds none of the cluster's cores while it waits"

    # the executor dies mid-stream: the worker starts another, the failed tasks are retried, the jobs go on
    executors = cluster.executor_processes(spark_cluster)
    os.kill(executors[0], signal.SIGKILL)
    wait_for(lambda: set(cluster.executor_processes(spark_cluster)) - set(executors), 120, 0.5, "a new executor")
    committed = {job.id: job.checkpoints.count() for job in jobs}
    wait_for(lambda: all(job.checkpoints.count() >= committed[job.id] + 3 for job in jobs), 120, 0.5,
             "batches after the executor's loss")  # fmt: skip
    assert {r.status for r in Run.objects.filter(id__in=[r.id for r in runs])} == {RunStatus.RUNNING}, (
        "an executor's loss ends no run"
    )

    os.killpg(host.pid, signal.SIGKILL)
    for job, run in zip(jobs, runs, strict=True):
        successor = wait_for(lambda j=job, r=run: running_with_progress(j, r.id), 240, 0.5, f"{job.name} back")
        assert successor.driver_host_id == spare.id, "restarted in the spare"
    apps = cluster.master_status(spark_cluster.ui_url)["activeapps"]
    assert [(app["name"], app["cores"]) for app in apps] == [(f"statekeeper-shared-{spare.id}", 2)]

    for job, producer in zip(jobs, producers, strict=True):
        drain_and_stop(job, producer, redis)
        assert sink_total(job) == producer.sent, f"{job.name}: every event exactly once across the kill"


MOVING_URLS = """from dataclasses import replace

from workers.spark.pipelines import url_counts

PIPELINE = replace(url_counts.PIPELINE, name="moving-urls", title="Requests per URL, from a module a test edits")
"""


@pytest.mark.chaos
def test_a_code_change_moves_the_shared_jobs_on_the_cluster_to_the_next_shared_driver_exactly_once(
    make_job, redis, stream_name, spark_cluster, checkpoint_root, tmp_path, settings
):
    """A shared driver that cannot run a job's code as it is on disk now drains. In local mode it hands that run to a
    driver of its own and runs its other jobs on; on a cluster its application would hold its executor's cores until
    its last job left, and the driver of its own, or the next shared driver, would wait for them as long. There the
    run goes to the next shared driver and every job follows it; the old one ends, freeing the cores."""
    settings.SPARK_MASTER, settings.SPARK_MASTER_UI = spark_cluster.master_url, spark_cluster.ui_url
    code = tmp_path / "moving_urls.py"
    code.write_text(MOVING_URLS)
    workers = CeleryWorkers(checkpoint_root, tmp_path / "worker.log", {
        "STATEKEEPER_SPARK_MASTER": spark_cluster.master_url, "STATEKEEPER_SPARK_MASTER_UI": spark_cluster.ui_url,
        "STATEKEEPER_PIPELINES": "moving_urls:PIPELINE",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH", "")])),
    })  # fmt: skip
    try:
        changed = make_job(pipeline="moving-urls", driver="shared", trigger_interval_seconds=1)
        other = make_job(driver="shared", trigger_interval_seconds=1, source_stream=f"{stream_name}:other")
        producers = {job.id: Producer(redis, job.source_stream, rate=50) for job in (changed, other)}
        for job in (changed, other):
            producers[job.id].start()
            job_request_start(job=job)
        first = {job.id: wait_for(lambda j=job: running_with_progress(j), 240, 0.5, f"{job.name} to commit")
                 for job in (changed, other)}  # fmt: skip
        old = DriverHost.objects.get(id=first[changed.id].driver_host_id)
        assert first[other.id].driver_host_id == old.id

        code.write_text(MOVING_URLS + "# version 2 of the team's package, installed over the first\n")
        job_request_stop(job=changed)
        wait_for(lambda: not changed.runs.filter(status__in=["running", "stopping"]).exists(), 120, 0.5, "the stop")
        job_request_start(job=changed)
        back = {
            job.id: wait_for(lambda j=job: running_with_progress(j, first[j.id].id), 240, 0.5, f"{job.name} moved")
            for job in (changed, other)
        }
        new = DriverHost.objects.get(id=back[changed.id].driver_host_id)
        assert new.id != old.id and back[other.id].driver_host_id == new.id, "both jobs in the next shared driver"
        assert back[changed.id].spark_master == f"{spark_cluster.master_url} (shared driver {new.id})"
        moved = Run.objects.get(id=first[other.id].id)
        assert moved.status == RunStatus.STOPPED and "Moved to the next shared driver" in moved.message, moved.message
        assert "changed since the shared driver loaded it" in moved.message
        old.refresh_from_db()
        assert old.status == HostStatus.GONE and "moved to the next shared driver" in old.message, old.message
        apps = cluster.master_status(spark_cluster.ui_url)["activeapps"]
        assert [(app["name"], app["cores"]) for app in apps] == [(f"statekeeper-shared-{new.id}", 2)]

        for job in (changed, other):
            drain_and_stop(job, producers[job.id], redis)
            assert sink_total(job) == producers[job.id].sent, f"{job.name}: every event exactly once across the move"
    finally:
        end_workers_and_their_processes(workers)


def caught_up(job, entries: int) -> None:
    wait_for(
        lambda: (c := job.checkpoints.order_by("-committed_at").first()) is not None and c.end_offset["n"] >= entries,
        180, 1, f"{job.name} to read {entries} entries",
    )  # fmt: skip


@pytest.mark.chaos
def test_savepoint_rescale_inspector_and_restore_on_the_cluster_keep_every_count(
    make_job, redis, stream_name, spark_cluster, cluster_worker
):
    job = make_job(
        parallelism=1, trigger_interval_seconds=1, state_backend="rocksdb", state_partitions=2,
        max_records_per_batch=300,
    )  # fmt: skip
    first = send_events(redis, stream_name, "url-counts", 900, seed=1)
    job_request_start(job=job)
    caught_up(job, first)
    savepoint = job.savepoints.get(action=execute(job, ActionKind.SAVEPOINT))
    assert savepoint.status == SavepointStatus.VERIFIED

    # more cores and more state partitions: the restarted driver's application holds two cores on the cluster
    before = job.runs.order_by("-id").first()
    execute(job, ActionKind.RESCALE, parallelism=2, state_partitions=3)
    second = send_events(redis, stream_name, "url-counts", 600, seed=2)  # an idle restart would record no batch
    rescaled = wait_for(lambda: running_with_progress(job, before.id), 180, 0.5, "the rescaled job on the cluster")
    assert rescaled.spark_master == spark_cluster.master_url and our_app(spark_cluster, job)["cores"] == 2
    # the Spark worker itself is lost (its JVM and its executor) and another takes its place: the application gets a
    # new executor there, the job goes on with the same driver
    lost = spark_cluster.workers[-1]
    os.killpg(lost.pid, signal.SIGKILL)
    lost.wait(30)
    cluster.start_worker(spark_cluster, cores=2)
    third = send_events(redis, stream_name, "url-counts", 300, seed=3)
    caught_up(job, first + second + third)
    assert job.runs.get(id=rescaled.id).status == RunStatus.RUNNING, "a lost worker does not end the run"
    keys = execute(job, ActionKind.INSPECT_STATE, mode="keys", limit=5).params["result"]
    assert keys["total"] == 8, "8 URLs in the state, read from the files the executors wrote"

    # back to the savepoint: the job replays the second half from there and counts it once
    job_request_stop(job=job)
    wait_for(lambda: not job.runs.filter(status__in=["running", "stopping"]).exists(), 120, 0.5, "the stop")
    restarted_after = job.runs.order_by("-id").first()
    wait_for(lambda: not pid_alive(restarted_after.pid), 60, 0.5, "the stopped driver's process to exit")
    execute(job, ActionKind.RESTORE, savepoint=savepoint.id)  # and it starts the job again
    wait_for(lambda: running_with_progress(job, restarted_after.id), 180, 0.5, "the restored job on the cluster")
    caught_up(job, first + second + third)
    job_request_stop(job=job)
    wait_for(lambda: not job.runs.filter(status__in=["running", "stopping"]).exists(), 120, 0.5, "the stop")
    assert sink_total(job) == first + second + third


@pytest.mark.chaos  # a failure run of three applications in turn, about two minutes
def test_a_job_the_cluster_has_no_cores_for_says_so_warns_before_it_starts_and_alerts(
    make_job, redis, stream_name, spark_cluster, cluster_worker, settings
):
    """The cluster's 2 cores held by one job: another is warned of before its start, its run says it waits for cores
    and who holds them (the driver only logs "Initial job has not accepted any resources"), an alert opens after
    STATEKEEPER_ALERT_CLUSTER_WAIT, and it starts once the first stops. A job in the shared driver waits the same way:
    its run says the shared driver's application asks for its cores, and it starts when they are free."""
    settings.SPARK_MASTER, settings.SPARK_MASTER_UI = spark_cluster.master_url, spark_cluster.ui_url
    holder = make_job(parallelism=2, trigger_interval_seconds=1)
    waiter = make_job(parallelism=1, trigger_interval_seconds=1, source_stream=f"{stream_name}:waiter")
    shared = make_job(driver="shared", trigger_interval_seconds=1, source_stream=f"{stream_name}:shared")
    assert free_cores_warning(waiter) == "", "2 free cores: nothing to warn of"
    job_request_start(job=holder)
    wait_for(lambda: our_app(spark_cluster, holder).get("cores") == 2, 180, 0.5, "the first job to hold both cores")

    warning = free_cores_warning(waiter)
    assert f"0 free core(s) of 2 (held by statekeeper-{holder.name} (2))" in warning and "asks for 1" in warning
    run = job_request_start(job=waiter)
    run = wait_for(lambda: (r := Run.objects.get(id=run.id)).message.startswith(CORES_WAIT) and r, 180, 0.5,
                   "the waiting run to say why")  # fmt: skip
    assert run.status == RunStatus.STARTING
    assert f"held by statekeeper-{holder.name} (2) (0 free)" in run.message, run.message
    shared_run = job_request_start(job=shared)
    shared_run = wait_for(lambda: (r := Run.objects.get(id=shared_run.id)).message.startswith(CORES_WAIT) and r, 180,
                          1, "the shared job's run to say why it waits")  # fmt: skip
    assert shared_run.status in (RunStatus.PENDING, RunStatus.STARTING)
    assert f"the shared driver asks for {settings.SHARED_DRIVER_CORES} core(s)" in shared_run.message, (
        shared_run.message
    )
    alerts_evaluate(now=run.requested_at + timedelta(seconds=30), deliver=lambda *a: None)
    assert not Alert.objects.filter(job=waiter, kind=AlertKind.CLUSTER_WAITING).exists(), "not before the set time"
    alerts_evaluate(now=run.requested_at + timedelta(seconds=settings.ALERT_CLUSTER_WAIT_SECONDS + 5),
                    deliver=lambda *a: None)  # fmt: skip
    alert = Alert.objects.get(job=waiter, kind=AlertKind.CLUSTER_WAITING, resolved_at=None)
    assert f"run #{run.id} starting for" in alert.message and f"statekeeper-{holder.name} (2)" in alert.message

    job_request_stop(job=holder)
    started = wait_for(lambda: (r := Run.objects.get(id=run.id)).status == RunStatus.RUNNING and r, 180, 0.5,
                       "the waiting job to get the freed cores")  # fmt: skip
    assert not started.message.startswith(CORES_WAIT), "the run no longer says it waits"
    job_request_stop(job=waiter)
    shared_started = wait_for(lambda: (r := Run.objects.get(id=shared_run.id)).status == RunStatus.RUNNING and r, 180,
                              1, "the shared job to get the freed cores")  # fmt: skip
    assert not shared_started.message.startswith(CORES_WAIT), "the shared job's run no longer says it waits"
    job_request_stop(job=shared)
    wait_for(lambda: not Run.objects.filter(job__in=[holder, waiter, shared], status__in=["running", "stopping",
             "starting"]).exists(), 120, 0.5, "all three to stop")  # fmt: skip
