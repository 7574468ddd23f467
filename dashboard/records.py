"""A checkpoint record: what one committed batch is measured by. The one definition of its fields.

``checkpoint_record`` turns Spark's progress event into the record a driver journals (its keys are the ``Checkpoint``
model's columns, a test holds them equal); ``MEASURES`` says, for each figure, what pages call it, its unit, how the
per-minute and per-hour roll-ups keep it, and whether the summary and /metrics show it. Chart points, roll-ups, the
checkpoint summary, the API and /metrics are built from these two, never from lists of their own.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from dashboard.checkpoint_dir.disk import Measurement


def parse_time(stamp: str) -> datetime:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00"))


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


def _rate(value: Any) -> float:
    try:
        rate = float(value)
    except (TypeError, ValueError):
        return 0.0
    return rate if rate == rate and rate not in (float("inf"), float("-inf")) else 0.0  # NaN and inf are no rate


def _lag(end: Any, latest: Any) -> int | None:
    """Records between a batch's end and the source's latest offset: a Redis stream's {"id", "n"}, or a Kafka
    source's {topic: {partition: offset}} summed over partitions; None for a source that says neither."""
    if not isinstance(end, dict) or not isinstance(latest, dict):
        return None
    if "n" in end and "n" in latest:
        return max(0, int(latest["n"]) - int(end["n"]))
    try:
        return sum(
            max(0, int(offset) - int(end.get(topic, {}).get(partition, 0)))
            for topic, partitions in latest.items()
            for partition, offset in partitions.items()
        )
    except (AttributeError, TypeError, ValueError):
        return None


def _sst_bytes(operators: list[dict[str, Any]]) -> int | None:
    """RocksDB's size of the state (its SST files, from Spark's custom metrics); None when no operator reports it.
    Spark's memoryUsedBytes for RocksDB is the memtables' and pinned blocks' memory, which comes and goes."""
    sizes = [(op.get("customMetrics") or {}).get("rocksdbSstFileSize") for op in operators]
    found = [int(size) for size in sizes if isinstance(size, int | float)]
    return sum(found) if found else None


# What a record keeps of each stateful operator's progress: the figures the console reads (charts, the capacity
# review, the rescale check), not Spark's fifty-odd custom metrics, which made a record about four times its size.
OPERATOR_FIGURES = (
    "operatorName", "numRowsTotal", "numRowsUpdated", "numRowsRemoved", "memoryUsedBytes", "commitTimeMs",
    "numRowsDroppedByWatermark", "numShufflePartitions", "numStateStoreInstances",
)  # fmt: skip
OPERATOR_CUSTOM_FIGURES = ("rocksdbSstFileSize",)


def operator_summary(operator: dict[str, Any]) -> dict[str, Any]:
    """One stateful operator's progress as a record keeps it (OPERATOR_FIGURES)."""
    kept = {name: operator[name] for name in OPERATOR_FIGURES if name in operator}
    custom = operator.get("customMetrics") or {}
    if isinstance(custom, dict) and (figures := {k: custom[k] for k in OPERATOR_CUSTOM_FIGURES if k in custom}):
        kept["customMetrics"] = figures
    return kept


def checkpoint_record(progress: dict[str, Any], disk: Measurement) -> dict[str, Any]:
    """The checkpoint record of one committed batch, from its progress event and what it added to disk."""
    durations = progress.get("durationMs", {})
    operators = progress.get("stateOperators", [])
    source = (progress.get("sources") or [{}])[0]
    start, end, latest = (_offset(source.get(k)) for k in ("startOffset", "endOffset", "latestOffset"))
    lag = _lag(end, latest)
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
        "state_sst_bytes": _sst_bytes(operators),
        "rows_dropped_by_watermark": sum(op.get("numRowsDroppedByWatermark", 0) for op in operators),
        "checkpointed_bytes": disk.added_bytes,
        "full_size_bytes": disk.full_bytes,
        "kind": "full" if disk.snapshot else "incremental",
        "start_offset": start,
        "end_offset": end,
        "latest_offset": latest,
        "lag_records": lag,
        "state_operators": [operator_summary(op) for op in operators if isinstance(op, dict)],
        "partitions": disk.partitions,
    }


ROLLUP_HOW = ("avg", "max", "sum", "last")


@dataclass(frozen=True)
class Measure:
    """One figure of a checkpoint."""

    point: str  # its key in a chart point (and in the live push)
    label: str
    unit: str  # ms, bytes, rows, rows/s, records, offset
    column: str = ""  # the Checkpoint column it is read from; empty when derived (read)
    read: Callable[[dict[str, Any]], Any] | None = None  # a derived figure, from a record's columns
    # how the per-minute and per-hour roll-ups keep it: (CheckpointRollup column, avg | max | sum | last); the first
    # is the value a roll-up's chart point shows
    rollups: tuple[tuple[str, str], ...] = ()
    summary: bool = False  # in the checkpoint summary (min, avg, p50, p90, p99, max)
    metric: str = ""  # the Prometheus gauge of the latest checkpoint's value (ms are exported as seconds)
    metric_help: str = ""

    def value(self, record: dict[str, Any]) -> Any:
        return self.read(record) if self.read else record.get(self.column)


def _end_n(record: dict[str, Any]) -> int | None:
    return source_position(record.get("end_offset"))


def kafka_offsets(end: Any) -> dict[str, dict[int, int]] | None:
    """A Kafka source's offset ({topic: {partition: offset}}) as topic -> partition -> offset; None for any other."""
    if not isinstance(end, dict) or not end or "n" in end:
        return None
    try:
        return {str(t): {int(p): int(o) for p, o in parts.items()} for t, parts in end.items()}
    except (AttributeError, TypeError, ValueError):
        return None


def offset_text(value: object) -> str:
    """A checkpoint's end offset as a person reads it: a Redis stream's entry id and count, or each Kafka partition's
    offset (``access-log 0:812 1:790 2:805``)."""
    if (kafka := kafka_offsets(value)) is not None:
        return "; ".join(f"{t} " + " ".join(f"{p}:{o}" for p, o in sorted(parts.items())) for t, parts in kafka.items())
    if isinstance(value, dict):
        return f"{value.get('id', '?')} (#{value.get('n', '?')})"
    return "–" if value is None else str(value)


def source_position(end: Any) -> int | None:
    """How far a batch's end offset is into its source, as one count: a Redis stream's entries read, a Kafka source's
    offsets summed over its partitions."""
    if isinstance(end, dict) and "n" in end:
        return int(end["n"])
    kafka = kafka_offsets(end)
    return None if kafka is None else sum(o for parts in kafka.values() for o in parts.values())


MEASURES: tuple[Measure, ...] = (
    Measure("lag", "lag", "records", "lag_records", rollups=(("lag_records_max", "max"), ("lag_records_last", "last")),
            metric="statekeeper_job_lag_records",
            metric_help="records in the source not yet processed: read from the source every few seconds, the last "
                        "checkpoint's when no fresh sample"),
    Measure("end_n", "source offset", "offset", read=_end_n, rollups=(("end_n_last", "last"),)),
    Measure("in_rate", "input", "rows/s", "input_rate", rollups=(("input_rate_avg", "avg"),)),
    Measure("proc_rate", "processed", "rows/s", "processed_rate", rollups=(("processed_rate_avg", "avg"),)),
    Measure("dur", "End to end duration", "ms", "duration_ms",
            rollups=(("duration_ms_avg", "avg"), ("duration_ms_max", "max")), summary=True,
            metric="statekeeper_checkpoint_duration_seconds", metric_help="end-to-end duration of the last batch"),
    Measure("wal", "WAL commit", "ms", "wal_commit_ms", rollups=(("wal_commit_ms_avg", "avg"),)),
    Measure("add", "addBatch", "ms", "add_batch_ms", rollups=(("add_batch_ms_avg", "avg"),)),
    Measure("commit", "commit offsets", "ms", "commit_offsets_ms", rollups=(("commit_offsets_ms_avg", "avg"),)),
    Measure("plan", "planning + latestOffset", "ms", read=lambda r: (r.get("query_planning_ms") or 0) + (r.get("latest_offset_ms") or 0),
            rollups=(("planning_ms_avg", "avg"),)),
    Measure("ckpt", "Checkpointed data size", "bytes", "checkpointed_bytes",
            rollups=(("checkpointed_bytes_sum", "sum"),), summary=True,
            metric="statekeeper_checkpoint_checkpointed_bytes", metric_help="bytes the last batch added to the checkpoint"),
    Measure("full", "Full checkpoint size", "bytes", "full_size_bytes", rollups=(("full_size_bytes_last", "last"),),
            summary=True, metric="statekeeper_checkpoint_size_bytes",
            metric_help="full checkpoint directory size after the last batch"),
    Measure("state_commit", "State commit time", "ms", "state_commit_ms", rollups=(("state_commit_ms_avg", "avg"),),
            summary=True, metric="statekeeper_checkpoint_state_commit_seconds",
            metric_help="state commit time of the last batch"),
    Measure("state_rows", "state rows", "rows", "state_rows_total", rollups=(("state_rows_last", "last"),),
            metric="statekeeper_job_state_rows", metric_help="state rows of all stateful operators"),
    Measure("state_mem", "state memory (Spark's memoryUsedBytes)", "bytes", "state_memory_bytes",
            rollups=(("state_memory_bytes_last", "last"),), metric="statekeeper_job_state_memory_bytes",
            metric_help="state bytes in memory of all stateful operators (for RocksDB: memtables and pinned blocks)"),
    Measure("state_sst", "state on RocksDB (SST files)", "bytes", "state_sst_bytes",
            rollups=(("state_sst_bytes_last", "last"),), metric="statekeeper_job_state_sst_bytes",
            metric_help="RocksDB's own size of the state: its SST files"),
    Measure("rows", "Input rows", "rows", "input_rows", rollups=(("input_rows", "sum"),), summary=True),
    Measure("dropped", "rows dropped by the watermark", "rows", "rows_dropped_by_watermark",
            rollups=(("rows_dropped_by_watermark_sum", "sum"),),
            metric="statekeeper_checkpoint_rows_dropped_by_watermark",
            metric_help="late rows the last batch's watermark discarded"),
)  # fmt: skip

# What a chart point or a roll-up reads of a stored checkpoint: its identity and every measure's columns.
CHART_COLUMNS = (
    "batch_id",
    "committed_at",
    "location",
    "end_offset",
    "query_planning_ms",
    "latest_offset_ms",
    "state_operators",
    *(m.column for m in MEASURES if m.column),
)
SUMMARY_MEASURES = tuple(m for m in MEASURES if m.summary and m.column)
