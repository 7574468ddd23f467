"""A driver of its own ends the Python daemons Spark used only to start its query (``workers.spark.python_daemons``):
real ``pyspark.daemon`` processes, started under this test as a JVM starts them."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from workers.spark.python_daemons import end_start_daemons


def daemon(module: str) -> subprocess.Popen:
    """A pyspark daemon serving ``module``, started as Spark starts one: it prints its port once it listens."""
    process = subprocess.Popen(
        [sys.executable, "-m", "pyspark.daemon", module], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        env={**os.environ, "PYTHON_WORKER_FACTORY_SECRET": "test-secret"},
    )  # fmt: skip
    assert process.stdout is not None
    process.stdout.read(4)  # its port: it is up and has set its signal handlers
    return process


def ended(process: subprocess.Popen) -> bool:
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        return False
    return True


def test_the_daemons_of_a_querys_start_are_ended_and_the_pipelines_workers_left_alone():
    lookup = daemon("pyspark.sql.worker.lookup_data_sources")
    plan = daemon("pyspark.sql.worker.plan_data_source_read")
    workers = daemon("pyspark.worker")  # the pipeline's Python: its batches need it
    try:
        assert sorted(end_start_daemons(os.getpid())) == [
            "pyspark.sql.worker.lookup_data_sources",
            "pyspark.sql.worker.plan_data_source_read",
        ]
        assert ended(lookup) and ended(plan), "the daemons of the query's start exit on the signal"
        time.sleep(0.5)
        assert workers.poll() is None, "the daemon of the pipeline's workers is left running"
        assert end_start_daemons(os.getpid()) == [], "nothing more to end"
    finally:
        for process in (lookup, plan, workers):
            if process.poll() is None:
                process.kill()
                process.wait()
