"""One definition of a checkpoint record: the driver's record, the model, the roll-ups, the API and /metrics agree."""

from __future__ import annotations

from datetime import UTC, datetime

from dashboard.api.views import checkpoint_json
from dashboard.checkpoint_dir.disk import Measurement
from dashboard.models import Checkpoint, CheckpointRollup
from dashboard.records import MEASURES, checkpoint_record
from dashboard.selectors.charts import point, rollup_point
from dashboard.services.rollups import KEPT

PROGRESS = {
    "id": "q",
    "batchId": 7,
    "timestamp": "2026-11-22T06:00:00.000Z",
    "numInputRows": 40,
    "inputRowsPerSecond": 20.0,
    "processedRowsPerSecond": 80.0,
    "durationMs": {"addBatch": 50, "walCommit": 5, "commitOffsets": 4, "latestOffset": 3, "queryPlanning": 2,
                   "triggerExecution": 70},
    "stateOperators": [{"numRowsTotal": 9, "numRowsUpdated": 2, "numRowsRemoved": 1, "memoryUsedBytes": 900,
                        "commitTimeMs": 6}],
    "sources": [{"startOffset": '{"id":"1-0","n":60}', "endOffset": '{"id":"2-0","n":100}',
                 "latestOffset": '{"id":"3-0","n":130}'}],
}  # fmt: skip


def test_the_drivers_record_has_every_checkpoint_column_and_nothing_else():
    record = checkpoint_record(PROGRESS, Measurement(120, 4000, False))
    stored = {f.name for f in Checkpoint._meta.concrete_fields} - {"id", "job", "run", "location", "recorded_at"}
    assert set(record) == stored


def test_every_rollup_column_is_kept_by_one_measure():
    identity = {"id", "job", "resolution", "bucket", "location", "batches", "batch_first", "batch_last",
                "last_committed_at"}  # fmt: skip
    columns = {f.name for f in CheckpointRollup._meta.concrete_fields} - identity
    kept = [column for _, column, _ in KEPT]
    assert sorted(kept) == sorted(columns), "each roll-up column is kept once, by a measure of dashboard/records.py"


def test_a_chart_point_a_rollup_point_and_the_api_carry_every_measure():
    record = checkpoint_record(PROGRESS, Measurement(120, 4000, False)) | {"location": "checkpoint"}
    p = point(record)
    assert {m.point for m in MEASURES} <= set(p)
    assert (p["lag"], p["end_n"], p["plan"], p["dur"], p["state_mem"]) == (30, 100, 5, 70, 900)
    assert p["lag_s"] == round(30 / 80, 2)
    bucket = CheckpointRollup(
        **{column: 1 for _, column, _ in KEPT},
        batches=1,
        batch_last=7,
        location="checkpoint",
        bucket=datetime(2026, 11, 22, tzinfo=UTC),
    )
    assert {m.point for m in MEASURES} <= set(rollup_point(bucket))
    api = checkpoint_json(Checkpoint(batch_id=7, **{m.column: 1 for m in MEASURES if m.column}))
    assert {m.column for m in MEASURES if m.column} <= set(api)


def test_a_rocksdb_jobs_state_size_is_its_sst_files_not_sparks_memory_figure():
    rocksdb = dict(PROGRESS, stateOperators=[
        {"numRowsTotal": 9, "memoryUsedBytes": 0, "customMetrics": {"rocksdbSstFileSize": 52_000, "rocksdbGetCount": 3}},
        {"numRowsTotal": 1, "memoryUsedBytes": 0, "customMetrics": {"rocksdbSstFileSize": 8_000}},
    ])  # fmt: skip
    record = checkpoint_record(rocksdb, Measurement(120, 4000, False))
    assert (record["state_sst_bytes"], record["state_memory_bytes"]) == (60_000, 0)
    assert checkpoint_record(PROGRESS, Measurement(120, 4000, False))["state_sst_bytes"] is None, "the memory backend"
    charted = point(record)
    assert charted["state_sst"] == 60_000 and [op[2] for op in charted["ops"]] == [52_000, 8_000], (
        "the chart's figures for a RocksDB job are its SST files, per operator too"
    )
    assert [op[2] for op in point(checkpoint_record(PROGRESS, Measurement(120, 4000, False)))["ops"]] == [None] * len(
        PROGRESS["stateOperators"]
    )


def test_a_record_keeps_the_operator_figures_the_console_reads_not_every_custom_metric():
    """Spark reports some fifty custom metrics per RocksDB operator; a record kept them all, four times its size."""
    custom = {f"rocksdb{name}": 1 for name in ("GetCount", "PutCount", "CommitFlushLatency", "ZipFileBytes")}
    operator = {"operatorName": "transformWithStateExec", "numRowsTotal": 9, "numShufflePartitions": 3,
                "numRowsDroppedByWatermark": 2, "customMetrics": {**custom, "rocksdbSstFileSize": 52_000},
                "allUpdatesTimeMs": 4, "allRemovalsTimeMs": 1}  # fmt: skip
    record = checkpoint_record(dict(PROGRESS, stateOperators=[operator]), Measurement(1, 2, False))
    assert record["state_operators"] == [
        {"operatorName": "transformWithStateExec", "numRowsTotal": 9, "numShufflePartitions": 3,
         "numRowsDroppedByWatermark": 2, "customMetrics": {"rocksdbSstFileSize": 52_000}}
    ]  # fmt: skip
    assert record["state_sst_bytes"] == 52_000 and record["rows_dropped_by_watermark"] == 2
