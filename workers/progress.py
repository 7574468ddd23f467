"""Turning Spark progress events into checkpoint records, and buffering them durably for the console.

Every committed batch is appended to the run's journal file (on disk, next to the checkpoint) and to a Redis stream.
The console ingests the stream; whatever the stream lost (a Redis restart) is ingested from the journal.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from pathlib import Path
from typing import Any

from workers.spark.checkpoint_disk import CheckpointDisk, Measurement

log = logging.getLogger(__name__)


def is_commit(progress: dict[str, Any]) -> bool:
    """Idle triggers also report progress, for a batch that never ran; only a batch that ran has addBatch."""
    return "addBatch" in progress.get("durationMs", {})


def _offset(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw


def checkpoint_record(progress: dict[str, Any], disk: Measurement) -> dict[str, Any]:
    """The checkpoint record of one committed batch, from its progress event and what it added to disk."""
    durations = progress.get("durationMs", {})
    operators = progress.get("stateOperators", [])
    source = (progress.get("sources") or [{}])[0]
    start, end, latest = (_offset(source.get(k)) for k in ("startOffset", "endOffset", "latestOffset"))
    lag = None
    if isinstance(end, dict) and isinstance(latest, dict) and "n" in end and "n" in latest:
        lag = max(0, int(latest["n"]) - int(end["n"]))
    return {
        "batch_id": progress["batchId"],
        "committed_at": progress["timestamp"],
        "duration_ms": durations.get("triggerExecution", 0),
        "wal_commit_ms": durations.get("walCommit", 0),
        "add_batch_ms": durations.get("addBatch", 0),
        "commit_offsets_ms": durations.get("commitOffsets", 0),
        "latest_offset_ms": durations.get("latestOffset", 0),
        "query_planning_ms": durations.get("queryPlanning", 0),
        "state_commit_ms": sum(op.get("commitTimeMs", 0) for op in operators),
        "input_rows": progress.get("numInputRows", 0),
        "input_rate": _rate(progress.get("inputRowsPerSecond")),
        "processed_rate": _rate(progress.get("processedRowsPerSecond")),
        "state_rows_total": sum(op.get("numRowsTotal", 0) for op in operators),
        "state_rows_updated": sum(op.get("numRowsUpdated", 0) for op in operators),
        "state_rows_removed": sum(op.get("numRowsRemoved", 0) for op in operators),
        "state_memory_bytes": sum(op.get("memoryUsedBytes", 0) for op in operators),
        "checkpointed_bytes": disk.added_bytes,
        "full_size_bytes": disk.full_bytes,
        "kind": "full" if disk.snapshot else "incremental",
        "start_offset": start,
        "end_offset": end,
        "latest_offset": latest,
        "lag_records": lag,
        "state_operators": operators,
        "partitions": disk.partitions,
    }


def _rate(value: Any) -> float:
    try:
        rate = float(value)
    except (TypeError, ValueError):
        return 0.0
    return rate if rate == rate and rate not in (float("inf"), float("-inf")) else 0.0  # NaN and inf are no rate


def parse_time(stamp: str) -> datetime:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00"))


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
                import redis

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
