"""Savepoint verification and state-inspector pages with the warm state reader, against a JVM of their own each.

    .venv/bin/python -m bench.state_reads [--rounds 3] [--events 60000]

Builds the state of the demo's order-state-machine job on RocksDB (its own query and sink over a backlog; the demo's
generator keeps a few dozen orders open), then, each round and each way (a new JVM per read, as before; the warm reader), takes a
savepoint and requests an inspector page (a page of keys of a retained batch) as the console does (the actions run
in this process, as a Celery worker runs them). Prints the time from the end of the savepoint's copy to its being
listed as verified (target ≤ 3 s) and the time an inspection takes from its request to its answer (target ≤ 2 s),
medians; the warm reader's first read after a quiet spell pays its start, shown apart, and so does the first read of
a reader started ahead of it (as opening the inspector page does), once it listens.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time

import redis
from django.conf import settings
from django.test import override_settings

from bench.pipeline_throughput import ROOT, fill, run  # first: it sets up Django on the benchmark databases
from dashboard.models import Action, ActionKind, ActionStatus, Job
from dashboard.pipelines import get as get_pipeline
from dashboard.services.actions import action_execute, action_request
from dashboard.services.state_reader_client import (  # noqa: E402
    state_reader_pid,
    state_reader_stop,
    state_reader_warm,
    state_reader_warmed,
)
from statekeeper.polling import wait_for
from workers.driver import job_spec
from workers.spark.session import build_session


def timed_action(job: Job, kind: str, **params: object) -> tuple[float, Action]:
    started = time.perf_counter()
    action = action_request(job=job, kind=kind, params=params)
    done = action_execute(action_id=action.id)
    if done.status != ActionStatus.SUCCEEDED:
        raise SystemExit(f"{kind} failed: {done.outcome}")
    return time.perf_counter() - started, done


def one_round(job: Job) -> tuple[float, float]:
    """Seconds from the copy's end to verified, and seconds an inspection takes."""
    _, action = timed_action(job, ActionKind.SAVEPOINT)
    savepoint = job.savepoints.get(action=action)
    after_copy = (savepoint.duration_ms - savepoint.manifest["copy_ms"]) / 1000
    inspect, _ = timed_action(job, ActionKind.INSPECT_STATE, mode="keys", operator=0, variable="order", limit=50)
    return after_copy, inspect


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--events", type=int, default=60_000)
    args = parser.parse_args()
    client = redis.Redis.from_url(settings.REDIS_URL)
    pipeline = get_pipeline("order-state-machine")
    job = Job.objects.create(
        name=f"bench-reads-{int(time.time())}", pipeline=pipeline.name, source_stream=f"bench:reads:{time.time()}",
        state_backend="rocksdb", max_records_per_batch=20_000, lease_token=1,
    )  # fmt: skip
    spark = build_session("statekeeper-bench-reads", "local[2]")
    figures: dict[str, list[tuple[float, float]]] = {"new JVM": [], "warm reader": []}
    try:
        fill(client, job.source_stream, pipeline, args.events)
        run(spark, job_spec(job, trigger_seconds=0), pipeline, "full", args.events)
        spark.stop()
        state_reader_stop()
        with override_settings(STATE_READER_IDLE_SECONDS=0):
            figures["new JVM"] = [one_round(job) for _ in range(args.rounds)]
        first = one_round(job)  # starts the reader
        state_reader_stop()
        wait_for(lambda: state_reader_pid() is None, 30, what="the reader to end")
        began = time.perf_counter()
        state_reader_warm()  # as opening the inspector page does
        wait_for(state_reader_warmed, 300, 0.2, "the reader to warm up")
        ready = time.perf_counter() - began
        warmed = one_round(job)
        reader = state_reader_pid()
        figures["warm reader"] = [one_round(job) for _ in range(args.rounds)]
        if state_reader_pid() != reader:
            raise SystemExit("the reader was replaced during the measurement")
        keys = Action.objects.filter(job=job, kind=ActionKind.INSPECT_STATE).last()
        total = (keys.params.get("result") or {}).get("total") if keys else None
    finally:
        state_reader_stop()
        client.delete(job.source_stream, job.dead_letter_stream)
        wait_for(lambda: state_reader_pid() is None, 30, what="the reader to end")
        job.delete()
        shutil.rmtree(ROOT, ignore_errors=True)
    print(
        f"order-state-machine on RocksDB, {args.events:,} events, {total} orders in the state; "
        f"median of {args.rounds} rounds each way\n"
    )
    print("| read | new JVM each | warm reader | target |\n|---|---:|---:|---:|")
    for i, (what, target) in enumerate((("savepoint: copy end → verified (s)", 3), ("inspector page (s)", 2))):
        cold = statistics.median(r[i] for r in figures["new JVM"])
        warm = statistics.median(r[i] for r in figures["warm reader"])
        print(f"| {what} | {cold:.2f} | {warm:.2f} | ≤ {target} |")
    print(f"\nthe warm reader's first read (it starts): verified after {first[0]:.1f} s, inspection {first[1]:.1f} s")
    print(
        f"started ahead (as the inspector page does), it is warm after {ready:.1f} s; "
        f"then its first read: verified after {warmed[0]:.2f} s, inspection {warmed[1]:.2f} s"
    )
    print(f"rounds: {figures}")


if __name__ == "__main__":
    main()
