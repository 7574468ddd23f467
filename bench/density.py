"""Density: how many small jobs one machine runs, each keeping up. url-counts jobs at 50 events/s each are added step
by step (in the shared driver, or each with a driver of its own); at each step the machine's memory, the Statekeeper
processes' memory per job, each job's checkpoint latency p95 and its lag are measured over a window.

    .venv/bin/python -m bench.density [--steps 1,10,20,30,40] [--window 60] [--driver shared|own] [--standbys N]
                                      [--trigger SECONDS] [--cluster] [--source redis|kafka]

Starts its own Celery worker with beat (concurrency 2, as bin/dev; Redis database 13) and a producer. The jobs are
the demo's url-counts job (memory backend, local[1], trigger 2 s unless ``--trigger``). ``--standbys N`` ticks the
warm standby on the first N jobs. A job keeps up when its lag at the end of the window is under its trigger interval
and 3 s of its events (250 at a trigger of 2 s: a batch's worth arrives while it runs). Target (issue
24): 40 jobs or more, each keeping up, with checkpoint p95 at most twice the single job's.

``--source kafka``: each job reads a Kafka topic of its own (one partition) through Spark's own Kafka source, in place
of a Redis stream through the project's Python source; its lag is the topic's end offset against its newest batch's.

``--pipeline NAME --backend memory|rocksdb``: jobs of another pipeline, each fed its pipeline's sample events. A plan
that runs batches without new data (a watermark, a processing-time clock) is not spread over the interval.

``--cluster``: a Spark standalone cluster (a master and one worker of 2 cores, from the wheel's ``spark-class``) runs
the jobs' tasks. With the shared driver, its jobs share one application's executor; the jobs' processes then include
that executor and its Python workers (not the master and worker daemons). With ``--driver own`` each job is an
application holding a core of its own, so the third job waits for a free one.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import random
import re
import statistics
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

os.environ["REDIS_URL"] = "redis://127.0.0.1:6379/13"
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "statekeeper.settings")
os.environ.setdefault("STATEKEEPER_ENV", "development")  # a local measurement
ROOT = Path(tempfile.mkdtemp(prefix="sk-bench-density-"))
os.environ["STATEKEEPER_CHECKPOINT_ROOT"] = str(ROOT / "checkpoints")
os.environ["STATEKEEPER_LOG_ROOT"] = str(ROOT / "logs")

import django  # noqa: E402

from bench.database import migrated, own_database  # noqa: E402

own_database()  # not the console's: the benchmark ends every driver it finds there
django.setup()


migrated()

import redis  # noqa: E402
from django.conf import settings  # noqa: E402
from django.utils import timezone  # noqa: E402

from bench.busy import start_worker  # noqa: E402
from bench.kafka_source import use_cached_connector  # noqa: E402
from bench.procs import cpu_ticks, process_tree, sizes  # noqa: E402
from dashboard import kafka  # noqa: E402
from dashboard.engine.samples import sample_events  # noqa: E402
from dashboard.models import Checkpoint, DriverHost, Job, Run, RunStatus, StandbyDriver  # noqa: E402
from dashboard.pipelines import get as get_pipeline  # noqa: E402
from dashboard.records import source_position  # noqa: E402
from dashboard.services.errors import ActionRefused  # noqa: E402
from dashboard.services.runs import job_request_start, job_request_stop, kill_group  # noqa: E402
from statekeeper.polling import wait_for  # noqa: E402
from workers.spark import cluster  # noqa: E402

RATE = 50  # events/s per job


def machine_used_mib() -> int:
    info = {line.split(":")[0]: int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()}
    return (info["MemTotal"] - info["MemAvailable"]) // 1024


CLUSTER: list[cluster.Standalone] = []  # --cluster: its executors are the jobs' too


def job_roots() -> set[int | None]:
    roots: set[int | None] = {pid for standalone in CLUSTER for pid in cluster.executor_processes(standalone)}
    roots |= set(Run.objects.filter(status=RunStatus.RUNNING).exclude(pid=None).values_list("pid", flat=True))
    roots |= set(DriverHost.objects.exclude(status="gone").exclude(pid=None).values_list("pid", flat=True))
    roots |= set(StandbyDriver.objects.filter(ended_at=None).exclude(pid=None).values_list("pid", flat=True))
    return roots


def job_pids() -> set[int]:
    """Every process of every driver, shared driver and standby process tree."""
    return {pid for root in job_roots() if root for pid in process_tree(root)}


def statekeeper_pss_mib() -> int:
    """PSS of every driver, shared driver and standby process tree (the jobs' whole cost, not the console's)."""
    total = 0
    for pid in job_pids():
        try:
            total += sizes(pid)[0]
        except OSError:
            continue
    return total // 1024


def statekeeper_cpu_seconds() -> float:
    """CPU time (user and system) used so far by every driver, shared driver and standby process tree."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in job_pids():
        try:
            total += cpu_ticks(Path(f"/proc/{pid}/stat"))[1]
        except (OSError, IndexError, ValueError):
            continue
    return total / tick


def produce(client: Any, jobs: list[Job], halt: threading.Event) -> None:
    """RATE events/s into every job's stream or topic (its pipeline's sample events), in ticks of 200 ms."""
    makers: dict[str, Any] = {}
    producing = kafka.producer(settings.KAFKA_BOOTSTRAP)
    while not halt.wait(0.2):
        pipe = client.pipeline(transaction=False)
        for job in list(jobs):
            make = makers.setdefault(job.pipeline, sample_events(get_pipeline(job.pipeline), random.Random(7)))
            for _ in range(RATE // 5):
                if job.reads_kafka:
                    producing.produce(job.source_stream, make(int(time.time() * 1000)).encode())
                else:
                    pipe.xadd(job.source_stream, {"v": make(int(time.time() * 1000))})
        pipe.execute()
        producing.poll(0)
    producing.flush()


def source_lag(client: Any, job: Job) -> int:
    """Records in the job's source after its newest committed batch."""
    latest = Checkpoint.objects.filter(job=job).order_by("-batch_id").first()
    read = (source_position(latest.end_offset) or 0) if latest else 0
    if job.reads_kafka:
        return (
            sum(end for _, end in kafka.end_offsets(kafka.Cluster(job.source_path), job.source_stream).values()) - read
        )
    return client.xlen(job.source_stream) - read


def p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=20)[-1] if len(values) >= 2 else (values[0] if values else float("nan"))


def measure(jobs: list[Job], client: Any, window: float, keeping_up: float) -> dict[str, Any]:
    began, cpu_began, clock = timezone.now(), statekeeper_cpu_seconds(), time.monotonic()
    memory = []
    deadline = time.monotonic() + window
    while time.monotonic() < deadline:
        memory.append((machine_used_mib(), statekeeper_pss_mib()))
        time.sleep(max(0.0, min(10.0, deadline - time.monotonic())))
    durations: dict[int, list[float]] = collections.defaultdict(list)
    for job_id, ms in Checkpoint.objects.filter(job__in=jobs, committed_at__gte=began).values_list(
        "job_id", "duration_ms"
    ):
        durations[job_id].append(ms)
    lags = []
    for job in jobs:
        lags.append(source_lag(client, job))
    p95s = [p95(durations[job.id]) for job in jobs if durations[job.id]]
    cores = (statekeeper_cpu_seconds() - cpu_began) / (time.monotonic() - clock)
    return {
        "cores": cores,
        "machine": max(m for m, _ in memory),
        "pss": max(p for _, p in memory),
        "p95_median": statistics.median(p95s) if p95s else float("nan"),
        "p95_max": max(p95s) if p95s else float("nan"),
        "lag_max": max(lags),
        "keeping_up": sum(1 for lag in lags if lag <= keeping_up),
        "silent": sum(1 for job in jobs if not durations[job.id]),
        "failed": Run.objects.filter(job__in=jobs, status=RunStatus.FAILED).count(),  # since the first step
    }


def add_jobs(
    jobs: list[Job], count: int, stamp: int, *, trigger: float, driver: str, standbys: int = 0,
    pipeline: str = "url-counts", backend: str = "memory", source: str = "redis",
) -> None:  # fmt: skip
    """Jobs like the demo's url-counts (memory backend, 2 state partitions; or ``pipeline`` on ``backend``, and a
    Kafka topic of its own with ``source``) started until ``jobs`` holds ``count``."""
    while len(jobs) < count:
        name = f"density-{stamp}-{len(jobs)}"
        where = {"source_stream": f"bench:{name}"}
        if source == "kafka":
            kafka.ensure_topic(settings.KAFKA_BOOTSTRAP, name, 1)
            where = {"source_kind": "kafka", "source_stream": name, "source_path": settings.KAFKA_BOOTSTRAP}
        job = Job.objects.create(
            name=name, pipeline=pipeline, state_backend=backend, parallelism=1, state_partitions=2,
            trigger_interval_seconds=trigger, driver=driver, standby=len(jobs) < standbys, **where,
        )  # fmt: skip
        jobs.append(job)
        job_request_start(job=job)


def settle(jobs: list[Job], trigger: float) -> None:
    """Until every job has committed lately, then three intervals more (at least 10 s): past the first batches, a
    backlog and a cold JVM. Jobs that cannot keep up may never all commit in one window: after 10 minutes the step is
    measured as it is (its table row says how many keep up)."""
    try:
        wait_for(
            lambda: Checkpoint.objects.filter(job__in=jobs, committed_at__gte=timezone.now() - timedelta(seconds=10))
            .values("job").distinct().count() == len(jobs),
            600, 2, f"all {len(jobs)} jobs to commit",
        )  # fmt: skip
    except TimeoutError as exc:
        print(f"{exc}: measured as they are", flush=True)
    time.sleep(max(10.0, 3 * trigger))


def spread_runs(jobs: list[Job]) -> tuple[int, int]:
    """How many of the jobs' current runs in a shared driver have their batches spread over the interval, of how many
    told: each shared driver logs which a query's start took (``DriverHost.phase_used``)."""
    said: dict[int, bool] = {}
    for path in DriverHost.objects.exclude(log_path="").values_list("log_path", flat=True):
        with contextlib.suppress(OSError):
            for run_id, how in re.findall(r"run (\d+): batches (spread|on Spark's tick)", Path(path).read_text()):
                said[int(run_id)] = how == "spread"
    current = [said[run.id] for run in Run.objects.filter(job__in=jobs, ended_at=None) if run.id in said]
    return sum(current), len(current)


def end_jobs(jobs: list[Job], worker_pid: int) -> None:
    """Stop the jobs, kill what is left of their drivers and the benchmark's worker, and archive the jobs."""
    for job in jobs:
        with contextlib.suppress(ActionRefused):
            job_request_stop(job=job)
    time.sleep(5)
    for pid in DriverHost.objects.exclude(pid=None).values_list("pid", flat=True):
        kill_group(pid or 0)
    for run in Run.objects.filter(job__in=jobs).exclude(pid=None):
        kill_group(run.pid or 0)
    for standby in StandbyDriver.objects.filter(job__in=jobs).exclude(pid=None):
        kill_group(standby.pid or 0)
    kill_group(worker_pid)
    Job.objects.filter(id__in=[job.id for job in jobs]).update(archived_at=timezone.now())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", default="1,10,20,30,40")
    parser.add_argument("--window", type=float, default=60)
    parser.add_argument("--driver", choices=("shared", "own"), default="shared")
    parser.add_argument("--standbys", type=int, default=0)
    parser.add_argument("--trigger", type=float, default=2, help="each job's trigger interval, in seconds")
    parser.add_argument("--cluster", action="store_true", help="on a standalone cluster of one 2-core worker")
    parser.add_argument(
        "--pipeline", default="url-counts",
        help="every job's pipeline: one whose plan runs batches without new data (minute-windows: a watermark; "
        "user-sessions-timed: transformWithState with processing-time timers) keeps Spark's tick, not spread over "
        "the interval; user-sessions (transformWithState without a clock) is spread",
    )  # fmt: skip
    parser.add_argument("--backend", choices=("memory", "rocksdb"), default="memory")
    parser.add_argument("--source", choices=("redis", "kafka"), default="redis")
    args = parser.parse_args()
    if args.source == "kafka":
        use_cached_connector()  # before the worker starts: its drivers inherit it
    steps = [int(step) for step in args.steps.split(",")]
    if args.cluster:  # read here (the launches) and by the worker and drivers this benchmark starts
        CLUSTER.append(cluster.start(ROOT / "spark", workers=1, cores=2, memory="4g"))
        settings.SPARK_MASTER = os.environ["STATEKEEPER_SPARK_MASTER"] = CLUSTER[0].master_url
        settings.SPARK_MASTER_UI = os.environ["STATEKEEPER_SPARK_MASTER_UI"] = CLUSTER[0].ui_url
    client = redis.Redis.from_url(os.environ["REDIS_URL"])
    client.flushdb()
    worker = start_worker(ROOT)
    halt = threading.Event()
    jobs: list[Job] = []
    stamp = int(time.time())
    idle_mib = machine_used_mib()
    rows = []
    spread = told = 0
    threading.Thread(target=produce, args=(client, jobs, halt), daemon=True).start()
    try:
        for step in steps:
            add_jobs(
                jobs, step, stamp, trigger=args.trigger, driver=args.driver, standbys=args.standbys,
                pipeline=args.pipeline, backend=args.backend, source=args.source,
            )  # fmt: skip
            settle(jobs, args.trigger)
            row = measure(jobs, client, args.window, RATE * (args.trigger + 3)) | {"jobs": len(jobs)}
            rows.append(row)
            print(
                f"{row['jobs']} jobs: machine {row['machine']} MiB, jobs' processes {row['pss']} MiB "
                f"({row['pss'] / len(jobs):.0f} a job), checkpoint p95 median {row['p95_median']:.0f} ms, "
                f"max {row['p95_max']:.0f} ms, lag max {row['lag_max']}, keeping up {row['keeping_up']}/{len(jobs)}, "
                f"CPU {row['cores']:.2f} cores, runs failed so far {row['failed']}",
                flush=True,
            )
        spread, told = spread_runs(jobs)  # before the runs end
    finally:
        halt.set()
        end_jobs(jobs, worker.pid)
        for standalone in CLUSTER:
            cluster.stop(standalone)
    single = rows[0]["p95_median"] if rows and rows[0]["jobs"] == 1 else float("nan")
    print(
        f"\n{'on a standalone cluster (one worker, 2 cores), ' if args.cluster else ''}"
        f"{args.pipeline} on {args.backend}, reading {'Kafka' if args.source == 'kafka' else 'Redis streams'}, driver: {args.driver}, standbys: {args.standbys}, {RATE} events/s a job, trigger {args.trigger:g} s, "
        f"batches spread: {spread} of {told} runs; "
        f"machine used before: {idle_mib} MiB\n"
    )
    print(
        "| jobs | machine used | jobs' processes (PSS) | a job | CPU (cores) | checkpoint p95, median of jobs "
        "| worst job | × single | lag max | keeping up | runs failed |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['jobs']} | {row['machine']:,} MiB | {row['pss']:,} MiB | {row['pss'] / row['jobs']:.0f} MiB | {row['cores']:.2f} "
            f"| {row['p95_median']:,.0f} ms | {row['p95_max']:,.0f} ms | {row['p95_median'] / single:.2f} "
            f"| {row['lag_max']:,} | {row['keeping_up']}/{row['jobs']} | {row['failed']} |"
        )


if __name__ == "__main__":
    main()
