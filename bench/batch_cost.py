"""Where a micro-batch's fixed cost goes (issue 44 §2): CPU seconds per committed batch, by process and by the JVM's
threads, for url-counts jobs like the demo's at 50 events/s each (memory backend, trigger 2 s), and the batch's
phases as Spark reports them.

    .venv/bin/python -m bench.batch_cost [--jobs 1] [--window 60] [--trigger 2] [--driver shared|own]
        [--source redis|kafka]

Starts its own Celery worker (as bench.density does; Redis database 13) and a producer. Over the window it reads, from
/proc, the CPU time of every process of the jobs' drivers (the JVM thread by thread, grouped by the thread's name; the
Python driver; Spark's Python daemons and the workers they fork), of PostgreSQL's and Redis' server processes (the
sinks' and the progress records' writes land there; the producer's writes too), and of the benchmark's Celery worker
(the console's side: ingest, beat). A process's children that ended in the window (a forked Python worker, a `chmod`)
count in their parent's line. Each figure is divided by the batches the jobs committed in the window.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import re
import statistics
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.density import RATE, ROOT, add_jobs, end_jobs, job_pids, produce, settle  # sets Django up

# isort: split
import redis  # noqa: E402  (after bench.density: it chooses the Redis database)
from django.utils import timezone  # noqa: E402

from bench.busy import start_worker  # noqa: E402
from bench.kafka_source import use_cached_connector  # noqa: E402
from bench.procs import command, cpu_ticks, parents, process_tree  # noqa: E402
from dashboard.models import Checkpoint, Job  # noqa: E402
from workers.spark.worker_daemon import MODULE as WORKER_DAEMON  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
PHASES = (
    ("latest_offset_ms", "latestOffset (the source's planning call)"),
    ("query_planning_ms", "queryPlanning"),
    ("wal_commit_ms", "walCommit (offsets file)"),
    ("add_batch_ms", "addBatch (the batch and its sinks)"),
    ("state_commit_ms", "state commit"),
    ("commit_offsets_ms", "commitOffsets (commit file)"),
    ("duration_ms", "whole batch (triggerExecution)"),
)


def role(pid: int, parent_of: dict[int, int]) -> str:
    """What a process of a job's driver is, from its command line: the JVM, the Python driver, a Spark Python daemon
    (named by its worker module) or a worker it forked."""
    text = command(pid)
    if "java" in text.split(" ", 1)[0]:
        return "JVM"
    for daemon_module in ("pyspark.daemon", WORKER_DAEMON):
        if daemon_module in text:
            module = text.split(daemon_module, 1)[1].strip() or "pyspark.worker"
            parent = parent_of.get(pid)
            daemon = not parent or daemon_module not in command(parent)
            return f"Python {module} ({'daemon' if daemon else 'forked worker'})"
    if "workers.host_process" in text or "workers.driver_process" in text:
        return "Python driver"
    if "workers.spark.fork_server" in text:  # Spark's source runner runs in a process this server forks
        return "Python fork server (the source runner)"
    return f"other: {text[:40]}"


SERVERS = (("postgres", "PostgreSQL (all its processes)"), ("redis-server", "Redis server"))


THREAD_NUMBER = re.compile(r"[-#]?\d+$")


def snapshot(worker_pid: int) -> dict[tuple[str, str], int]:
    """CPU ticks so far, keyed (group, line): each process role, the JVM by thread name, the servers, the worker."""
    ticks: dict[tuple[str, str], int] = collections.Counter()
    parent_of = parents()
    jobs = job_pids()
    for pid in jobs:
        try:
            kind = role(pid, parent_of)
            _, own, children = cpu_ticks(Path(f"/proc/{pid}/stat"))
            ticks[("process", kind)] += own
            ticks[("process", f"{kind}: children that ended")] += children
            if kind == "JVM":
                for task in Path(f"/proc/{pid}/task").iterdir():
                    name, cpu, _ = cpu_ticks(task / "stat")
                    ticks[("thread", THREAD_NUMBER.sub("", name.strip()) or name)] += cpu
        except (OSError, IndexError, ValueError):
            continue
    for entry in Path("/proc").iterdir():  # PostgreSQL's and Redis' server processes, by name
        if not entry.name.isdigit():
            continue
        try:
            name, own, children = cpu_ticks(entry / "stat")
        except (OSError, IndexError, ValueError):
            continue
        for prefix, label in SERVERS:
            if name.startswith(prefix):
                ticks[("server", label)] += own + children
    for pid in set(process_tree(worker_pid)) - jobs:  # a shared driver is a child of a pool process
        try:
            _, own, children = cpu_ticks(Path(f"/proc/{pid}/stat"))
        except (OSError, IndexError, ValueError):
            continue
        ticks[("server", "the console's Celery worker and beat")] += own + children
    return ticks


@contextlib.contextmanager
def flight_recorder(path: str) -> Iterator[None]:
    """Java Flight Recorder's sampling profile of every job JVM while the block runs, one file each (``path``, with
    the pid before its suffix); read with ``jfr print --events jdk.ExecutionSample``. The profile costs the JVM CPU
    of its own: its figures are not the plain run's."""
    parent_of = parents()
    jvms = [pid for pid in job_pids() if role(pid, parent_of) == "JVM"]
    for pid in jvms:
        subprocess.run(
            ["jcmd", str(pid), "JFR.start", "name=batch", "settings=profile"], check=True, capture_output=True
        )
    try:
        yield
    finally:
        stem, suffix = os.path.splitext(path)
        for pid in jvms:
            out = f"{stem}-{pid}{suffix or '.jfr'}"
            subprocess.run(["jcmd", str(pid), "JFR.dump", "name=batch", f"filename={out}"], capture_output=True)
            print(f"flight recording of JVM {pid}: {out}")


def batches_in(jobs: list[Job], since: Any) -> list[Checkpoint]:
    return list(Checkpoint.objects.filter(job__in=jobs, committed_at__gte=since))


def report(before: dict, after: dict, batches: int, seconds: float, rows: list[Checkpoint]) -> None:
    delta = {key: (after.get(key, 0) - before.get(key, 0)) / TICK for key in after}
    per = max(1, batches)
    print(f"\n{batches} batches committed in {seconds:.0f} s\n")
    for group, title in (("process", "Process"), ("server", "Server"), ("thread", "JVM thread (by name)")):
        lines = sorted(((k[1], v) for k, v in delta.items() if k[0] == group and v > 0), key=lambda kv: -kv[1])
        total = sum(v for _, v in lines)
        print(f"| {title} | CPU s a batch | cores | share |")
        print("|---|---:|---:|---:|")
        shown = lines if group != "thread" else lines[:14]
        for name, value in shown:
            print(f"| {name} | {value / per:.3f} | {value / seconds:.3f} | {value / total:.0%} |")
        if group == "thread" and len(lines) > len(shown):
            rest = sum(v for _, v in lines[len(shown) :])
            print(
                f"| {len(lines) - len(shown)} other names | {rest / per:.3f} | {rest / seconds:.3f} | {rest / total:.0%} |"
            )
        print(f"| **all** | **{total / per:.3f}** | **{total / seconds:.3f}** | |\n")
    print("| Phase (Spark's progress) | median | p95 |")
    print("|---|---:|---:|")
    for field, label in PHASES:
        values = sorted(getattr(row, field) for row in rows)
        if values:
            p95 = values[min(len(values) - 1, int(len(values) * 0.95))]
            print(f"| {label} | {statistics.median(values):.0f} ms | {p95:.0f} ms |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--window", type=float, default=60)
    parser.add_argument("--trigger", type=float, default=2)
    parser.add_argument("--driver", choices=("shared", "own"), default="shared")
    parser.add_argument("--settle", type=float, default=0, help="seconds more before the window (the JIT's warm-up)")
    parser.add_argument("--jfr", default="", help="record the JVMs with Java Flight Recorder over the window, here")
    parser.add_argument("--source", choices=("redis", "kafka"), default="redis", help="each job's own stream or topic")
    args = parser.parse_args()
    if args.source == "kafka":
        use_cached_connector()
    client = redis.Redis.from_url(os.environ["REDIS_URL"])
    client.flushdb()
    worker = start_worker(ROOT)
    halt = threading.Event()
    jobs: list[Job] = []
    threading.Thread(target=produce, args=(client, jobs, halt), daemon=True).start()
    try:
        add_jobs(jobs, args.jobs, int(time.time()), trigger=args.trigger, driver=args.driver, source=args.source)
        settle(jobs, args.trigger)
        time.sleep(args.settle)
        since, clock, before = timezone.now(), time.monotonic(), snapshot(worker.pid)
        recording = flight_recorder(args.jfr) if args.jfr else contextlib.nullcontext()
        with recording:
            time.sleep(args.window)
        after, seconds = snapshot(worker.pid), time.monotonic() - clock
        rows = batches_in(jobs, since)
    finally:
        halt.set()
        end_jobs(jobs, worker.pid)
    print(
        f"\n{args.jobs} url-counts job(s) on {args.source}, {args.driver} driver, trigger {args.trigger:g} s, {RATE} events/s each, "
        f"window {args.window:g} s after {args.settle:g} s more to settle"
    )
    report(before, after, len(rows), seconds, rows)


if __name__ == "__main__":
    main()
