"""Class data sharing for Spark's JVMs: the classes a driver loads at its start (Spark's, Hadoop's, Scala's: about
twenty thousand), parsed and verified once into an archive on disk that every later JVM maps instead.

Each driver, standby, spare, state reader and test session is a JVM of its own, and on this project's hosts a JVM's
start is most of a cold start: 7.5–8.6 s to a SparkSession and 3.3–4.4 s more to its first job on an idle 2-core host,
against 5.1–5.2 s and 1.7–2.1 s with the archive (docs/benchmarks.md). The archive is mapped read-only, so the
JVMs of one host also share its pages rather than each holding its own copy of the classes' metadata.

It is a dynamic archive of the JDK's (``-XX:ArchiveClassesAtExit``), made once per JDK, pyspark and class path by
``python -m workers.spark.class_archive`` (the set-up scripts run it): a JVM started through ``build_session`` runs a
streaming query of every kind the drivers run (a Python data source, RocksDB state, a Python sink), and writes the
archive as it exits. A JVM uses it with ``-Xshare:auto``: an archive the JVM cannot use (another JDK, another class
path) is ignored with a warning, never a failure. ``STATEKEEPER_CLASS_ARCHIVE=off`` starts every JVM without it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

ARCHIVE_DIR = Path(__file__).resolve().parents[2] / "var" / "cache" / "jvm"
# the JVM's sharing says only what fails: it warns on its stdout (the driver's log) of each class it cannot archive
# (signed jars, generated classes: hundreds of lines) and of an archive it cannot map
QUIET = "-Xlog:cds*=error"


def _java() -> Path | None:
    home = os.environ.get("JAVA_HOME", "").strip()
    found = Path(home) / "bin" / "java" if home else None
    if found is None or not found.exists():
        which = shutil.which("java")
        found = Path(which) if which else None
    return found.resolve() if found is not None else None


def archive_path() -> Path | None:
    """Where the archive for this JDK, pyspark and Spark's jars is (or would be); None without a JDK."""
    import pyspark

    java = _java()
    if java is None:
        return None
    jars = sorted(p.name for p in (Path(pyspark.__file__).parent / "jars").glob("*.jar"))
    key = "\n".join([str(java), str(java.stat().st_mtime_ns), pyspark.__version__, *jars])
    return ARCHIVE_DIR / f"spark-{hashlib.sha256(key.encode()).hexdigest()[:16]}.jsa"


def archive_options() -> str:
    """The JVM options that map the archive, when it has been made and is not switched off; else empty."""
    if os.environ.get("STATEKEEPER_CLASS_ARCHIVE", "on").strip().lower() in ("0", "off", "false", "no"):
        return ""
    path = archive_path()
    return f"-XX:SharedArchiveFile={path} -Xshare:auto {QUIET}" if path is not None and path.is_file() else ""


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
    from workers.spark.session import build_session

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
