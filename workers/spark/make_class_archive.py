"""``python -m workers.spark.make_class_archive [--force]``: make the class archive Spark's JVMs map
(``workers.spark.class_archive``) for this JDK and pyspark, unless it was made before; the set-up scripts run it."""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from workers.spark.class_archive import QUIET, archive_path
from workers.spark.session import build_session


def _workload(spark: Any, scratch: Path) -> None:
    """A streaming query of each kind the drivers run, a few batches each, so that their classes are loaded: a
    Python data source, a stateful aggregation on RocksDB with changelog checkpoints, a Python sink."""
    from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition

    class Reader(DataSourceStreamReader):
        def initialOffset(self) -> dict:
            return {"n": 0}

        def latestOffset(self, start: dict, limit: Any) -> dict:
            return {"n": int(time.time() * 4)}

        def partitions(self, start: dict, end: dict) -> list:
            return [InputPartition(0)]

        def read(self, partition: Any) -> Any:
            for i in range(50):
                yield (f"k{i % 7}", i)

    class Ticks(DataSource):
        @classmethod
        def name(cls) -> str:
            return "statekeeper-archive-ticks"

        def schema(self) -> str:
            return "key string, value int"

        def streamReader(self, schema: Any) -> Reader:
            return Reader()

    spark.dataSource.register(Ticks)
    spark.conf.set("spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled", "true")
    seen: list[int] = []
    frame = spark.readStream.format(Ticks.name()).load().groupBy("key").count()
    query = (
        frame.writeStream.outputMode("update").option("checkpointLocation", str(scratch / "checkpoint"))
        .foreachBatch(lambda batch, batch_id: seen.append(len(batch.collect())))
        .trigger(processingTime="250 milliseconds").start()
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while len(seen) < 4 and time.monotonic() < deadline:
            if not query.isActive:
                raise RuntimeError(f"the archive's query failed: {query.exception()}")
            time.sleep(0.2)
    finally:
        query.stop()


def build(path: Path) -> bool:
    """Make the archive at ``path``: a JVM runs the workload and writes it as it exits (into a scratch file, moved into
    place once whole). Whether it was made."""

    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.partial")
    os.environ["STATEKEEPER_CLASS_ARCHIVE"] = "off"  # this JVM makes the archive; it maps none
    options = (
        f"{os.environ.get('STATEKEEPER_DRIVER_JAVA_OPTIONS', '')} -XX:ArchiveClassesAtExit={partial} {QUIET}".strip()
    )
    os.environ["STATEKEEPER_DRIVER_JAVA_OPTIONS"] = options
    spark = build_session("statekeeper-class-archive", "local[1]", backend="rocksdb", partitions=2)
    gateway = spark.sparkContext._gateway
    assert gateway is not None
    jvm = gateway.proc
    with tempfile.TemporaryDirectory(prefix="statekeeper-archive-") as scratch:
        try:
            _workload(spark, Path(scratch))
        finally:
            spark.stop()
            gateway.shutdown()
            if jvm.stdin is not None:
                jvm.stdin.close()  # the JVM exits when its stdin closes, and writes the archive as it does
            jvm.wait(timeout=300)
    if not partial.is_file() or partial.stat().st_size == 0:
        partial.unlink(missing_ok=True)
        return False
    partial.replace(path)
    return True


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    path = archive_path()
    if path is None:
        print("no JDK found: no class archive")
        return 1
    if path.is_file() and "--force" not in sys.argv:
        print(f"class archive: {path} (made before)")
        return 0
    began = time.monotonic()
    made = build(path)
    for stale in path.parent.glob("spark-*.jsa"):  # another JDK's or pyspark's: no JVM here maps it any more
        if stale != path:
            stale.unlink(missing_ok=True)
    print(f"class archive: {path} ({'made' if made else 'NOT made'} in {time.monotonic() - began:.0f} s)")
    return 0 if made else 1


if __name__ == "__main__":
    sys.exit(main())
