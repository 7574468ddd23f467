"""End-to-end latency of a keyed count on Kafka, in Spark's real-time mode and in micro-batches: from a record's
produce time to the moment a consumer of the output topic sees a count that includes it.

    .venv/bin/python -m bench.real_time_latency [--rate 200] [--seconds 60] [--warm 15] [--only real-time]

The shipped ``url-counts-live`` pipeline (requests per URL) reads an access-log topic of three partitions on
STATEKEEPER_KAFKA_BOOTSTRAP (the broker bin/dev starts) and writes each count to a topic of its own, as a job's own
driver runs it (``start_query`` in this process, RocksDB state, two state partitions):
- real-time: Spark's real-time mode, a checkpoint every 5 s, Spark's Kafka writer (``start_real_time``);
- micro-batch 1 s: a 1 s processing-time trigger, the console's Kafka sink (a transaction a batch, read_committed).

Records are produced at ``--rate`` a second, keyed by URL (so one partition holds a URL's records in order); the
consumer reads the output with ``read_committed``. A record's latency is when the consumer first sees its URL's count
at or past the record's number, minus its produce time; the first ``--warm`` seconds are left out. The process's CPU
time over the measured seconds is its cost (the JVM and Python of the driver). Run it with the demo stack beside for
the on-call figure. Uses a job row in the development database and two topics, removed at the end.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import threading
import time
import uuid
from pathlib import Path
from typing import Any

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "statekeeper.settings")
os.environ.setdefault("STATEKEEPER_ENV", "development")

from bench.pipeline_throughput import ROOT  # noqa: E402, I001 (sets the environment up first)
from bench.kafka_source import use_cached_connector  # noqa: E402
from bench.procs import cpu_ticks, process_tree  # noqa: E402

use_cached_connector()

from confluent_kafka import Consumer, Producer, TopicPartition  # noqa: E402
from django.conf import settings  # noqa: E402

from dashboard import kafka, pipelines  # noqa: E402
from dashboard.models import Job  # noqa: E402
from workers.driver import job_spec  # noqa: E402
from workers.sink import batch_writer  # noqa: E402
from workers.spark.pipelines.url_counts import URLS, access_log_line  # noqa: E402
from workers.spark.query import session_settings, start_query  # noqa: E402
from workers.spark.session import build_session  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def tree_cpu() -> float:
    """CPU seconds of this process and every process under it (the driver's JVM, its Python workers)."""
    total = 0
    for pid in process_tree(os.getpid()):
        try:
            total += cpu_ticks(Path(f"/proc/{pid}/stat"))[1]
        except (OSError, IndexError, ValueError):
            continue
    return total / TICK


MODES = {"real-time": (True, 5.0), "micro-batch 1 s": (False, 1.0)}


class Sent:
    """Each record's produce time by (url, its number among the url's records)."""

    def __init__(self) -> None:
        self.at: dict[str, list[float]] = {url: [] for url in URLS}
        self.lock = threading.Lock()


def produce(topic: str, rate: float, seconds: float, sent: Sent, halt: threading.Event) -> None:
    producer = Producer({"bootstrap.servers": settings.KAFKA_BOOTSTRAP, "linger.ms": 0})
    rng = random.Random(11)
    start = time.monotonic()
    n = 0
    while not halt.is_set() and time.monotonic() - start < seconds:
        due = start + n / rate
        if (wait := due - time.monotonic()) > 0:
            time.sleep(wait)
        line = access_log_line(rng, int(time.time() * 1000))
        url = line.split('"')[1].split()[1]
        with sent.lock:
            sent.at[url].append(time.time())
            producer.produce(topic, line.encode(), url.encode())
        producer.poll(0)
        n += 1
    producer.flush()


def consume(topic: str, sent: Sent, seen: list[tuple[float, float]], halt: threading.Event) -> None:
    """(produce time, visible time) of each record, as the output's counts reach it."""
    import json

    consumer = Consumer({"bootstrap.servers": settings.KAFKA_BOOTSTRAP, "group.id": f"bench-{uuid.uuid4().hex[:6]}",
                         "isolation.level": "read_committed", "fetch.wait.max.ms": 5})  # fmt: skip
    consumer.assign([TopicPartition(topic, p, 0) for p in range(3)])
    counted = dict.fromkeys(URLS, 0)
    while not halt.is_set():
        message = consumer.poll(0.05)
        if message is None or message.error():
            continue
        now = time.time()
        value = json.loads(message.value() or b"{}")
        url, count = value["url"], int(value["requests"])
        with sent.lock:
            times = sent.at.get(url, [])
            for k in range(counted.get(url, 0), min(count, len(times))):
                seen.append((times[k], now))
        counted[url] = max(counted.get(url, 0), count)
    consumer.close()


def measure(mode: str, rate: float, seconds: float, warm: float, interval: float | None = None) -> dict[str, Any]:
    real_time, default = MODES[mode]
    interval = interval if interval and real_time else default
    source, out = f"bench-live-{uuid.uuid4().hex[:6]}", f"bench-live-out-{uuid.uuid4().hex[:6]}"
    kafka.ensure_topic(settings.KAFKA_BOOTSTRAP, source, 3)
    kafka.ensure_topic(settings.KAFKA_BOOTSTRAP, out, 3)
    values = {"kafka": settings.KAFKA_BOOTSTRAP, "counts_topic": out}
    job = Job.objects.create(
        name=f"bench-live-{uuid.uuid4().hex[:6]}", pipeline="url-counts-live", source_kind="kafka",
        source_stream=source, source_path=settings.KAFKA_BOOTSTRAP, state_backend="rocksdb", state_partitions=2,
        parallelism=2, trigger_interval_seconds=interval, real_time=real_time, parameters=values, lease_token=1,
    )  # fmt: skip
    pipeline = pipelines.get("url-counts-live")
    bound = pipelines.parameter_values("url-counts-live", values)
    spark = build_session("statekeeper-bench-live", f"local[{job.task_slots}]")  # as the job's own driver
    spec = job_spec(job, checkpoint=str(ROOT / "checkpoints" / job.name))
    sent, halt = Sent(), threading.Event()
    seen: list[tuple[float, float]] = []
    try:
        session_settings(spark, spec, pipeline)
        sink = batch_writer(job_id=job.id, token=1, pipeline=pipeline, job_name=job.name, checkpoint=spec.checkpoint,
                            parameters=bound, code="bench")  # fmt: skip
        query = start_query(spark, spec, pipeline, sink, None, pipeline.outputs(bound)[0] if real_time else None)
        reader = threading.Thread(target=consume, args=(out, sent, seen, halt), daemon=True)
        reader.start()
        time.sleep(8)  # the query's start, before the first record
        cpu_at = None
        writer = threading.Thread(target=produce, args=(source, rate, seconds, sent, halt), daemon=True)
        began = time.time()
        writer.start()
        while writer.is_alive():
            if cpu_at is None and time.time() - began >= warm:
                cpu_at = (time.time(), tree_cpu())
            writer.join(0.5)
            if not query.isActive:
                raise RuntimeError(f"{mode}: the query stopped: {query.exception()}")
        if os.environ.get("BENCH_LATENCY_DUMP"):
            for progress in query.recentProgress[-3:]:
                print("progress", progress.batchId, progress.numInputRows, progress.durationMs, flush=True)
        cpu_seconds = tree_cpu() - (cpu_at[1] if cpu_at else 0.0)
        wall = time.time() - (cpu_at[0] if cpu_at else began)
        time.sleep(interval + 3)  # the last records' counts
        query.stop()
    finally:
        halt.set()
        spark.stop()
        job.delete()
        for topic in (source, out):
            kafka.delete_topic(settings.KAFKA_BOOTSTRAP, topic)
    if dump := os.environ.get("BENCH_LATENCY_DUMP"):  # each record's (produce time, latency ms), to study the tail
        Path(dump).write_text("".join(f"{p:.3f} {(v - p) * 1000:.1f}\n" for p, v in seen if p >= began + warm))
    latencies = sorted((shown - produced) * 1000 for produced, shown in seen if produced >= began + warm)
    total = sum(len(v) for v in sent.at.values())
    if not latencies:
        raise RuntimeError(f"{mode}: no record's count was seen after the warm-up")
    return {
        "mode": mode, "records": total, "measured": len(latencies),
        "p50": statistics.median(latencies), "p90": latencies[int(0.90 * (len(latencies) - 1))],
        "p99": latencies[int(0.99 * (len(latencies) - 1))], "max": latencies[-1],
        "cpu": cpu_seconds / max(wall, 1e-9),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rate", type=float, default=200.0, help="records a second")
    parser.add_argument("--seconds", type=float, default=60.0, help="how long records are produced")
    parser.add_argument("--warm", type=float, default=15.0, help="seconds left out at the start")
    parser.add_argument("--only", choices=sorted(MODES), default="")
    parser.add_argument("--interval", type=float, default=0.0, help="real-time mode's checkpoint interval (5 s)")
    args = parser.parse_args()
    rows = [
        measure(mode, args.rate, args.seconds, args.warm, args.interval)
        for mode in MODES
        if not args.only or mode == args.only
    ]
    print(
        f"url-counts-live on Kafka (3 partitions in, 3 out), {args.rate:g} records/s keyed by URL for "
        f"{args.seconds:g} s, the first {args.warm:g} s left out; produce -> a read_committed consumer sees the count\n"
    )
    print(f"real-time mode's checkpoint every {args.interval or MODES['real-time'][1]:g} s\n")
    print(
        "| mode | records | measured | p50 ms | p90 ms | p99 ms | max ms | CPU cores |\n|---|---:|---:|---:|---:|---:|---:|---:|"
    )
    for r in rows:
        print(
            f"| {r['mode']} | {r['records']:,} | {r['measured']:,} | {r['p50']:.1f} | {r['p90']:.1f} | "
            f"{r['p99']:.1f} | {r['max']:.0f} | {r['cpu']:.2f} |"
        )


if __name__ == "__main__":
    main()
