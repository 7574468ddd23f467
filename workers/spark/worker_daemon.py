"""Spark's Python worker daemon for the pipelines' tasks (``spark.python.daemon.module``): ``pyspark.daemon`` with
the garbage collector's full sweep after each task made cheap.

A reused Python worker runs ``gc.collect()`` after every task (``pyspark/daemon.py``). With PySpark, PyArrow, the SDK
and a pipeline's modules imported, that full collection walks every object the worker holds, most of them the imports'
own: the biggest part of a small batch's Python cost, more than reading and parsing its events (bench/batch_cost.py,
docs/benchmarks.md). Here each forked worker, after its first task (the one that imported what its tasks need),
collects once and freezes what is left (``gc.freeze``): later collections skip those objects and walk only what later
tasks made.

Spark names this module for its ``pyspark.worker`` daemon only, the one that runs sources' reads and pipelines' Python;
its other daemons (a query's start) keep ``pyspark.daemon``. Nothing is imported before the fork that
``pyspark.daemon`` does not import itself: PyArrow and pandas start threads when imported, which a fork must not copy.
"""

from __future__ import annotations

import gc
import socket

from pyspark import daemon

MODULE = "workers.spark.worker_daemon"

_run_task = daemon.worker
_frozen = False  # in a forked worker: whether its first task's objects are frozen (the daemon itself runs no task)


def worker(sock: socket.socket, authenticated: bool) -> int:
    """``pyspark.daemon.worker`` (one task in a forked worker), then, after the worker's first task, one collection
    and a freeze of what survives it."""
    global _frozen
    code = _run_task(sock, authenticated)
    if not _frozen:
        gc.collect()
        gc.freeze()
        _frozen = True
    return code


if __name__ == "__main__":
    daemon.worker = worker  # ``daemon.manager`` calls its module's ``worker`` in each forked child
    daemon.manager()
