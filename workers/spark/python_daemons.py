"""Spark's Python daemons that serve only a query's start, ended once a driver of its own has no more use for them.

Spark's JVM keeps one Python daemon (``pyspark.daemon``, which forks workers) for each kind of Python work it asks
for. A query on a Python data source asks three kinds only while it starts: looking the source up, creating it and
planning its read. Their daemons then idle for the driver's life, 30–45 MiB each (PSS, measured in
docs/benchmarks.md), about a tenth of a job's own driver. The source's batches run in the streaming source's runner
and the pipeline's Python in ``pyspark.worker``, which stay.

A driver of its own starts one query, so once that query has committed a batch it ends those daemons, once (SIGTERM:
a daemon ends the idle worker it may still keep, and exits). Were Spark to need one again, it starts it again: its
worker factory restarts a daemon it cannot reach, and discards a dead idle worker. A shared driver, a standby and the
spare start queries all the time, and keep theirs.
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

from dashboard.services.processes import children_by_parent

log = logging.getLogger(__name__)

# the Python work a query on a Python data source asks for only while it starts
START_ONLY = (
    "pyspark.sql.worker.lookup_data_sources",
    "pyspark.sql.worker.create_data_source",
    "pyspark.sql.worker.plan_data_source_read",
)


def _daemon_kind(pid: int) -> str:
    """The worker module a ``pyspark.daemon`` process serves; empty for any other process."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return ""
    words = [word.decode(errors="replace") for word in argv if word]
    if "pyspark.daemon" not in words or words[-1] == "pyspark.daemon":
        return ""
    return words[words.index("pyspark.daemon") + 1]


def end_start_daemons(jvm_pid: int) -> list[str]:
    """End the daemons under the JVM ``jvm_pid`` that serve a query's start only (START_ONLY); the kinds ended. Call it
    once the process's one query has started."""
    done = []
    for pid in children_by_parent().get(jvm_pid, []):
        if (kind := _daemon_kind(pid)) not in START_ONLY:
            continue
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            continue  # ended meanwhile
        done.append(kind)
    if done:
        log.info("ended the Python daemons of the query's start: %s", ", ".join(done))
    return done
