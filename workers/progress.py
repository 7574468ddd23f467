"""Turning Spark progress events into checkpoint records, and buffering them durably for the console.

Every committed batch is appended to the run's journal file (on disk, next to the checkpoint) and to a Redis stream.
The console ingests the stream; whatever the stream lost (a Redis restart) is ingested from the journal.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import redis

from dashboard.checkpoint_dir.disk import CheckpointDisk
from dashboard.records import checkpoint_record, is_commit, parse_time

log = logging.getLogger(__name__)


class ProgressRecorder:
    """Measures the checkpoint after each committed batch and buffers its record (journal file, then Redis)."""

    def __init__(
        self, *, job_id: int, run_id: int, checkpoint: Path, journal: Path, redis_url: str, stream: str, live: str = ""
    ):
        self.job_id, self.run_id = job_id, run_id
        self.location = checkpoint.name
        self.disk = CheckpointDisk(checkpoint)
        self.journal = journal
        self.journal.parent.mkdir(parents=True, exist_ok=True)
        self.redis_url, self.stream, self.live = redis_url, stream, live
        self._redis: Any = None

    def on_progress(self, progress: dict[str, Any]) -> dict[str, Any] | None:
        if not is_commit(progress):
            return None
        started_ms = parse_time(progress["timestamp"]).timestamp() * 1000
        record = checkpoint_record(progress, self.disk.measure(progress["batchId"], started_ms)) | {
            "location": self.location
        }
        line = json.dumps({"job": self.job_id, "run": self.run_id, "record": record}, separators=(",", ":"))
        with open(self.journal, "a") as out:
            out.write(line + "\n")
        try:
            if self._redis is None:
                self._redis = redis.Redis.from_url(self.redis_url, socket_timeout=5, socket_connect_timeout=5)
            pipe = self._redis.pipeline(transaction=False)
            pipe.xadd(self.stream, {"data": line}, maxlen=1_000_000, approximate=True)
            if self.live:  # for the browsers, straight away; the console's database catches up within a second
                pipe.xadd(self.live, {"data": line}, maxlen=50_000, approximate=True)
            pipe.execute()
        except Exception as exc:  # Redis down: the journal has it, and the console will ingest it from there
            self._redis = None
            log.warning(
                "progress for batch %s not pushed to Redis (%s); it is in %s", record["batch_id"], exc, self.journal
            )
        return record
