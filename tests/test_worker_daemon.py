"""The pipelines' Python workers (workers/spark/worker_daemon.py): a reused worker freezes its imports after its first
task, so that the collection Spark runs after every task walks only what later tasks made (its cost per batch is in
bench/batch_cost.py, not here)."""

from __future__ import annotations

from typing import Any

import pytest


def _worker_state(spark: Any) -> tuple[int, int]:
    """Run one Python task on the session; the pid of the worker that ran it and how many objects it holds frozen."""
    from pyspark.sql import functions as F

    def probe(_):  # no type hints: PySpark would read them as a pandas UDF's
        import gc
        import os

        return f"{os.getpid()} {gc.get_freeze_count()}"

    row = spark.range(1).repartition(1).select(F.udf(probe, "string")("id").alias("state")).collect()[0]
    pid, frozen = row["state"].split()
    return int(pid), int(frozen)


@pytest.mark.spark
def test_a_reused_worker_freezes_what_its_first_task_imported(spark):
    assert spark.sparkContext.getConf().get("spark.python.daemon.module") == "workers.spark.worker_daemon"
    seen: dict[int, list[int]] = {}
    for _ in range(6):  # until one worker has run two tasks (the session may hand the first to a fresh worker)
        pid, frozen = _worker_state(spark)
        seen.setdefault(pid, []).append(frozen)
        if len(seen[pid]) >= 2:
            break
    pid, counts = next((p, c) for p, c in seen.items() if len(c) >= 2)
    # PySpark, PyArrow and the worker's modules: tens of thousands of objects no collection walks again
    assert counts[-1] > 10_000, f"worker {pid}: {counts}"
    assert counts[-1] == max(counts), "frozen once, after the first task, and kept"
