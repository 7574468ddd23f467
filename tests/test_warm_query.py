"""A standby's warm query rehearses a takeover on a scratch checkpoint. A takeover of a rocksdb-incremental job loads
each partition's newest snapshot and replays the change files after it: the rehearsal's restart must do the same, or
the successor's first batch runs that code cold."""

from __future__ import annotations

import os
import threading
import time

import pytest

from dashboard.models import Job
from tests.support import children_of
from workers.warm_query import WarmQuery


def state_files(scratch, suffix: str) -> list[str]:
    return sorted(p.name for p in (scratch / "state").rglob(f"*{suffix}"))


@pytest.mark.spark
@pytest.mark.django_db
def test_an_incremental_jobs_warm_up_restarts_on_a_snapshot_and_a_change_file(spark, make_job, redis):
    job: Job = make_job(state_backend="rocksdb-incremental", parallelism=1)
    warm = WarmQuery(spark, job, "test-incremental")
    try:
        warm.start()
        # the first run, change files off, put a snapshot on the checkpoint; the second wrote a change file on it
        assert any(name.startswith("1_") for name in state_files(warm.scratch, ".zip")), state_files(warm.scratch, "")
        assert any(name.startswith("2_") for name in state_files(warm.scratch, ".changelog")), state_files(
            warm.scratch, ""
        )
        progress = warm.query.lastProgress
        assert warm.query.isActive and progress["batchId"] == 2, "the third run ran its batch on that state"
        assert progress["stateOperators"][0]["numRowsTotal"] > 0, "with the rows it loaded"
    finally:
        warm.stop()
    assert not warm.scratch.exists(), "its scratch checkpoint removed"


@pytest.mark.spark
@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("spark_settings_kept")
def test_a_warm_up_of_a_pipeline_with_processing_time_timers_ends_once_its_batches_have_read(spark, make_job, redis):
    """Such a plan runs a batch at every trigger, new data or not: Spark's ``processAllAvailable`` waits for a trigger
    that runs none, and never returned, so a standby (or green's driver of its own) for such a job never warmed up."""
    job: Job = make_job(pipeline="user-sessions-timed", state_backend="rocksdb", parallelism=1)
    warm = WarmQuery(spark, job, "test-timers")
    warming = threading.Thread(target=warm.start, daemon=True)
    try:
        warming.start()
        warming.join(240)
        assert not warming.is_alive(), "the warm-up did not end"
        assert warm.query.isActive and any(p.numInputRows > 0 for p in warm.query.recentProgress), "its batch read"
    finally:
        warm.stop()


def planner_processes() -> set[int]:
    """The Python processes Spark keeps to create a Python data source and plan its reads: children of the daemons
    (under this test's JVM) that fork them."""
    found, todo = set(), [os.getpid()]
    while todo:
        for pid, cmdline in children_of(todo.pop()):
            argv = cmdline.split(b"\0")
            if b"pyspark.daemon" in argv and any(b"data_source" in arg for arg in argv):
                found |= {child for child, _ in children_of(pid)}
            else:
                todo.append(pid)
    return found


@pytest.mark.soak  # waits out Spark's 60 s idle timeout for a Python process: about 80 s, with -m soak
@pytest.mark.spark
@pytest.mark.django_db
def test_the_warm_query_keeps_sparks_planner_processes_past_their_idle_timeout(spark, make_job, redis):
    job: Job = make_job(parallelism=1)
    warm = WarmQuery(spark, job, "test-planner")
    try:
        warm.start()
        kept = planner_processes()
        assert kept, "the warm query's start left a planner process for the next call"
        for _ in range(2):
            time.sleep(36)
            warm.keep_warm()
        assert planner_processes() & kept, "72 s later the same processes serve a takeover's start and first batch"
    finally:
        warm.stop()
