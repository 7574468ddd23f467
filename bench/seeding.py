"""How fast PySpark's transformWithState takes an initial state: the floor under a state migration's seeding.

    .venv/bin/python -m bench.seeding [--keys 20000 100000] [--rounds 1]

A bare Spark session (local[2], RocksDB, two state partitions), no console: a query whose transformWithState operator
is given ``--keys`` keys as its initial state (one ValueState each and, in the second kind, an event-time timer, as
``customer-spend-daily`` registers) and runs its first batch on one input row. The same query with 10 keys is the
fixed cost (the JVM's start, planning, the Python workers); the rest, divided by the keys, is the seeding. Each
key crosses the state server's socket (its key set, its value written, its timer registered) from a Python worker,
and the JVM's state server answers each: both cores are busy while it seeds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pyspark.sql import Row, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming.stateful_processor import StatefulProcessor

ROOT = Path(__file__).resolve().parents[1]


class Seeded(StatefulProcessor):
    """One value per key from the initial state; with ``timer``, an event-time timer per key too."""

    def __init__(self, timer: bool) -> None:
        self.timer = timer

    def init(self, handle: Any) -> None:
        self.handle, self.value = handle, handle.getValueState("value", "n bigint")

    def handleInitialState(self, key: Any, initialState: Row, timerValues: Any) -> None:
        self.value.update((initialState["n"],))
        if self.timer:
            self.handle.registerTimer(10**13)

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Any:
        yield Row(k=key[0], n=sum(1 for _ in rows))

    def close(self) -> None:
        pass


def session() -> SparkSession:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
    spark = (
        SparkSession.builder.master("local[2]").config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.streaming.stateStore.providerClass",
                "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider")
        .config("spark.ui.enabled", "false").getOrCreate()
    )  # fmt: skip
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def first_batch(spark: SparkSession, keys: int, timer: bool, where: Path) -> float:
    """Seconds from the query's start to its first batch's end, with ``keys`` keys in its initial state."""
    initial = spark.range(keys).select(
        F.concat(F.lit("k"), F.col("id").cast("string")).alias("k"), F.col("id").alias("n")
    )
    events = (
        spark.readStream.format("rate").option("rowsPerSecond", 1).load()
        .select(F.lit("k0").alias("k"), "timestamp").withWatermark("timestamp", "1 minute")
    )  # fmt: skip
    output = events.groupBy("k").transformWithState(
        Seeded(timer), "k string, n bigint", "Update", "EventTime" if timer else "None",
        initialState=initial.groupBy("k"),
    )  # fmt: skip
    shutil.rmtree(where, ignore_errors=True)
    began = time.monotonic()
    query = output.writeStream.format("noop").option("checkpointLocation", str(where)).trigger(once=True).start()
    query.awaitTermination()
    if query.exception():
        raise RuntimeError(str(query.exception()))
    return time.monotonic() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, nargs="+", default=[20_000, 100_000])
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    spark, where = session(), Path(tempfile.mkdtemp(prefix="sk-bench-seeding-"))
    first_batch(spark, 10, True, where / "warm")  # the JVM's and the Python workers' first use, not measured
    print("| timers | keys | rounds | first batch | fixed (10 keys) | seeding | keys a second |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for timer in (False, True):
        fixed = statistics.median(first_batch(spark, 10, timer, where / "fixed") for _ in range(args.rounds))
        for keys in args.keys:
            took = statistics.median(first_batch(spark, keys, timer, where / "seeded") for _ in range(args.rounds))
            print(f"| {'one a key' if timer else 'none'} | {keys} | {args.rounds} | {took:.1f} s | {fixed:.1f} s | "
                  f"{took - fixed:.1f} s | {keys / max(took - fixed, 1e-9):,.0f} |", flush=True)  # fmt: skip
    print(f"\n{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f} at the end")
    spark.stop()
    shutil.rmtree(where, ignore_errors=True)


if __name__ == "__main__":
    main()
