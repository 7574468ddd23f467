"""Redis Streams source against Spark's JSON file source: the same events, the same stateful pipeline, one run.

    .venv/bin/python -m bench.source_throughput [--events 400000] [--batch 100000] [--partitions 2]

Prints a table of events/s and the ratio (target: Redis >= 0.6 x file source on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import redis
from statekeeper_sdk import Field, PayloadFormat

from workers.spark.pipelines.url_counts import URLS, transform
from workers.spark.session import build_session
from workers.spark.sources.redis_streams import FORMAT_NAME, RedisStreamDataSource

# ts is the event time: the reader bounds it against each entry's arrival, as the shipped pipelines' readers do
PAYLOAD = PayloadFormat("json", (Field("url", "string"), Field("ts", "long")), event_time="ts")


def make_events(count: int) -> list[str]:
    rng = random.Random(1)
    now = int(time.time() * 1000)
    return [json.dumps({"url": rng.choice(URLS), "ts": now + i // 1000}, separators=(",", ":")) for i in range(count)]


def run_query(spark: Any, frame: Any, checkpoint: Path) -> float:
    started = time.perf_counter()
    query = (
        transform(frame)
        .writeStream.format("noop")
        .outputMode("update")
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=400_000)
    parser.add_argument("--batch", type=int, default=100_000, help="max records per micro-batch, both sources")
    parser.add_argument("--partitions", type=int, default=2, help="Redis read partitions (tasks per batch)")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/14")
    parser.add_argument("--repeat", type=int, default=3, help="runs per source; the median is reported")
    args = parser.parse_args()

    events = make_events(args.events)
    work = Path(tempfile.mkdtemp(prefix="sk-bench-"))
    files = work / "json"
    files.mkdir()
    per_file = args.batch
    for i in range(0, len(events), per_file):
        (files / f"part-{i // per_file:05d}.json").write_text("\n".join(events[i : i + per_file]) + "\n")
    client = redis.Redis.from_url(args.redis)
    stream = "bench:events"
    client.delete(stream)
    for i in range(0, len(events), 10_000):
        pipe = client.pipeline(transaction=False)
        for payload in events[i : i + 10_000]:
            pipe.xadd(stream, {"v": payload})
        pipe.execute()

    spark = build_session("statekeeper-bench", "local[2]", partitions=4)
    spark.dataSource.register(RedisStreamDataSource)
    file_frame = spark.readStream.schema("url string, ts bigint").option("maxFilesPerTrigger", 1).json(str(files))
    redis_frame = (
        spark.readStream.format(FORMAT_NAME)
        .option("url", args.redis)
        .option("stream", stream)
        .option("maxRecordsPerBatch", str(args.batch))
        .option("readPartitions", str(args.partitions))
        .option("format", PAYLOAD.to_option())
        .load()
    )
    # warm up the JVM and the Python workers on a small run of each, so neither pays the first-query cost
    results = {}
    for name, frame in (("JSON file source", file_frame), ("Redis Streams source", redis_frame)):
        run_query(spark, frame, work / "warm-up")
        shutil.rmtree(work / "warm-up")
        times = []
        for attempt in range(args.repeat):
            times.append(run_query(spark, frame, work / f"ck-{name[:4]}-{attempt}"))
        seconds = statistics.median(times)
        results[name] = (seconds, args.events / seconds)
    spark.stop()
    client.delete(stream)
    shutil.rmtree(work)

    file_rate = results["JSON file source"][1]
    print(
        f"{args.events} events, {args.batch} per batch, {args.partitions} Redis read partitions, local[2], "
        f"stateful count by URL (4 state partitions), median of {args.repeat} runs\n"
    )
    print("| source | seconds | events/s | ratio to file |\n|---|---:|---:|---:|")
    for name, (seconds, rate) in results.items():
        print(f"| {name} | {seconds:.2f} | {rate:,.0f} | {rate / file_rate:.2f} |")


if __name__ == "__main__":
    main()
