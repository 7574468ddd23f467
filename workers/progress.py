"""Turning Spark progress events into checkpoint records, and buffering them durably for the console.

Every committed batch is appended to the run's journal file (on disk, next to the checkpoint), pushed to Redis (the
browsers' live stream, and the stream the console ingests) and stored in the console's database, at once: the
console shows a commit without waiting for the beat. Whatever the database or Redis missed, the beat's ingest of the
stream, or of the journal, fills in, with no duplicates.

Spark's listener thread only hands each event's JSON over (one call into the JVM, not PySpark's field-by-field copy of
the event); the records are made on a thread of their own, one for the whole process: with many jobs in one driver,
a slow record would otherwise hold every other job's events back.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
from django.db import DatabaseError, connection
from pyspark import SparkContext
from pyspark.sql.streaming import StreamingQueryListener

from dashboard.checkpoint_dir.disk import CheckpointDisk
from dashboard.checkpoint_dir.files import handed_over_after
from dashboard.checkpoint_dir.journal import journal_append
from dashboard.engine.live import live_add, live_message
from dashboard.records import checkpoint_record, is_commit, parse_time
from dashboard.services.checkpoints import checkpoint_record_ingest

log = logging.getLogger(__name__)


class ProgressRecorder:
    """Measures the checkpoint after each committed batch and buffers its record (journal file, then Redis)."""

    def __init__(
        self, *, job_id: int, run_id: int, checkpoint: Path, journal: Path, redis_url: str, stream: str, live: str = "",
        store: bool = True,
    ):  # fmt: skip
        """``store``: the record goes to the console's database at once too (else only the beat's ingest stores it)."""
        self.job_id, self.run_id = job_id, run_id
        self.location = checkpoint.name
        self.disk = CheckpointDisk(checkpoint)
        self.journal = journal
        self.journal.parent.mkdir(parents=True, exist_ok=True)
        self.redis_url, self.stream, self.live = redis_url, stream, live
        self._redis: Any = None
        self.store = store
        # a blue/green upgrade's checkpoint: the batches up to the handover are the old version's, in the job's history
        # already (under its own checkpoint); a restart that replays one writes no sink for it (workers/sink.py)
        self.handed_over_after = handed_over_after(checkpoint)

    def on_progress(self, progress: dict[str, Any]) -> dict[str, Any] | None:
        if not is_commit(progress):
            return None
        if self.handed_over_after is not None and progress["batchId"] <= self.handed_over_after:
            log.info("batch %s of job %s was the version's it took over from: not recorded again", progress["batchId"],
                     self.job_id)  # fmt: skip
            return None
        started_ms = parse_time(progress["timestamp"]).timestamp() * 1000
        record = checkpoint_record(progress, self.disk.measure(progress["batchId"], started_ms)) | {
            "location": self.location
        }
        line = live_message(self.job_id, run=self.run_id, record=record)
        journal_append(self.journal, line)
        try:
            if self._redis is None:
                self._redis = redis.Redis.from_url(self.redis_url, socket_timeout=5, socket_connect_timeout=5)
            pipe = self._redis.pipeline(transaction=False)
            pipe.xadd(self.stream, {"data": line}, maxlen=1_000_000, approximate=True)
            if self.live:  # for the browsers, straight away; the console's database catches up within a second
                live_add(pipe, self.live, line)
            pipe.execute()
        except Exception as exc:  # Redis down: the journal has it, and the console will ingest it from there
            self._redis = None
            log.warning(
                "progress for batch %s not pushed to Redis (%s); it is in %s", record["batch_id"], exc, self.journal
            )
        try:
            if self.store:
                checkpoint_record_ingest(job_id=self.job_id, run_id=self.run_id, record=record)
        except DatabaseError as exc:  # the beat ingests it from the stream or the journal
            connection.close()
            log.warning("batch %s not stored at once (%s); the console ingests it", record["batch_id"], exc)
        return record


class _ProgressJson:
    """The Java side of a listener (py4j calls it on Spark's listener thread): the progress event's JSON, once."""

    def __init__(self, deliver: Any) -> None:
        self.deliver = deliver

    def onQueryStarted(self, jevent: Any) -> None:
        pass

    def onQueryProgress(self, jevent: Any) -> None:
        self.deliver(jevent.progress().json())

    def onQueryIdle(self, jevent: Any) -> None:
        pass

    def onQueryTerminated(self, jevent: Any) -> None:
        pass

    class Java:
        implements = ["org.apache.spark.sql.streaming.PythonStreamingQueryListener"]


class ProgressListener(StreamingQueryListener):
    """Hands the progress events of one query to its recorder, through the process's recording thread."""

    def __init__(self, recorder: ProgressRecorder) -> None:
        self.recorder = recorder
        self.query_id = ""  # set once the query started: events of other queries are not this job's
        self.on_first_batch: Callable[[], None] | None = None  # told once, at the query's first committed batch
        self.watchers: list[Callable[[dict[str, Any]], None]] = []  # told each of its query's events, after the record

    @property
    def _jlistener(self) -> Any:  # what StreamingQueryManager.addListener registers
        if not hasattr(self, "_jlistenerobj"):
            jvm = SparkContext._jvm
            assert jvm is not None
            self._jlistenerobj = jvm.PythonStreamingQueryListenerWrapper(_ProgressJson(self._deliver))
        return self._jlistenerobj

    def _deliver(self, text: str) -> None:
        if self.query_id:
            if self.on_first_batch is not None and self._first_batch(text):
                told, self.on_first_batch = self.on_first_batch, None
                told()
            recording_thread().put((self, text))

    def _first_batch(self, text: str) -> bool:
        """Whether the event is of this listener's query and of a batch it ran (not an idle trigger's)."""
        progress = json.loads(text)
        return progress.get("id") == self.query_id and "addBatch" in progress.get("durationMs", {})

    def onQueryStarted(self, event: Any) -> None:
        pass

    def onQueryProgress(self, event: Any) -> None:
        pass

    def onQueryIdle(self, event: Any) -> None:
        pass

    def onQueryTerminated(self, event: Any) -> None:
        pass


class RecordingThread(threading.Thread):
    """Makes the records of every job's progress events in this process, in the order they came."""

    def __init__(self) -> None:
        super().__init__(name="progress-recorder", daemon=True)
        self.events: queue.Queue[tuple[ProgressListener, str]] = queue.Queue()

    def put(self, item: tuple[ProgressListener, str]) -> None:
        self.events.put(item)

    def run(self) -> None:
        while True:
            listener, text = self.events.get()
            try:
                progress = json.loads(text)
                if progress.get("id") == listener.query_id:  # a session's listeners hear all its queries
                    listener.recorder.on_progress(progress)
                    for watcher in listener.watchers:
                        watcher(progress)
            except Exception:
                log.exception("a progress event of job %s was not recorded", listener.recorder.job_id)
            finally:
                self.events.task_done()

    def drain(self, timeout: float = 5.0) -> None:
        """Wait (up to ``timeout``) until every event handed over so far is recorded."""
        done = threading.Event()

        def wait() -> None:
            self.events.join()
            done.set()

        threading.Thread(target=wait, daemon=True).start()
        done.wait(timeout)


_thread: RecordingThread | None = None
_thread_lock = threading.Lock()


def recording_thread() -> RecordingThread:
    global _thread
    with _thread_lock:
        if _thread is None or not _thread.is_alive():
            _thread = RecordingThread()
            _thread.start()
        return _thread
