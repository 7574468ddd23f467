"""Spark's state maintenance puts each partition's snapshot on the checkpoint within seconds, so a successor's first
batch replays about ten batches of change files, not up to a minute of them."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import functions as F

from workers.spark.session import backend_conf, state_maintenance_conf


def snapshots(partition: Path) -> list[int]:
    return sorted(int(f.name.split(".")[0].split("_")[0]) for f in partition.glob("*.zip"))


def test_snapshots_reach_the_checkpoint_every_few_seconds(spark: Any, tmp_path: Path) -> None:
    session = spark.newSession()  # its own SQL settings: the backend here is not the other tests'
    for key, value in backend_conf("rocksdb-incremental").items():
        session.conf.set(key, value)
    counts = (
        session.readStream.format("rate").option("rowsPerSecond", 20).load()
        .select((F.col("value") % 7).alias("k")).groupBy("k").count()
    )  # fmt: skip
    query = (
        counts.writeStream.format("noop").outputMode("update")
        .option("checkpointLocation", str(tmp_path / "checkpoint")).trigger(processingTime="0.25 seconds").start()
    )  # fmt: skip
    partition = tmp_path / "checkpoint" / "state" / "0" / "0"
    try:
        ends = time.monotonic() + 40
        while len(snapshots(partition)) < 2 and time.monotonic() < ends:
            time.sleep(0.5)
        # Spark's own interval (60 s) puts at most the newest snapshot of each minute there: one in 40 s, or none
        assert len(snapshots(partition)) >= 2, f"snapshots on the checkpoint after 40 s: {snapshots(partition)}"
    finally:
        query.stop()


@pytest.mark.parametrize("given", ["ten", "0", "-5", "0.2", "nan", "86400"])
def test_a_maintenance_interval_out_of_range_is_refused_by_name(monkeypatch: Any, given: str) -> None:
    monkeypatch.setenv("STATEKEEPER_STATE_MAINTENANCE_SECONDS", given)
    with pytest.raises(
        ValueError, match=f"STATEKEEPER_STATE_MAINTENANCE_SECONDS must be seconds from 1 to 3600, not '{given}'"
    ):
        state_maintenance_conf()


def test_the_maintenance_interval_is_given_to_spark_in_milliseconds(monkeypatch: Any) -> None:
    monkeypatch.setenv("STATEKEEPER_STATE_MAINTENANCE_SECONDS", "2.5")
    assert state_maintenance_conf() == {"spark.sql.streaming.stateStore.maintenanceInterval": "2500ms"}
    monkeypatch.delenv("STATEKEEPER_STATE_MAINTENANCE_SECONDS")
    assert state_maintenance_conf() == {"spark.sql.streaming.stateStore.maintenanceInterval": "10000ms"}


def test_a_rocksdb_query_reopens_its_stores_when_the_manifest_passes_its_limit_and_counts_on_exactly(
    spark: Any, tmp_path: Path
) -> None:
    """RocksDB appends to its MANIFEST at every commit for as long as the store stays open, and every snapshot carries
    it: the keeper has the query's stores reopened (a new, small MANIFEST) once it passes the limit, and the state
    counts on through it."""
    from workers.spark.manifest import UNLOAD_ON_COMMIT, ManifestKeeper, manifest_bytes

    session = spark.newSession()
    for key, value in backend_conf("rocksdb").items():
        session.conf.set(key, value)
    checkpoint = str(tmp_path / "checkpoint")
    sizes: list[int] = []
    totals: dict[int, int] = {}
    sessions: list[Any] = []

    def sink(frame: Any, batch_id: int) -> None:
        totals.update({row["k"]: row["count"] for row in frame.collect()})
        sessions.append(frame.sparkSession)
        sizes.append(manifest_bytes(checkpoint))

    keeper = ManifestKeeper(checkpoint, sink, limit=2_000, every=5)
    query = (
        session.readStream.format("rate").option("rowsPerSecond", 50).load()
        .select((F.col("value") % 7).alias("k")).groupBy("k").count()
        .writeStream.foreachBatch(keeper).outputMode("update").option("checkpointLocation", checkpoint)
        .trigger(processingTime="0.2 seconds").start()
    )  # fmt: skip
    try:
        ends = time.monotonic() + 90
        while keeper.reopened < 2 and time.monotonic() < ends:
            time.sleep(0.5)
        rows = session.read.format("statestore").load(checkpoint)  # the state as of the last committed batch
    finally:
        query.stop()
    assert keeper.reopened >= 2, f"reopened {keeper.reopened} times; MANIFEST sizes per batch: {sizes}"
    assert any(later < earlier for earlier, later in zip(sizes, sizes[1:], strict=False)), sizes
    assert max(sizes) < 4 * 2_000, f"bounded near its limit: {sizes}"
    assert sessions[-1].conf.get(UNLOAD_ON_COMMIT) == "false", "off again after the reopening batch"
    progress = query.recentProgress
    assert len(progress) < 100, "every batch's progress is still kept: the input can be summed"
    state = {row["key"]["k"]: row["value"]["count"] for row in rows.collect()}
    assert state == totals and sum(state.values()) == sum(p["numInputRows"] for p in progress), (
        "every row counted once through the reopenings"
    )
