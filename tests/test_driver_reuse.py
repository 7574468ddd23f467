"""A job with a driver of its own keeps its driver process across an upgrade or a rescale (workers/next_run.py): the
new run starts in the JVM that ran the old one, with its code loaded, rather than in a new one. A change the process
cannot run (another Spark master, code changed on disk) gets a new driver; a stop that no restart follows ends it."""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from dashboard.checkpoint_dir.files import committed_batches
from dashboard.models import Action, ActionKind, ActionStatus, Job, Run, RunStatus
from dashboard.services.actions import action_request
from dashboard.services.processes import children_by_parent
from dashboard.services.runs import job_request_start, job_request_stop, pid_alive, run_holds_process, run_launch
from tests.conftest import wait_for
from tests.support import events_counted, finished, running_with_progress, send, switched_to
from workers.next_run import offer, wait_for_next_run


def caught_up(job: Job, sent: int) -> bool:
    return events_counted(job) == sent


def source_runners_of(driver: int) -> list[tuple[int, bool]]:
    """The streaming source runners (one per query) in the tree of the ``driver`` process, each with whether the
    driver's fork server ran it (``workers/spark/fork_server.py``): Spark's process for it is then the fork client,
    which stays itself only once the server has forked the runner (it becomes the ordinary ``python`` otherwise), and
    the server has a child."""
    children = children_by_parent()
    found, todo, server_children = [], [driver], 0
    while todo:
        pid = todo.pop()
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"pyspark.sql.streaming.python_streaming_source_runner" in command:
            found.append((pid, any(part.endswith(b"/fork_client.py") for part in command)))
        elif command[1:3] == [b"-m", b"workers.spark.fork_server"] and pid in children.get(driver, []):
            server_children = len(children.get(pid, []))
        todo.extend(children.get(pid, []))
    return [(pid, served and server_children > 0) for pid, served in found]


def sessions_job_running(make_job: Any, redis: Any, stream_name: str) -> tuple[Job, Run, int]:
    """A user-sessions job on RocksDB in a driver of its own (local[1]), started and caught up with 200 events."""
    job = make_job(pipeline="user-sessions", state_backend="rocksdb", parallelism=1, trigger_interval_seconds=1)
    sent = send(redis, stream_name, 200, seed=1)
    job_request_start(job=job)
    first = wait_for(lambda: running_with_progress(job), 180, 0.5, "the job to commit")
    wait_for(lambda: caught_up(job, sent), 120, 0.5, "the job to count every event")
    return job, first, sent


@pytest.mark.spark
@pytest.mark.django_db(transaction=True)
def test_an_upgrade_and_a_rescale_of_state_partitions_restart_the_job_in_its_driver(
    make_job, redis, stream_name, celery_worker
):
    job, first, sent = sessions_job_running(make_job, redis, stream_name)

    upgrade = finished(action_request(job=job, kind=ActionKind.UPGRADE, params={"pipeline": "user-sessions-v2"}))
    assert upgrade.status == ActionStatus.SUCCEEDED and switched_to(job, "user-sessions-v2"), [
        upgrade.outcome,
        *job.runs.exclude(error="").values_list("error", flat=True),
    ]
    second = job.runs.get(id=upgrade.params["run"])
    first.refresh_from_db()
    assert second.pid == first.pid and second.log_path == first.log_path, "the same driver process ran version 2"
    assert first.status == RunStatus.STOPPED and first.released_at is not None and first.reusable_until is None
    assert not run_holds_process(first), "the stopped run let go of the checkpoint though its process lives on"
    runner = source_runners_of(first.pid)
    assert runner and all(forked for _, forked in runner), (
        f"version 2's source runner was forked by the driver's fork server, started for the restart: {runner}"
    )
    sent += send(redis, stream_name, 100, seed=2)
    wait_for(lambda: caught_up(job, sent), 180, 0.5, "version 2 to count every event")

    # state partitions 2 → 3: the same Spark master, the same process, the repartitioned state; events arrive while
    # the job is stopped, so the rescale waits for the new run's first batch, and only then copies the savepoint from
    # the checkpoint the job left, and Spark reads it
    rescale = action_request(job=job, kind=ActionKind.RESCALE, params={"state_partitions": 3})
    offline = ["repartition", "check-state"]
    wait_for(lambda: Action.objects.filter(id=rescale.id, step__in=offline).exists(), 120, 0.02, "the job to stop")
    sent += send(redis, stream_name, 100, seed=3)
    rescale = finished(rescale)
    assert rescale.status == ActionStatus.SUCCEEDED, rescale.outcome
    third = job.runs.get(id=rescale.params["run"])
    first_batch = third.checkpoints.order_by("batch_id").first()
    assert first_batch is not None and (
        f"its first batch ({first_batch.batch_id}) committed: Spark loaded the repartitioned state" in rescale.outcome
    ), rescale.outcome
    assert "check-state" not in rescale.memo, "records waited: the first batch showed the state loads, no reader did"
    savepoint = job.savepoints.get(id=rescale.params["savepoint"])
    assert savepoint.status == "verified" and savepoint.created_at >= first_batch.recorded_at, (
        "the savepoint was copied after the new run's first batch, not while the job was stopped"
    )
    left = job.directory / rescale.memo["previous"]
    assert savepoint.batch_id == max(committed_batches(left)), "of the batch the job stopped at, where it stopped"
    assert f"savepoint #{savepoint.id} kept for rollback" in rescale.outcome, rescale.outcome
    steps = [p["step"] for p in rescale.phases]
    assert steps == ["check", "stop", "repartition", "check-state", "apply", "first-batch", "savepoint", "verify",
                     "settle"], steps  # fmt: skip
    wait_for(lambda: running_with_progress(job, after_run=second.id), 180, 0.5, "the rescaled run to commit")
    assert third.pid == first.pid, "a rescale of the state partitions kept the driver"
    wait_for(lambda: caught_up(job, sent), 180, 0.5, "the rescaled run to count every event")
    assert Job.objects.get(id=job.id).state_partitions == 3

    # a plain stop: no restart follows, the driver ends at once
    job_request_stop(job=job)
    wait_for(lambda: not pid_alive(third.pid), 60, 0.5, "the driver to end after a plain stop")
    third.refresh_from_db()
    assert third.status == RunStatus.STOPPED and third.reusable_until is None and third.released_at is None
    assert events_counted(job) == sent, "every event counted once across two restarts"


@pytest.mark.spark
@pytest.mark.chaos  # two JVM starts on top of the test above's path: beyond the default suite's budget
@pytest.mark.django_db(transaction=True)
def test_a_new_parallelism_starts_a_new_driver_and_the_old_one_ends_once_the_new_run_has_the_job(
    make_job, redis, stream_name, celery_worker
):
    job, first, sent = sessions_job_running(make_job, redis, stream_name)

    # parallelism 1 → 2 is local[2]: a JVM of its own, and the old process ends once the new run has it
    wider = finished(action_request(job=job, kind=ActionKind.RESCALE, params={"parallelism": 2}))
    assert wider.status == ActionStatus.SUCCEEDED, wider.outcome
    sent += send(redis, stream_name, 100, seed=4)
    second = wait_for(lambda: running_with_progress(job, after_run=first.id), 240, 0.5, "the wider run to commit")
    assert second.pid != first.pid and second.spark_master == "local[2]"
    wait_for(lambda: not pid_alive(first.pid), 30, 0.5, "the old driver to end")
    wait_for(lambda: caught_up(job, sent), 180, 0.5, "the wider run to count every event")
    job_request_stop(job=job)
    wait_for(lambda: not pid_alive(second.pid), 60, 0.5, "the driver to end after a plain stop")
    assert events_counted(job) == sent, "every event counted once across the move"


@pytest.mark.django_db(transaction=True)
def test_a_stopped_driver_waits_only_while_an_action_restarts_the_job_and_a_launch_before_its_deadline_claims_it(
    make_job, settings
):
    import os

    settings.DRIVER_REUSE_SECONDS = 2
    job = make_job(parallelism=1)
    ended = Run.objects.create(job=job, status=RunStatus.STOPPED, pid=os.getpid(), host=settings.HOST_ID,
                               spark_master="local[1]", log_path="/tmp/driver.log")  # fmt: skip
    assert not offer(ended.id, job.id), "a plain stop: nothing restarts the job"

    upgrade = Action.objects.create(job=job, kind=ActionKind.UPGRADE, status=ActionStatus.RUNNING)
    assert offer(ended.id, job.id)
    ended.refresh_from_db()
    assert ended.released_at is not None and ended.reusable_until > timezone.now()
    ending = threading.Event()
    found: list[int | None] = []
    waiter = threading.Thread(target=lambda: found.append(wait_for_next_run(ended.id, job.id, ending)))
    waiter.start()
    nxt = Run.objects.create(job=job)
    run_launch(run_id=nxt.id)  # no process is started: the waiting driver (this one) is claimed
    waiter.join(10)
    nxt.refresh_from_db()
    assert found == [nxt.id] and nxt.pid == os.getpid() and nxt.log_path == "/tmp/driver.log"
    assert nxt.status == RunStatus.STARTING
    assert Run.objects.get(id=ended.id).reusable_until is None, "claimed once: no second launch may take it"

    # the next stop is offered too; no launch comes within the deadline: the offer is taken back and the wait ends
    Run.objects.filter(id=nxt.id).update(status=RunStatus.STOPPED)
    assert offer(nxt.id, job.id)
    assert wait_for_next_run(nxt.id, job.id, threading.Event()) is None
    assert Run.objects.get(id=nxt.id).reusable_until is None
    # and once the action has ended with no start waiting, the wait ends before the deadline
    settings.DRIVER_REUSE_SECONDS = 60
    assert offer(nxt.id, job.id)
    Action.objects.filter(id=upgrade.id).update(status=ActionStatus.FAILED)
    began = timezone.now()
    assert wait_for_next_run(nxt.id, job.id, threading.Event()) is None
    assert timezone.now() - began < timedelta(seconds=5)


@pytest.mark.django_db(transaction=True)
def test_a_run_its_process_will_not_run_is_moved_to_a_new_driver_of_its_own(make_job, settings, tmp_path):
    from dashboard.models import DriverHost, HostStatus
    from dashboard.services.runs import kill_group, respawn_in_own_driver

    settings.LOG_ROOT = tmp_path
    job = make_job(parallelism=1)
    host = DriverHost.objects.create(
        host=settings.HOST_ID, status=HostStatus.SERVING, pid=1, log_path="/tmp/shared.log"
    )
    run = Run.objects.create(job=job, status=RunStatus.STARTING, driver_host=host, pid=1, log_path=host.log_path,
                             spark_master="local[2] (shared driver)")  # fmt: skip
    pid = respawn_in_own_driver(run)
    try:
        run.refresh_from_db()
        assert run.pid == pid != 1 and run.driver_host_id is None
        assert run.log_path == str(tmp_path / f"{job.name}-run-{run.id}.log") and run.spark_master == "local[1]"
        assert pid_alive(pid), "the new driver process started"
    finally:
        kill_group(pid)
