"""What a query's run costs in its first batch, in one JVM that has run the query before: the part of a takeover's
first batch that no warm-up can take away.

    .venv/bin/python -m bench.restart_cost [--restarts 8] [--busy-loops 2] [--backend rocksdb]

One url-counts query (local[1], four state partitions, trigger 2 s, the sink's own steps short of the write:
``rehearse``) on a producer at 300 events/s, with ``--busy-loops`` Python loops on the cores beside it (the on-call
engineer's machine is not idle). After 30 s it is stopped between two batches and started again on its checkpoint,
``--restarts`` times, in the same JVM: every run after the first finds the JVM's code loaded and compiled by the runs
before it, its Python workers started, its checkpoint's files in the page cache. Prints, per run, its first batch
against the median of its next five (Spark's triggerExecution and the stateful operator's update and commit times),
and their ratio. A standby's takeover is such a restart (in a JVM whose warm query has been started twice), with the
replay of the batch in flight on top. ``--hadoop-files`` runs it on Hadoop's own local file system rather than the
quiet one (workers/spark/quiet_files.py). Uses Redis database 12.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ["REDIS_URL"] = "redis://127.0.0.1:6379/12"
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "statekeeper.settings")
os.environ.setdefault("STATEKEEPER_ENV", "development")  # a local measurement

import django  # noqa: E402

django.setup()

from bench.database import migrated  # noqa: E402

migrated()

import redis  # noqa: E402

from dashboard import pipelines  # noqa: E402
from dashboard.engine.samples import sample_events  # noqa: E402
from statekeeper.polling import wait_for  # noqa: E402
from workers.sink import rehearse  # noqa: E402
from workers.spark.query import JobSpec, start_query  # noqa: E402
from workers.spark.session import build_session  # noqa: E402

STREAM = "bench:restart-cost"
RATE = 300  # events/s
PARTITIONS = 4
TRIGGER_SECONDS = 2.0  # long enough for a batch on a busy host: the query pauses between batches


def produce(client: Any, halt: threading.Event) -> None:
    make = sample_events(pipelines.get("url-counts"), random.Random(1))
    while not halt.wait(0.1):
        pipe = client.pipeline(transaction=False)
        for _ in range(RATE // 10):
            pipe.xadd(STREAM, {"v": make(int(time.time() * 1000))})
        pipe.execute()


def data_batches(query: Any, count: int) -> list[Any] | None:
    """The run's first ``count`` batches that read events, once it has them."""
    done = [p for p in query.recentProgress if p.numInputRows > 0]
    return done[:count] if len(done) >= count else None


def stop_between_batches(query: Any) -> None:
    """Stop the query while no batch runs: a batch cut off would be replayed by the next run, which is a kill's cost
    and not what this measures."""
    with contextlib.suppress(TimeoutError):  # a run that never pauses: its batch in flight is replayed, as at a kill
        wait_for(lambda: not query.status["isTriggerActive"], 10, 0.01, "a pause between two batches")
    query.stop()


def consume(frame: Any, batch_id: int) -> None:
    rehearse(pipelines.get("url-counts"), frame)


def to_replay(checkpoint: Path) -> int:
    """The changelog files a run starting now replays on partition 0's state: those newer than its newest snapshot
    on the checkpoint (rocksdb-incremental; 0 for a backend that writes a snapshot at every commit)."""
    state = checkpoint / "state" / "0" / "0"
    versions = lambda suffix: [int(f.name.split(".")[0].split("_")[0]) for f in state.glob(f"*.{suffix}")]  # noqa: E731
    snapshot = max(versions("zip"), default=0)
    return sum(1 for version in versions("changelog") if version > snapshot)


def figures(progress: Any) -> tuple[int, int, int]:
    operator = progress.stateOperators[0]
    return progress.durationMs["triggerExecution"], operator.allUpdatesTimeMs, operator.commitTimeMs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--restarts", type=int, default=8)
    parser.add_argument("--busy-loops", type=int, default=2)
    parser.add_argument("--backend", default="rocksdb", choices=("memory", "rocksdb", "rocksdb-incremental"))
    parser.add_argument(
        "--hadoop-files", action="store_true",
        help="Hadoop's own local file system (a forked chmod for each file) rather than the quiet one",
    )  # fmt: skip
    parser.add_argument(
        "--maintenance-seconds", type=float, default=None,
        help="STATEKEEPER_STATE_MAINTENANCE_SECONDS for this run (default: the console's setting)",
    )  # fmt: skip
    parser.add_argument(
        "--first-run-seconds", type=float, default=30, help="how long the query runs before its first stop"
    )
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="sk-bench-restart-"))
    client = redis.Redis.from_url(os.environ["REDIS_URL"])
    client.delete(STREAM)
    pipeline = pipelines.get("url-counts")
    spec = JobSpec(
        job_id=0, name="restart-cost", pipeline="url-counts", stream=STREAM, redis_url=os.environ["REDIS_URL"],
        backend=args.backend, trigger_seconds=TRIGGER_SECONDS, partitions=PARTITIONS, parallelism=1,
        checkpoint=str(root / "checkpoint"), batches_retained=100, max_records=100_000, dead_letter=f"{STREAM}:dead",
    )  # fmt: skip
    halt = threading.Event()
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy_loops)]
    extra = {"spark.hadoop.fs.file.impl": "org.apache.hadoop.fs.LocalFileSystem"} if args.hadoop_files else {}
    if args.maintenance_seconds is not None:  # read by build_session, as a driver's session reads it
        os.environ["STATEKEEPER_STATE_MAINTENANCE_SECONDS"] = str(args.maintenance_seconds)
    spark = build_session("bench-restart-cost", "local[1]", backend=args.backend, partitions=PARTITIONS, extra=extra)
    rows: list[tuple[int, int, tuple[int, int, int], tuple[float, ...]]] = []
    try:
        threading.Thread(target=produce, args=(client, halt), daemon=True).start()
        query = start_query(spark, spec, pipeline, consume)
        time.sleep(args.first_run_seconds)
        for run in range(1, args.restarts + 1):
            stop_between_batches(query)
            replays = to_replay(Path(spec.checkpoint))
            query = start_query(spark, spec, pipeline, consume)
            batches = wait_for(functools.partial(data_batches, query, 6), 120, 0.2, "six batches of the run")
            later = [figures(p) for p in batches[1:]]
            rows.append(
                (run, replays, figures(batches[0]), tuple(statistics.median(s[i] for s in later) for i in range(3)))
            )
        stop_between_batches(query)
    finally:
        halt.set()
        for loop in loops:
            loop.kill()
        spark.stop()
        client.delete(STREAM, f"{STREAM}:dead", f"{STREAM}:dead:seen")
        shutil.rmtree(root, ignore_errors=True)

    print(
        f"url-counts, {args.backend}, local[1], {PARTITIONS} state partitions, trigger {TRIGGER_SECONDS:.0f} s, "
        f"{RATE} events/s, "
        f"{args.busy_loops} busy loops beside, {'Hadoop' if args.hadoop_files else 'the quiet'} local file system; "
        f"{time.strftime('%Y-%m-%d')}\n"
    )
    print("| run (restarts in this JVM) | changelogs to replay | first batch ms | next five, median ms | ratio "
          "| first: state updates / commit ms | next five: state updates / commit ms |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for run, replays, first, steady in rows:
        print(
            f"| {run} | {replays} | {first[0]:,} | {steady[0]:,.0f} | {first[0] / steady[0]:.2f} | {first[1]} / {first[2]} "
            f"| {steady[1]:.0f} / {steady[2]:.0f} |"
        )
    ratios = [first[0] / steady[0] for _, _, first, steady in rows[len(rows) // 2 :]]
    print(f"\nmedian ratio of the later half of the runs: {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
