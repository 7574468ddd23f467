"""Spark's Python daemons that serve only a query's start, ended once a driver of its own has no more use for them.

Spark's JVM keeps one Python daemon (``pyspark.daemon``, which forks workers) for each kind of Python work it asks
for, each behind a worker factory that ``SparkEnv`` keeps by kind. A query on a Python data source asks three kinds
only while it starts: looking the source up, creating it and planning its read. Their daemons then idle for the
driver's life, 30–45 MiB each (PSS, measured in docs/benchmarks.md), about a tenth of a job's own driver. The
source's batches run in the streaming source's runner and the pipeline's Python in ``pyspark.worker``, which stay.

A driver of its own runs one query at a time, so once its query has committed a batch it ends those daemons, once:
each factory is stopped (its daemon and idle workers end, as at Spark's own stop) and taken out of ``SparkEnv``'s
map, so that the next query's start (the job's next run in the same driver, ``workers/next_run.py``) gets a new
factory, which starts a new daemon. Killing the daemons alone is not enough: the factory then hands the next start
a dead connection ("Stream closed"). A shared driver, a standby and the spare start queries all the time, and keep
theirs.

When an action that will restart the job is in flight, the driver starts them again (``start_daemons_again``) while
its query still runs, so that the next run's start in the same process does not wait for them
(``workers/next_run.py``, ``RestartReady``).

The map is read through reflection (``SparkEnv.pythonWorkers`` is private), outside the lock Spark takes around it:
call this only while no query is starting in the JVM.
"""

from __future__ import annotations

import logging
from typing import Any

from workers.spark.sources.redis_streams import PlannerPing
from workers.spark.sources.register import register

log = logging.getLogger(__name__)

# the Python work a query on a Python data source asks for only while it starts
START_ONLY = (
    "pyspark.sql.worker.lookup_data_sources",
    "pyspark.sql.worker.create_data_source",
    "pyspark.sql.worker.plan_data_source_read",
)


def _factories(spark: Any) -> Any:
    """``SparkEnv.pythonWorkers``: PythonWorkersKey → PythonWorkerFactory (a Scala mutable map). Through the Class
    object's reflection: py4j's own lookup of SparkEnv's methods needs classes this JVM does not ship."""
    jvm = spark.sparkContext._jvm
    field = jvm.java.lang.Class.forName("org.apache.spark.SparkEnv").getDeclaredField("pythonWorkers")
    field.setAccessible(True)
    return field.get(spark.sparkContext._jsc.sc().env())


def end_start_daemons(spark: Any) -> list[str]:
    """Stop the worker factories (their daemons) of the JVM under ``spark`` that serve a query's start only
    (START_ONLY), and forget them; the kinds ended. Call it once the process's query has started."""
    factories = _factories(spark)
    keys, found = [], factories.keysIterator()
    while found.hasNext():
        keys.append(found.next())
    done = []
    for key in keys:
        kind = next((k for k in START_ONLY if f",{k}," in key.toString()), "")
        if not kind:
            continue
        removed = factories.remove(key)
        if removed.isDefined():
            removed.get().stop()
            done.append(kind)
    if done:
        log.info("ended the Python daemons of the query's start: %s", ", ".join(sorted(done)))
    return sorted(done)


def start_daemons_again(spark: Any) -> None:
    """Start the daemons of a query's start (START_ONLY but the lookup, which Spark does once a JVM) before a query
    needs them: a batch read of PlannerPing creates a Python source and plans its read through the same two kinds of
    Python work. Raises what Spark raised."""
    register(spark, PlannerPing)
    spark.read.format(PlannerPing.name()).load().collect()
