"""A warm query: a job's own transform run on generated events, so that a process that may take the job over (a
standby, the spare shared driver) has loaded and compiled what the job's query runs before it must run it."""

from __future__ import annotations

import logging
import random
import shutil
import time
from dataclasses import replace
from typing import Any

import redis
from django.conf import settings

from dashboard import pipelines
from dashboard.engine.samples import sample_events
from dashboard.models import Job, StateBackend
from workers.sink import rehearse
from workers.spark.python_daemons import start_daemons_again
from workers.spark.query import JobSpec, start_query

log = logging.getLogger(__name__)
KEEP_WARM_SECONDS = 40.0  # + the warm query's trigger (5 s): inside Spark's 60 s idle timeout for a Python worker
WARM_BATCH_SECONDS = 180.0  # a warm-up's batch gets this long (a first one in a new JVM: 40 s on a busy host)


class WarmQuery:
    """The job's own transform on generated events in a scratch stream and a scratch checkpoint, into a sink that
    consumes the rows as the real sink does: started, and restarted, as the warm-up, then kept running while the
    standby (or the spare shared driver) waits. ``keep_warm``, every KEEP_WARM_SECONDS, adds a few events, which the
    query runs as one small micro-batch within TRIGGER_SECONDS: its Python workers, of every kind the pipeline uses,
    are used again before Spark's idle timeout ends them, at a fraction of a query start's cost. ``stop`` ends it and
    removes its scratch input."""

    TRIGGER_SECONDS = 5.0

    def __init__(self, spark: Any, job: Job, tag: str) -> None:
        """``tag`` names its scratch stream, checkpoint and query: unique to the process that warms (``standby-7``)."""
        self.spark, self.tag = spark, tag
        self.pipeline = pipelines.get(job.pipeline)
        self.stream = f"statekeeper:warmup:{tag}"
        self.scratch = settings.CHECKPOINT_ROOT / ".scratch" / tag
        self.files = settings.CHECKPOINT_ROOT / ".scratch" / f"{tag}-files"  # its file sinks' writes (``rehearse``)
        self.client = redis.Redis.from_url(settings.REDIS_URL)
        self.make = sample_events(self.pipeline, random.Random(tag))
        self.query: Any = None
        # the job's own query on a scratch stream and checkpoint of its own, from the beginning, read as Redis entries
        self.spec = JobSpec(**(job.run_values() | {
            "job_id": 0, "name": f"warmup-{tag}", "pipeline": self.pipeline.name, "stream": self.stream,
            "trigger_seconds": self.TRIGGER_SECONDS, "checkpoint": str(self.scratch), "max_records": 1000,
            "dead_letter": f"{self.stream}:dead", "skip_list": "", "source_kind": "redis-stream", "source_path": "",
            "source_format": "json", "starting_offset": "",
        }))  # fmt: skip

    def feed(self, count: int = 50) -> None:
        now = int(time.time() * 1000)
        pipe = self.client.pipeline()
        for _ in range(count):
            pipe.xadd(self.stream, {"v": self.make(now)}, maxlen=1000, approximate=True)
        pipe.execute()

    def start(self) -> None:
        """The warm-up proper: start the query and run a micro-batch, then stop it and start it again on its
        checkpoint and run another. A takeover is a restart: what only a restart runs (reading the offset and commit
        logs, the state's metadata and schema, loading each partition's state from the checkpoint) is then loaded and
        compiled in this JVM before the takeover needs it, half a second of its first batch on a busy host. A
        rocksdb-incremental job's warm query starts three times, so that its last restart loads a snapshot and replays
        a change file (docs/benchmarks.md: the first snapshot a JVM copies took 165–321 ms, a warm one 33–99 ms)."""

        def consume(frame: Any, batch_id: int) -> None:
            rehearse(self.pipeline, frame, self.files)

        backends = [self.spec.backend] * 2
        if self.spec.backend == StateBackend.ROCKSDB_INCREMENTAL:
            # its state reaches the checkpoint as a change file a batch, and a snapshot only after ten batches and a
            # maintenance run: a first run with change files off writes a snapshot at once, so that the restart loads
            # a snapshot and replays a change file on it, as a takeover does
            backends = [StateBackend.ROCKSDB, StateBackend.ROCKSDB_INCREMENTAL, StateBackend.ROCKSDB_INCREMENTAL]
        for backend in backends:
            if self.query is not None:
                self.query.stop()
            self.feed()
            self.query = start_query(self.spark, replace(self.spec, backend=backend), self.pipeline, consume)
            self._read_once(self.query)
        self.ping_planner()

    def _read_once(self, query: Any) -> None:
        """Until the query has committed a batch that read the events fed it, or WARM_BATCH_SECONDS. Not
        ``processAllAvailable``: it waits for a trigger that runs no batch, and a plan with a processing-time clock
        (timers, TTL) runs one at every trigger, so it never returned for such a pipeline."""
        deadline = time.monotonic() + WARM_BATCH_SECONDS
        while time.monotonic() < deadline and query.isActive:
            if any(progress.numInputRows > 0 for progress in query.recentProgress):
                return
            time.sleep(0.2)
        if (failure := query.exception()) is not None:
            raise RuntimeError(f"the warm query failed: {failure}")
        log.warning("%s: the warm query read nothing in %s s; warmed as far as it got", self.tag, WARM_BATCH_SECONDS)

    def ping_planner(self) -> None:
        """Read PlannerPing: Spark's Python processes that create a stream source and plan its reads stay alive. It
        only saves time: when it fails, the takeover starts them anew."""
        try:
            start_daemons_again(self.spark)
        except Exception as exc:  # py4j's errors among them
            log.warning("%s: the planner ping failed (%s); a takeover will start Spark's planner processes", self.tag,
                        str(exc).splitlines()[0] if str(exc) else type(exc).__name__)  # fmt: skip

    def keep_warm(self) -> None:
        if self.query is not None and self.query.isActive:
            self.feed(5)
            self.ping_planner()
        elif self.query is not None:
            log.warning("%s: its warm query ended (%s); it is no longer kept warm", self.tag, self.query.exception())
            self.query = None

    def stop(self) -> None:
        try:
            if self.query is not None:
                self.query.stop()
        finally:
            self.client.delete(self.stream, f"{self.stream}:dead", f"{self.stream}:dead:seen")
            shutil.rmtree(self.scratch, ignore_errors=True)
            shutil.rmtree(self.files, ignore_errors=True)
