"""Every shipped pipeline at saturation: a backlog in Redis read through the project's source, transform and fenced
PostgreSQL sink, as a driver runs it (local[2], the job's defaults), and where the time goes.

    .venv/bin/python -m bench.pipeline_throughput [--events 200000] [--batch 100000] [--repeat 2] [--only url-counts]
        [--source kafka [--python-checks]]

With ``--source kafka`` the backlog is a Kafka topic of as many partitions as cores, on STATEKEEPER_KAFKA_BOOTSTRAP
(the broker bin/dev starts), read by Spark's own Kafka source (its connector from var/jars/spark-kafka, which the
set-up fetches), in place of a Redis stream read by the project's Python source. Its records are checked in the JVM
when their payload allows (workers/spark/sources/jvm_checks.py); ``--python-checks`` checks them in Python, for the
pair.

Each pipeline runs three queries over the same backlog, each on a fresh checkpoint, batch after batch (trigger 0 s)
at the job's batch limit; a rate is the events of the batches after the query's first over their own durations
(triggerExecution), since the first batch pays the query's start:
- source: the Redis source and its payload parsing, into Spark's no-op sink;
- + transform: the pipeline's transform and its state store commits, into the no-op sink;
- full: the driver's query (``start_query``) with its real sink (``batch_writer``: results upserted in PostgreSQL under
  the job's lease).
The shares are the differences between them over the full run; "state commit" is Spark's own stateOperators
commitTimeMs, task time divided by the cores. Targets (issue 13): order-state-machine >= 15k events/s (also for -v2,
its bucketed version), url-counts >= 100k events/s. Uses Redis database 13 and a job row per pipeline in the development database, removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ["REDIS_URL"] = "redis://127.0.0.1:6379/13"
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "statekeeper.settings")
os.environ.setdefault("STATEKEEPER_ENV", "development")  # a local measurement
ROOT = Path(tempfile.mkdtemp(prefix="sk-bench-throughput-"))
os.environ["STATEKEEPER_CHECKPOINT_ROOT"] = str(ROOT / "checkpoints")

import django  # noqa: E402

django.setup()

from bench.database import migrated  # noqa: E402
from bench.kafka_source import use_cached_connector  # noqa: E402

migrated()

import redis  # noqa: E402
from django.conf import settings  # noqa: E402

from dashboard import kafka, pipelines  # noqa: E402
from dashboard.models import Job, ResultRow  # noqa: E402
from workers.driver import job_spec  # noqa: E402
from workers.sink import batch_writer  # noqa: E402
from workers.spark import cluster  # noqa: E402
from workers.spark.query import JobSpec, events_frame, session_settings, start_query  # noqa: E402
from workers.spark.session import build_session  # noqa: E402

CORES = 2
TARGETS = {"order-state-machine": 15_000, "order-state-machine-v2": 15_000, "url-counts": 100_000}


def fill_kafka(topic: str, pipeline: Any, count: int) -> None:
    make = pipeline.generator(random.Random(7))
    now = int(time.time() * 1000)
    kafka.ensure_topic(settings.KAFKA_BOOTSTRAP, topic, CORES)
    producing = kafka.producer(settings.KAFKA_BOOTSTRAP)
    kafka.send_all(producing, topic, ((str(i).encode(), make(now + i // 1000).encode()) for i in range(count)))


def fill(client: Any, stream: str, pipeline: Any, count: int) -> None:
    make = pipeline.generator(random.Random(7))
    now = int(time.time() * 1000)
    client.delete(stream)
    for start in range(0, count, 10_000):
        pipe = client.pipeline(transaction=False)
        for i in range(start, min(count, start + 10_000)):
            pipe.xadd(stream, {"v": make(now + i // 1000)})
        pipe.execute()


def run(spark: Any, spec: JobSpec, pipeline: Any, part: str, events: int, sink: Any = None) -> dict[str, float]:
    """One query over the whole backlog, batch after batch with no pause (trigger 0 s) and the job's batch limit,
    stopped once it has read every event (``sink``: the foreachBatch of a full run, else the job's own): its rows, and the seconds and state commit time of its batches after the
    first (a query's first batch pays its start: the source's process, the first plan, loading the state)."""
    session_settings(spark, spec, pipeline)
    if part == "full":
        sink = sink or batch_writer(job_id=spec.job_id, token=1, pipeline=pipeline, dead_letters=spec.dead_letter,
                                    redis_url=spec.redis_url)  # fmt: skip
        query = start_query(spark, spec, pipeline, sink)
    else:
        frame = events_frame(spark, spec, pipeline)
        if part == "transform":
            frame = pipeline.transform(frame)
        mode = pipeline.output_mode if part == "transform" else "append"
        query = (
            frame.writeStream.format("noop")
            .outputMode(mode)
            .option("checkpointLocation", spec.checkpoint)
            .trigger(processingTime="0 seconds")
            .start()
        )

    def progress() -> list[dict[str, Any]]:
        return [p for p in (json.loads(p.json) if hasattr(p, "json") else p for p in query.recentProgress)
                if p.get("numInputRows")]  # fmt: skip

    deadline = time.monotonic() + 1800
    try:
        while query.isActive and sum(p["numInputRows"] for p in progress()) < events:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{pipeline.name} {part}: not through the backlog in 30 minutes")
            time.sleep(0.2)
        while query.isActive and query.status["isTriggerActive"] and time.monotonic() < deadline:
            time.sleep(0.1)  # a batch after the last input (a watermark's eviction) ends before the stop, not in it
    finally:
        query.stop()
    if query.exception():
        raise RuntimeError(f"{pipeline.name} {part}: {query.exception()}")
    batches = progress()
    steady = batches[1:] or batches
    if len(steady) > 1 and steady[-1]["numInputRows"] < 0.01 * max(p["numInputRows"] for p in steady):
        # the few records Spark's Kafka source leaves after splitting the limit among partitions (99,999 and then 1):
        # a batch of its own that a backlog read at saturation never has
        steady = steady[:-1]
    commit_ms = sum(op.get("commitTimeMs", 0) for p in steady for op in p.get("stateOperators", []))
    return {
        "rows": sum(p["numInputRows"] for p in batches),
        "steady_rows": sum(p["numInputRows"] for p in steady),
        "seconds": sum(p["durationMs"]["triggerExecution"] for p in steady) / 1000,
        "commit": commit_ms / 1000 / CORES,
        "batches": len(batches),
    }


def measure(
    spark: Any, client: Any, name: str, events: int, batch: int, repeat: int, parts: list[str], source: str = "redis"
) -> dict[str, Any]:
    pipeline = pipelines.get(name)
    backend = "rocksdb" if pipeline.needs_rocksdb else "memory"
    stamp = int(time.time())
    where = (
        {"source_kind": "kafka", "source_stream": f"bench-tp-{name}-{stamp}", "source_path": settings.KAFKA_BOOTSTRAP}
        if source == "kafka" else {"source_stream": f"bench:tp:{name}"}
    )  # fmt: skip
    job = Job.objects.create(
        name=f"bench-tp-{name}-{stamp}", pipeline=name, state_backend=backend, parallelism=CORES,
        max_records_per_batch=batch, lease_token=1, **where,
    )  # fmt: skip
    try:
        if source == "kafka":
            fill_kafka(job.source_stream, pipeline, events)
        else:
            fill(client, job.source_stream, pipeline, events)
        figures: dict[str, list[dict[str, float]]] = {part: [] for part in parts}
        for attempt in range(repeat + 1):  # the first round warms this pipeline's code up, and is not counted
            for part in figures:
                checkpoint = ROOT / "checkpoints" / f"{job.id}-{part}-{attempt}"
                spec = job_spec(job, trigger_seconds=0, checkpoint=str(checkpoint))
                ResultRow.objects.filter(job=job).delete()
                figure = run(spark, spec, pipeline, part, events)
                if figure["rows"] != events:
                    raise RuntimeError(f"{name} {part}: read {figure['rows']} of {events} events")
                if attempt:
                    figures[part].append(figure)
                shutil.rmtree(checkpoint, ignore_errors=True)
        # seconds per event in the steady batches, median over the rounds
        med = {part: statistics.median(f["seconds"] / f["steady_rows"] for f in runs) for part, runs in figures.items()}
        last = parts[-1]
        commit = statistics.median(f["commit"] / f["steady_rows"] for f in figures[last])
        return {
            "name": name,
            "backend": backend,
            "seconds": med,
            "commit": commit,
            "batches": figures[last][0]["batches"],
        }
    finally:
        client.delete(job.source_stream, job.dead_letter_stream)
        if source == "kafka":
            kafka.delete_topic(settings.KAFKA_BOOTSTRAP, job.source_stream)
        job.delete()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--batch", type=int, default=100_000, help="max records per micro-batch")
    parser.add_argument("--repeat", type=int, default=2, help="runs of each part; the median is reported")
    parser.add_argument("--only", action="append", help="a pipeline's name (repeatable); every shipped one by default")
    parser.add_argument("--parts", default="source,transform,full", help="which runs, for profiling one of them")
    parser.add_argument("--cores", type=int, default=2, help="local[N] and the jobs' parallelism")
    parser.add_argument("--cluster", action="store_true", help="on a 1-worker standalone cluster of --cores cores")
    parser.add_argument("--conf", action="append", default=[], help="KEY=VALUE, a Spark setting to try")
    parser.add_argument("--source", choices=["redis", "kafka"], default="redis")
    parser.add_argument(
        "--python-checks",
        action="store_true",
        help="Kafka: each record checked in Python (mapInArrow), as before 12-07",
    )
    args = parser.parse_args()
    if args.source == "kafka":
        use_cached_connector()
    if args.python_checks:
        import workers.spark.sources.kafka as kafka_source

        kafka_source.checks_for = lambda payload, limits: None

    client = redis.Redis.from_url(settings.REDIS_URL)
    global CORES
    CORES = args.cores
    extra = dict(item.split("=", 1) for item in args.conf)
    standalone = cluster.start(ROOT / "spark", workers=1, cores=CORES) if args.cluster else None
    master = standalone.master_url if standalone else f"local[{CORES}]"
    extra |= cluster.driver_conf(master, CORES, str(settings.BASE_DIR))
    spark = build_session("statekeeper-bench-throughput", master, extra=extra)
    parts = args.parts.split(",")
    shipped = [n for n in pipelines.names() if pipelines.reference(n) in settings.BUILTIN_PIPELINES]
    names = args.only or shipped
    try:
        rows = [
            measure(spark, client, name, args.events, args.batch, args.repeat, parts, args.source) for name in names
        ]
    finally:
        spark.stop()
        if standalone:
            cluster.stop(standalone)
        shutil.rmtree(ROOT, ignore_errors=True)
    print(
        f"{args.events:,} events a run from {'a Kafka topic' if args.source == 'kafka' else 'a Redis stream'}"
        f"{' (records checked in Python)' if args.python_checks else ''}, at most {args.batch:,} a batch, trigger 0 s, {master if not standalone else f'a 1-worker standalone cluster, one {CORES}-core executor'}, the job defaults "
        f"(4 state partitions, {CORES} read partitions); events/s over the batches after each query's first, median "
        f"of {args.repeat}\n"
    )
    print(
        "| pipeline | backend | events/s | target | source | transform | of which state commit | sink | batches |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|"
    )
    if parts != ["source", "transform", "full"]:
        for row in rows:
            print(row["name"], {part: f"{1 / s:,.0f}/s" for part, s in row["seconds"].items()})
        return
    for row in rows:
        full, source, transform = row["seconds"]["full"], row["seconds"]["source"], row["seconds"]["transform"]
        target = TARGETS.get(row["name"])
        print(
            f"| {row['name']} | {row['backend']} | {1 / full:,.0f} | {f'{target:,}' if target else '–'} "
            f"| {source / full:.0%} | {max(0.0, transform - source) / full:.0%} | {row['commit'] / full:.0%} "
            f"| {max(0.0, full - transform) / full:.0%} | {row['batches']} |"
        )


if __name__ == "__main__":
    main()
