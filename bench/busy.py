"""The real stack a benchmark runs on (its own Celery worker), and what an on-call engineer's machine runs beside a measurement: jobs like the demo's two running ones (url-counts on
memory, order-state-machine-v2 on RocksDB with changelog checkpoints, both in the shared driver, trigger 2 s) fed by a
producer at 200 events/s between them. Imported by the benchmarks after they have set Django up."""

from __future__ import annotations

import atexit
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from dashboard.engine.samples import sample_events
from dashboard.models import Checkpoint, Job
from dashboard.pipelines import get as get_pipeline
from dashboard.services.runs import job_request_start, kill_group
from statekeeper.polling import wait_for
from statekeeper.processes import celery_worker_command

BESIDE = [("busy-url-counts", "url-counts", "memory"), ("busy-orders", "order-state-machine-v2", "rocksdb-incremental")]
RATE = 200  # events/s, between the jobs beside


def make_job(name: str, pipeline: str, backend: str, **overrides: Any) -> Job:
    stamp = int(time.time())
    fields: dict[str, Any] = {
        "name": f"{name}-{stamp}", "pipeline": pipeline, "source_stream": f"bench:{name}-{stamp}",
        "state_backend": backend, "parallelism": 1, "trigger_interval_seconds": 2, "restart_strategy": "fixed-delay",
        "restart_delay_seconds": 1,
    }  # fmt: skip
    return Job.objects.create(**(fields | overrides))


def feed(client: Any, job: Job, count: int, seed: int) -> None:
    make = sample_events(get_pipeline(job.pipeline), random.Random(seed))
    pipe = client.pipeline(transaction=False)
    for _ in range(count):
        pipe.xadd(job.source_stream, {"v": make(int(time.time() * 1000))})
    pipe.execute()


def produce(client: Any, jobs: list[Job], halt: threading.Event, rate: int) -> None:
    """``rate`` events/s spread over the jobs, in ticks of 100 ms."""
    seed = 0
    while not halt.wait(0.1):
        seed += 1
        for job in jobs:
            feed(client, job, rate // 10 // len(jobs), seed)


def start_beside(client: Any, halt: threading.Event) -> list[Job]:
    """The demo-like jobs, started in the shared driver and fed until ``halt``; returns once each has read events."""
    jobs = [make_job(name, pipeline, backend, driver="shared") for name, pipeline, backend in BESIDE]
    for job in jobs:
        job_request_start(job=job)
    threading.Thread(target=produce, args=(client, jobs, halt, RATE), daemon=True).start()
    for job in jobs:
        wait_for(Checkpoint.objects.filter(job=job, input_rows__gt=0).exists, 300, 1, f"{job.name} to read events")
    return jobs


def start_worker(root: Path) -> subprocess.Popen[bytes]:
    """The benchmark's own Celery worker with beat (concurrency 2, as bin/dev), logging to ``root``/worker.log."""
    log = open(root / "worker.log", "ab")  # noqa: SIM115 - the worker writes to it until the end
    worker = subprocess.Popen(
        celery_worker_command(root / "beat", loglevel="WARNING"), stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    # ended on any exit: an error, Ctrl-C, or a SIGTERM (turned into an exit, so that finally blocks run too); then
    # the drivers, hosts and state reader it started, each in a session of its own (so not in the worker's group)
    atexit.register(end_started, root)
    atexit.register(kill_group, worker.pid)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    return worker


def end_started(root: Path) -> None:
    """The processes the benchmark's worker started for its jobs (those checkpointing under ``root``): their drivers,
    the hosts of their shared drivers, and the state reader of its Redis database. A bench that ended left them
    running, and loading the machine, under the next measurement."""
    from dashboard.models import DriverHost, Run
    from dashboard.services.state_reader_client import state_reader_stop

    state_reader_stop()
    jobs = [job.id for job in Job.objects.all() if str(job.checkpoint_location).startswith(str(root))]
    pids = set(Run.objects.filter(job_id__in=jobs).exclude(pid=None).values_list("pid", flat=True))
    pids |= set(DriverHost.objects.filter(pid__isnull=False, runs__job_id__in=jobs).values_list("pid", flat=True))
    for pid in pids:
        kill_group(pid or 0)


def busy_stack(root: Path) -> tuple[Any, threading.Event]:
    """The benchmark's Redis database emptied, its Celery worker started (logging under ``root``) and the jobs beside
    running and fed until the event returned is set; with the Redis client."""
    import redis
    from django.conf import settings

    client = redis.Redis.from_url(settings.REDIS_URL)
    client.flushdb()
    (root / "logs").mkdir(parents=True, exist_ok=True)
    start_worker(root)
    halt = threading.Event()
    start_beside(client, halt)
    return client, halt
