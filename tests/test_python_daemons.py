"""A driver of its own ends the Python daemons Spark used only to start its query (``workers.spark.python_daemons``),
and its next query still starts: the test session's real JVM and daemons, a real Python streaming source."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from dashboard.services.processes import children_by_parent
from workers.spark.python_daemons import START_ONLY, end_start_daemons
from workers.spark.worker_daemon import MODULE as WORKER_DAEMON


def daemons(spark: Any) -> set[str]:
    """The kinds of Python daemon running under the session's JVM (``pyspark.daemon``, and the pipelines' workers'
    ``workers.spark.worker_daemon``)."""
    pid = int(spark.sparkContext._gateway.proc.pid)  # the launcher; the JVM is its process (exec) or its child
    found, todo = set(), [pid]
    children = children_by_parent()
    while todo:
        current = todo.pop()
        try:
            words = [w.decode() for w in Path(f"/proc/{current}/cmdline").read_bytes().split(b"\0") if w]
        except OSError:
            words = []
        for module in ("pyspark.daemon", WORKER_DAEMON):
            if module in words and words[-1] != module:
                found.add(words[words.index(module) + 1])
        todo += children.get(current, [])
    return found


def one_query(spark: Any, checkpoint: Path) -> int:
    """A streaming query on a Python data source until it has committed a batch that read rows; that batch's id."""
    query = (
        spark.readStream.format("ticks").load().writeStream.format("noop")
        .option("checkpointLocation", str(checkpoint)).trigger(processingTime="500 milliseconds").start()
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            progress = query.lastProgress
            if progress and progress["numInputRows"] > 0:
                return int(progress["batchId"])
            assert query.isActive, query.exception()
            time.sleep(0.2)
        raise AssertionError("no batch in 120 s")
    finally:
        query.stop()


@pytest.mark.spark
def test_the_daemons_of_a_querys_start_end_the_pipelines_workers_stay_and_the_next_query_still_starts(spark, tmp_path):
    from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition

    class Reader(DataSourceStreamReader):
        def initialOffset(self) -> dict:
            return {"n": 0}

        def latestOffset(self) -> dict:
            return {"n": int(time.time() * 2)}

        def partitions(self, start: dict, end: dict) -> list:
            return [InputPartition(0)]

        def read(self, partition: Any) -> Any:
            yield (os.getpid(),)

    class Ticks(DataSource):
        @classmethod
        def name(cls) -> str:
            return "ticks"

        def schema(self) -> str:
            return "pid int"

        def streamReader(self, schema: Any) -> Reader:
            return Reader()

    spark.dataSource.register(Ticks)
    one_query(spark, tmp_path / "first")
    started = daemons(spark)
    # the source's lookup once a JVM: at this query unless a test before it in the session ended its daemon
    assert set(START_ONLY[1:]) <= started, started

    assert end_start_daemons(spark) == sorted(set(START_ONLY) & started)
    deadline = time.monotonic() + 20
    while daemons(spark) & set(START_ONLY) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not daemons(spark) & set(START_ONLY), "the start's daemons exited"
    assert daemons(spark) == started - set(START_ONLY) == {"pyspark.worker"}, "the batches' daemon is left running"
    assert end_start_daemons(spark) == [], "nothing more to end"

    # the job's next run in the same driver: its start gets new daemons (the source's lookup is remembered by the
    # session), and its batches run
    one_query(spark, tmp_path / "second")
    again = sorted(set(START_ONLY) & daemons(spark))
    assert "pyspark.sql.worker.create_data_source" in again
    assert end_start_daemons(spark) == again


@pytest.mark.spark
@pytest.mark.django_db
def test_a_driver_of_its_own_starts_its_start_daemons_again_for_a_coming_restart_and_ends_them_if_none_came(
    spark, make_job
):
    from datetime import timedelta

    from django.utils import timezone

    from dashboard.models import Action, ActionKind, ActionStatus, Run, RunStatus
    from workers.next_run import PREVIEW_HINT_SECONDS, RestartReady
    from workers.spark.fork_server import ForkServer

    def wait_daemons(present: bool) -> set[str]:
        deadline = time.monotonic() + 30
        while (set(START_ONLY[1:]) <= daemons(spark)) != present and time.monotonic() < deadline:
            time.sleep(0.2)
        return daemons(spark)

    job = make_job(driver="own")
    run = Run.objects.create(job=job, status=RunStatus.RUNNING)
    end_start_daemons(spark)  # as after the run's first batch
    assert not wait_daemons(False) & set(START_ONLY)
    forks = ForkServer(start=False)  # the driver's, its path given to its JVM at its start
    ready = RestartReady(spark, run, forks)

    def look() -> None:
        ready.looked = 0.0  # looked at once, not after LOOK_SECONDS
        ready.look()
        if ready.starting is not None:
            ready.starting.join(120)

    # the upgrade that started this run is still in flight (until the run's first batch): no restart is coming
    started_it = Action.objects.create(job=job, kind=ActionKind.UPGRADE, status=ActionStatus.RUNNING,
                                       requested_at=run.requested_at - timedelta(seconds=5))  # fmt: skip
    look()
    assert ready.starting is None and not daemons(spark) & set(START_ONLY)
    assert forks.process is None, "no fork server while no restart is coming"
    Action.objects.filter(id=started_it.id).update(status=ActionStatus.SUCCEEDED, finished_at=timezone.now())

    # a rescale asked now will stop this run and start the next in this process: the start's daemons come up now
    rescale = Action.objects.create(job=job, kind=ActionKind.RESCALE, status=ActionStatus.RUNNING)
    look()
    assert set(START_ONLY[1:]) <= wait_daemons(True), "create_data_source and plan_data_source_read are up"
    assert forks.ready(60), "the fork server is up for the next query's source runner and planner"
    server = forks.process

    # refused before it stopped the run: they are ended again, as after a first batch
    Action.objects.filter(id=rescale.id).update(status=ActionStatus.FAILED, finished_at=timezone.now())
    look()
    assert not wait_daemons(False) & set(START_ONLY), "ended again: no restart came"
    assert server is not None and server.poll() is not None and not os.path.exists(forks.path), "closed again"

    # an upgrade preview: not while it runs (the operator waits for its verdict), but once it has answered the
    # upgrade is likely to follow; when none does within PREVIEW_HINT_SECONDS they are ended again
    preview = Action.objects.create(job=job, kind=ActionKind.UPGRADE_PREVIEW, status=ActionStatus.RUNNING)
    look()
    assert ready.starting is None
    Action.objects.filter(id=preview.id).update(status=ActionStatus.SUCCEEDED, finished_at=timezone.now())
    look()
    assert set(START_ONLY[1:]) <= wait_daemons(True)
    assert forks.ready(60)
    # five minutes on, its plan still stands for the upgrade (which then stops the job at once): still ready
    Action.objects.filter(id=preview.id).update(finished_at=timezone.now() - timedelta(seconds=300))
    look()
    assert forks.process is not None and forks.process.poll() is None and set(START_ONLY[1:]) <= daemons(spark)
    answered = timezone.now() - timedelta(seconds=PREVIEW_HINT_SECONDS + 1)
    Action.objects.filter(id=preview.id).update(finished_at=answered)
    look()
    assert not wait_daemons(False) & set(START_ONLY), "no upgrade followed the preview"
    assert forks.process.poll() is not None
    forks.close()
