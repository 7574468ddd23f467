"""A job's driver: one process, one SparkSession, one streaming query (``python -m workers.driver_process RUN_ID``
sets Django up and calls ``main``).

It runs only while it holds the checkpoint lease, renews it on a heartbeat, records every committed batch, and on a
stop request lets the batch in flight finish before it stops the query.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
import traceback
from typing import Any

from django.conf import settings
from django.utils import timezone
from pyspark.sql.streaming import StreamingQueryListener

from dashboard import pipelines
from dashboard.models import Run, RunStatus
from dashboard.services.checkpoints import journal_path
from dashboard.services.lease import lease_renew
from dashboard.services.runs import run_finish, run_started
from workers.progress import ProgressRecorder
from workers.sink import batch_writer
from workers.spark.query import JobSpec, start_query
from workers.spark.session import build_session

log = logging.getLogger("statekeeper.driver")


class JobDriver:
    def __init__(self, spark: Any, run_id: int) -> None:

        self.spark = spark
        self.run = Run.objects.select_related("job").get(id=run_id)
        self.job = self.run.job
        self.token = int(self.run.fencing_token or 0)
        self.stop_signal = threading.Event()

    def spec(self) -> Any:

        job = self.job
        return JobSpec(
            job_id=job.id,
            name=job.name,
            pipeline=job.pipeline,
            stream=job.source_stream,
            redis_url=settings.REDIS_URL,
            backend=job.state_backend,
            trigger_seconds=job.trigger_interval_seconds,
            partitions=job.state_partitions,
            parallelism=job.parallelism,
            checkpoint=str(job.checkpoint_location),
            batches_retained=job.batches_retained,
            max_records=job.max_records_per_batch,
            dead_letter=job.dead_letter_stream,
        )

    def execute(self) -> str:
        """Run the query until it is stopped or fails; returns the run's final status."""
        if not lease_renew(job_id=self.job.id, token=self.token):
            run_finish(
                run_id=self.run.id,
                status=RunStatus.REFUSED,
                message="Refused: the lease passed to another driver before this one started.",
            )
            return RunStatus.REFUSED
        spec = self.spec()
        pipeline = pipelines.get(spec.pipeline)
        recorder = ProgressRecorder(
            job_id=self.job.id,
            run_id=self.run.id,
            checkpoint=self.job.checkpoint_location,
            journal=journal_path(job=self.job, run_id=self.run.id),
            redis_url=settings.REDIS_URL,
            stream=settings.PROGRESS_STREAM,
            live=settings.LIVE_STREAM,
        )
        query_id: list[str] = []

        class Listener(StreamingQueryListener):
            def onQueryStarted(self, event: Any) -> None:
                pass

            def onQueryProgress(self, event: Any) -> None:
                progress = json.loads(event.progress.json)
                if query_id and progress.get("id") == query_id[0]:
                    recorder.on_progress(progress)

            def onQueryIdle(self, event: Any) -> None:
                pass

            def onQueryTerminated(self, event: Any) -> None:
                pass

        listener = Listener()
        self.spark.streams.addListener(listener)
        try:
            query = start_query(
                self.spark,
                spec,
                pipeline,
                batch_writer(job_id=self.job.id, token=self.token, pipeline=pipeline),
            )
            query_id.append(str(query.id))
            run_started(run_id=self.run.id)
            return self._supervise(query)
        except Exception as exc:
            run_finish(
                run_id=self.run.id,
                status=RunStatus.FAILED,
                message=f"The query could not start: {exc}",
                error=traceback.format_exc(),
            )
            return RunStatus.FAILED
        finally:
            time.sleep(0.5)  # let the listener bus deliver the last progress event before the listener goes
            self.spark.streams.removeListener(listener)

    def _supervise(self, query: Any) -> str:

        while True:
            self.stop_signal.wait(settings.LEASE_RENEW_SECONDS if query.isActive else 0)
            if not query.isActive:
                error = query.exception()
                message = (
                    f"The query failed: {error.desc if hasattr(error, 'desc') else error}"
                    if error
                    else "The query stopped."
                )
                run_finish(run_id=self.run.id, status=RunStatus.FAILED, message=message[:2000], error=str(error or ""))
                return RunStatus.FAILED
            if not lease_renew(job_id=self.job.id, token=self.token):
                query.stop()  # fenced: someone else may own the checkpoint now; stop without draining
                run_finish(
                    run_id=self.run.id,
                    status=RunStatus.FAILED,
                    message="Stopped: this driver lost the checkpoint lease (fenced).",
                )
                return RunStatus.FAILED
            Run.objects.filter(id=self.run.id).update(last_heartbeat_at=timezone.now())
            stop_at = Run.objects.values_list("stop_requested_at", flat=True).get(id=self.run.id)
            if stop_at or self.stop_signal.is_set():
                self._drain_and_stop(query)
                run_finish(
                    run_id=self.run.id,
                    status=RunStatus.STOPPED,
                    message="Stopped on request after the batch in flight committed.",
                )
                return RunStatus.STOPPED

    def _drain_and_stop(self, query: Any) -> None:
        """Wait for the batch in flight to commit, then stop before the next trigger starts one."""

        deadline = time.monotonic() + settings.STOP_GRACE_SECONDS
        while query.status.get("isTriggerActive") and time.monotonic() < deadline:
            time.sleep(0.05)
        query.stop()


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_id = int(argv[1])
    run = Run.objects.select_related("job").get(id=run_id)
    job = run.job
    log.info("driver for %s run %s (pid %s, token %s)", job.name, run_id, os.getpid(), run.fencing_token)
    try:
        spark = build_session(
            f"statekeeper-{job.name}",
            settings.SPARK_MASTER or f"local[{job.parallelism}]",
            backend=job.state_backend,
            partitions=job.state_partitions,
            batches_retained=job.batches_retained,
            extra=pipelines.get(job.pipeline).conf,
        )
    except Exception as exc:
        run_finish(
            run_id=run_id, status=RunStatus.FAILED, message=f"Spark did not start: {exc}", error=traceback.format_exc()
        )
        return 1
    driver = JobDriver(spark, run_id)
    signal.signal(signal.SIGTERM, lambda *_: driver.stop_signal.set())
    status = driver.execute()
    log.info("run %s ended: %s", run_id, status)
    spark.stop()
    return 0 if status == RunStatus.STOPPED else 1
