"""RocksDB's MANIFEST: how it grows while a state store stays open, and what reopening the store costs.

    .venv/bin/python -m bench.rocksdb_manifest [--batches 300] [--keys 1000]

Three runs of a url-counts-like aggregation (``--keys`` keys, 200 rows/s, a 0.2 s trigger, RocksDB, checkpoint format
2), each in a Spark process of its own: the store left open; ``unloadOnCommit`` on for every batch; and the console's
way (``workers/spark/manifest.py``), the keeper with a limit the MANIFEST passes half way. Prints the newest snapshot's
MANIFEST and the batches' median duration, and for the keeper the durations of the batches around its reopening.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RUN = r"""
import json, statistics, sys, time
from pyspark.sql import SparkSession, functions as F
from workers.spark.manifest import ManifestKeeper, manifest_bytes

mode, batches, keys, checkpoint = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
spark = (SparkSession.builder.master("local[2]").config("spark.sql.shuffle.partitions", "2")
         .config("spark.sql.streaming.stateStore.providerClass",
                 "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider")
         .config("spark.sql.streaming.stateStore.checkpointFormatVersion", "2")
         .config("spark.sql.streaming.stateStore.unloadOnCommit", str(mode == "every").lower())
         .config("spark.ui.enabled", "false").getOrCreate())
spark.sparkContext.setLogLevel("ERROR")
sizes = {}
def sink(frame, batch_id):
    frame.count()
    sizes[batch_id] = manifest_bytes(checkpoint)
keeper = ManifestKeeper(checkpoint, sink, limit=(batches // 2) * 185, every=10) if mode == "keeper" else sink
counts = (spark.readStream.format("rate").option("rowsPerSecond", 200).load()
          .select((F.col("value") % keys).alias("k")).groupBy("k").count())
query = (counts.writeStream.foreachBatch(keeper).outputMode("update").option("checkpointLocation", checkpoint)
         .trigger(processingTime="0.2 seconds").start())
durations = {}
while len(durations) < batches:
    for p in query.recentProgress:
        durations[p["batchId"]] = p["durationMs"].get("triggerExecution", 0)
    time.sleep(0.5)
query.stop()
steady = [durations[b] for b in sorted(durations)[10:]]
print(json.dumps({"manifest": manifest_bytes(checkpoint), "largest": max(sizes.values()),
                  "median_ms": statistics.median(steady), "reopened": getattr(keeper, "reopened", 0),
                  "durations": {str(b): d for b, d in sorted(durations.items())}}))
"""


def run(mode: str, batches: int, keys: int, root: Path) -> dict:
    checkpoint = root / mode
    done = subprocess.run(
        [sys.executable, "-c", RUN, mode, str(batches), str(keys), str(checkpoint)],
        capture_output=True, text=True, timeout=1800, cwd=Path(__file__).resolve().parent.parent,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        raise SystemExit(f"{mode}: {done.stderr[-2000:]}")
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--keys", type=int, default=1000)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="sk-bench-manifest-"))
    try:
        began = time.time()
        results = {mode: run(mode, args.batches, args.keys, root) for mode in ("open", "every", "keeper")}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"{args.batches} batches, {args.keys} keys, 200 rows/s, 0.2 s trigger, RocksDB; {time.time() - began:.0f} s\n"
    )
    print("| store | MANIFEST in the newest snapshot | largest seen | batch duration, median | reopened |")
    print("|---|---:|---:|---:|---:|")
    labels = {
        "open": "left open (Spark's default)",
        "every": "`unloadOnCommit` on every batch",
        "keeper": f"the keeper, limit {(args.batches // 2) * 185:,} bytes",
    }
    for mode, label in labels.items():
        r = results[mode]
        print(f"| {label} | {r['manifest']:,} B | {r['largest']:,} B | {r['median_ms']:.0f} ms | {r['reopened']} |")
    durations = {int(b): d for b, d in results["keeper"]["durations"].items()}
    slow = sorted(durations, key=lambda b: durations[b])[-3:]
    print(
        f"\nthe keeper's three slowest batches (batch: ms): {', '.join(f'{b}: {durations[b]}' for b in sorted(slow))}"
    )


if __name__ == "__main__":
    main()
