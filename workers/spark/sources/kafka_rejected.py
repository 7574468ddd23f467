"""The dead letters of a Kafka job whose records are checked in the JVM (``jvm_checks.py``).

A streaming query has one output: the records its checks reject are left out of the pipeline's input, and the query
only counts them (its observed metric ``statekeeper_rejected``). After a batch whose count is not 0, this reads the
batch's offset range again with Spark's Kafka batch source, keeps the records the same checks reject, with their
stage and reason, and appends them to the job's dead-letter stream, each once (``dead_letter``: a replay or a second
read of a range adds nothing). It runs on a thread of its own in the driver, beside the query: a batch with rejected
records does not wait for them, and a batch without any costs one counter.

A marker in Redis, per checkpoint, says through which batch the dead letters are written. A driver that dies after a
batch committed but before its dead letters were written leaves the marker behind; the next start of the job reads
the ranges of the batches after it again (at most ``CATCH_UP_BATCHES``), from the checkpoint's offset log.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import redis
from pyspark.sql import SparkSession
from statekeeper_sdk import Rejected

from dashboard.checkpoint_dir.files import CheckpointError, batch_offsets, committed_batches
from dashboard.kafka import spark_options
from workers.spark.sources.jvm_checks import JvmChecks
from workers.spark.sources.kafka import REJECTED_METRIC, Places, checked_columns
from workers.spark.sources.redis_streams import dead_letter

log = logging.getLogger(__name__)

CATCH_UP_BATCHES = 100
WRITE_CHUNK = 500  # dead letters appended to Redis at a time
MARKER_PREFIX = "statekeeper:rejected-through:"


def rejected_count(progress: Mapping[str, Any]) -> int:
    """How many records the batch's checks rejected, from its progress event (0 without the metric)."""
    metric = (progress.get("observedMetrics") or {}).get(REJECTED_METRIC) or {}
    return int(metric.get("rejected") or 0)


class RejectedRecords:
    """Writes the dead letters of one query's batches, in batch order, on a thread of its own."""

    def __init__(
        self, spark: SparkSession, checks: JvmChecks, *, servers: str, topic: str, security: Mapping[str, str],
        dead_letters: str, redis_url: str, checkpoint: str, starting: str,
    ) -> None:  # fmt: skip
        self.spark, self.checks = spark, checks
        self.servers, self.topic, self.security = servers, topic, dict(security)
        self.dead_letters, self.redis_url = dead_letters, redis_url
        self.checkpoint = Path(checkpoint.removeprefix("file:"))
        self.starting = starting or "earliest"
        self.marker = MARKER_PREFIX + str(self.checkpoint)
        self.work: queue.Queue[tuple[int, Any, Any] | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name=f"rejected-{topic}", daemon=True)
        self.failures = 0
        self._redis: Any = None

    def start(self) -> None:
        """Before the query starts: the batches committed after the marker are read again; then each batch as the
        query reports it."""
        self._catch_up()
        self.thread.start()

    def on_progress(self, progress: Mapping[str, Any]) -> None:
        """A committed batch's progress event (from the recording thread): its range is queued when its checks
        rejected records, and otherwise only the marker moves."""
        if "addBatch" not in progress.get("durationMs", {}):
            return
        source = (progress.get("sources") or [{}])[0]
        if rejected_count(progress):
            self.work.put((int(progress["batchId"]), source.get("startOffset"), source.get("endOffset")))
        else:
            self.work.put((int(progress["batchId"]), None, None))

    def stop(self, timeout: float = 30.0) -> None:
        """After the query ended: the queued batches are written (for up to ``timeout``), then the thread ends; what
        is left is read again at the next start."""
        if self.thread.is_alive():
            self.work.put(None)
            self.thread.join(timeout)

    def _client(self) -> Any:
        if self._redis is None:
            self._redis = redis.Redis.from_url(self.redis_url, socket_timeout=30)
        return self._redis

    def _catch_up(self) -> None:
        try:
            batches = committed_batches(self.checkpoint)
            through = self._client().get(self.marker)
            latest = batches[-1] if batches else -1
            if through is None:  # a new checkpoint, or one whose batches were checked before the checks moved here
                self._mark(latest)
                return
        except (OSError, redis.RedisError) as exc:  # the job starts all the same; the next start looks again
            log.warning("%s: dead letters not caught up (%s)", self.topic, exc)
            return
        for batch in range(max(int(through) + 1, latest - CATCH_UP_BATCHES + 1), latest + 1):
            try:
                end = batch_offsets(self.checkpoint, batch)["sources"][0]
                start = batch_offsets(self.checkpoint, batch - 1)["sources"][0] if batch > 0 else None
            except (CheckpointError, IndexError) as exc:
                log.warning("%s: batch %s's range not read again for its dead letters: %s", self.topic, batch, exc)
                continue
            log.info("%s: batch %s's dead letters are read again (the marker said %s)", self.topic, batch, through)
            self.work.put((batch, start if start is not None else self._initial(), end))

    def _initial(self) -> Any:
        """Where the checkpoint's first batch started: Spark's Kafka source keeps it in ``sources/0/0``."""
        try:
            text = (self.checkpoint / "sources" / "0" / "0").read_text().lstrip("\x00")
            return json.loads(text.splitlines()[-1])
        except (OSError, ValueError, IndexError):
            return self.starting

    def _run(self) -> None:
        while (item := self.work.get()) is not None:
            batch, start, end = item
            try:
                if end is not None:
                    self._write(batch, start if start is not None else self._initial(), end)
                self._mark(batch)
            except Exception as exc:  # the marker stays: the next start reads the range again
                self.failures += 1
                log.warning("%s: batch %s's dead letters not written: %s", self.topic, batch, exc)

    def _write(self, batch: int, start: Any, end: Any) -> int:
        records = (
            self.spark.read.format("kafka").option("kafka.bootstrap.servers", self.servers)
            .option("subscribe", self.topic).options(**spark_options(self.security))
            .option("startingOffsets", start if isinstance(start, str) else json.dumps(start))
            .option("endingOffsets", json.dumps(end)).option("failOnDataLoss", "false").load()
        )  # fmt: skip
        where, client, chunk, written = Places(self.topic), self._client(), [], 0
        for row in self.checks.rejected(checked_columns(records)).toLocalIterator():
            reason = f"{row['reason']} (in {where[row['_id']]})"
            chunk.append(Rejected(row["_id"], row["stage"], reason, bytes(row["value"])))
            if len(chunk) >= WRITE_CHUNK:
                written += dead_letter(client, self.dead_letters, chunk)
                chunk = []
        if chunk:
            written += dead_letter(client, self.dead_letters, chunk)
        log.info(
            "%s: batch %s's rejected records written to %s (%s new)", self.topic, batch, self.dead_letters, written
        )
        return written

    def _mark(self, batch: int) -> None:
        self._client().set(self.marker, batch)
