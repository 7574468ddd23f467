"""Recovery time, savepoint time and throughput during a savepoint, on the real stack.

    .venv/bin/python -m bench.operator_actions [--rounds 3]

Starts its own Celery worker with beat (Redis database 13), a job on the configured database, a steady producer, and
prints a table against the issue's targets: recovery (kill -9 → first batch committed by the restarted driver)
against a cold start of the same query from the same checkpoint (≤ 1.5×); savepoint copy against a plain copy of the
same files (≤ 1.5×); job throughput while a savepoint runs against without (≥ 0.8×): each batch's rows over its own
duration (the trigger caps how often batches run, not how fast one runs), the slowest batch that overlapped the
savepoint against the median of a quiet window.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

os.environ["REDIS_URL"] = "redis://127.0.0.1:6379/13"
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "statekeeper.settings")
os.environ.setdefault("STATEKEEPER_ENV", "development")  # a local measurement
ROOT = Path(tempfile.mkdtemp(prefix="sk-bench-actions-"))
os.environ["STATEKEEPER_CHECKPOINT_ROOT"] = str(ROOT / "checkpoints")

import django  # noqa: E402

django.setup()

from bench.database import migrated  # noqa: E402

migrated()

import redis  # noqa: E402
from django.utils import timezone  # noqa: E402

from dashboard.models import ENDED_ACTIONS, Action, ActionKind, Checkpoint, Job, Run, RunStatus, StandbyDriver  # noqa: E402
from dashboard.pipelines import get as get_pipeline  # noqa: E402
from dashboard.services.actions import action_request  # noqa: E402
from dashboard.services.runs import job_request_start, job_request_stop  # noqa: E402
from statekeeper.polling import wait_for  # noqa: E402
from statekeeper.processes import celery_worker_command  # noqa: E402


def first_commit_after(job: Job, after_run: int) -> datetime:
    def found() -> datetime | None:
        run = job.runs.filter(id__gt=after_run).order_by("id").first()
        checkpoint = Checkpoint.objects.filter(run=run).order_by("batch_id").first() if run else None
        # a record's committed_at is Spark's trigger timestamp: the batch is committed its duration later
        return checkpoint.committed_at + timedelta(milliseconds=checkpoint.duration_ms) if checkpoint else None

    return wait_for(found, 180, 0.1, "a batch committed by the new driver")


def bench_job(prefix: str, **overrides: Any) -> Job:
    """A url-counts job as the benchmarks run it: local[1], trigger 1 s, restarted at once, 20,000 records a batch."""
    name = f"{prefix}-{int(time.time())}"
    fields: dict[str, Any] = {
        "name": name, "pipeline": "url-counts", "source_stream": f"bench:{name}", "parallelism": 1,
        "trigger_interval_seconds": 1, "restart_strategy": "fixed-delay", "restart_delay_seconds": 0,
        "max_records_per_batch": 20_000,
    }  # fmt: skip
    return Job.objects.create(**(fields | overrides))


def tear_down(job: Job, worker: subprocess.Popen[bytes], client: Any, root: Path) -> None:
    """The benchmark's worker, every process of its job, the job, its files and its Redis database."""
    os.killpg(worker.pid, signal.SIGTERM)
    kill_processes(job)
    job.delete()
    shutil.rmtree(root, ignore_errors=True)
    client.flushdb()


def kill_processes(job: Job) -> None:
    """Every driver and standby process the job had, with their JVMs."""
    pids = [*Run.objects.filter(job=job).values_list("pid", flat=True)]
    pids += StandbyDriver.objects.filter(job=job).values_list("pid", flat=True)
    for pid in pids:
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


def produce(client: Any, stream: str, halt: threading.Event, rate: int) -> None:
    make = get_pipeline("url-counts").generator(random.Random(1))
    while not halt.wait(0.1):
        pipe = client.pipeline(transaction=False)
        for _ in range(rate // 10):
            pipe.xadd(stream, {"v": make(int(time.time() * 1000))})
        pipe.execute()


def backlog(client: Any, stream: str, count: int) -> None:
    make = get_pipeline("url-counts").generator(random.Random(2))
    now = int(time.time() * 1000)
    for _ in range(0, count, 10_000):
        pipe = client.pipeline(transaction=False)
        for _ in range(10_000):
            pipe.xadd(stream, {"v": make(now)})
        pipe.execute()


def batch_rates(job: Job, since: datetime, until: datetime) -> list[float]:
    """Rows/s of each batch whose run overlaps the window (from its trigger, ``committed_at``, to its commit), over its
    own duration: the resolution is one batch, not a window's count of whole batches."""
    found = []
    for c in Checkpoint.objects.filter(job=job, committed_at__lt=until, committed_at__gt=since - timedelta(minutes=5)):
        if c.committed_at + timedelta(milliseconds=c.duration_ms) > since and c.duration_ms and c.input_rows:
            found.append(c.input_rows / (c.duration_ms / 1000))
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    client = redis.Redis.from_url(os.environ["REDIS_URL"])
    client.flushdb()
    job = bench_job("bench", state_backend="rocksdb-incremental", failure_rate_max=100)
    log = open(ROOT / "worker.log", "ab")  # noqa: SIM115 - the worker writes to it until the end
    worker = subprocess.Popen(
        celery_worker_command(ROOT / "beat", loglevel="WARNING"),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    halt = threading.Event()
    threading.Thread(target=produce, args=(client, job.source_stream, halt, 300), daemon=True).start()
    cold, recovery = [], []
    try:
        for _ in range(args.rounds):
            last = job.runs.order_by("-id").values_list("id", flat=True).first() or 0
            asked = timezone.now()
            job_request_start(job=job)
            committed = first_commit_after(job, last)
            cold.append((committed - asked).total_seconds())
            time.sleep(3)
            run = job.runs.get(status=RunStatus.RUNNING)
            killed = timezone.now()
            os.killpg(int(run.pid or 0), signal.SIGKILL)
            committed = first_commit_after(job, run.id)
            recovery.append((committed - killed).total_seconds())
            time.sleep(3)
            job_request_stop(job=job)
            wait_for(
                lambda: not job.runs.filter(status__in=["pending", "starting", "running", "stopping"]).exists(),
                120,
                what="stop",
            )

        # savepoint cost, and the job's throughput with and without a savepoint running, on a standing backlog
        job_request_start(job=job)
        first_commit_after(job, job.runs.order_by("-id").values_list("id", flat=True)[1])
        halt.set()
        savepoints, busy_rates, quiet_rates = [], [], []
        for _ in range(args.rounds):
            backlog(client, job.source_stream, 1_500_000)
            time.sleep(3)
            quiet_from = timezone.now()
            time.sleep(8)
            quiet_rates.append(statistics.median(batch_rates(job, quiet_from, timezone.now())))
            action = action_request(job=job, kind=ActionKind.SAVEPOINT)
            finished = Action.objects.filter(id=action.id, status__in=ENDED_ACTIONS)
            done = wait_for(
                finished.first,
                300,
                what="savepoint",
            )
            # the batches that ran while the savepoint copied and verified, each at its own rate
            busy_rates.append(min(batch_rates(job, done.started_at, done.finished_at)))
            lag = job.checkpoints.order_by("-committed_at").first()
            if lag is None or not lag.lag_records:
                raise SystemExit("the backlog ran out during the measurement: raise it")
            savepoint = job.savepoints.get(action=done)
            folder = Path(savepoint.path) / "checkpoint"
            copy_started = time.perf_counter()
            shutil.copytree(folder, ROOT / f"plain-{savepoint.id}")
            plain = time.perf_counter() - copy_started
            savepoints.append(
                (
                    savepoint.manifest["copy_ms"] / 1000,
                    plain,
                    savepoint.manifest["verify_ms"] / 1000,
                    savepoint.size_bytes,
                )
            )
            client.xtrim(job.source_stream, maxlen=0)  # drop the rest of the backlog: the next round starts fresh
            time.sleep(5)
        job_request_stop(job=job)
        wait_for(lambda: not job.runs.filter(status__in=["running", "stopping"]).exists(), 120, what="stop")
    finally:
        halt.set()
        tear_down(job, worker, client, ROOT)

    cold_s, rec_s = statistics.median(cold), statistics.median(recovery)
    copy_s = statistics.median(s[0] for s in savepoints)
    plain_s = statistics.median(s[1] for s in savepoints)
    verify_s = statistics.median(s[2] for s in savepoints)
    busy, quiet = statistics.median(busy_rates), statistics.median(quiet_rates)
    print(
        f"rounds: {args.rounds}; job: url-counts, rocksdb-incremental, local[1], trigger 1 s, 20,000 records per batch;"
        " producer 300 ev/s for the restarts, a 1,500,000-event backlog for the throughput\n"
    )
    print("| measure | value | against | ratio | target |\n|---|---:|---:|---:|---|")
    print(
        f"| recovery: kill -9 → first batch committed (s) | {rec_s:.1f} | cold start {cold_s:.1f} | {rec_s / cold_s:.2f} | ≤ 1.5 |"
    )
    print(
        f"| savepoint copy + checksums (s) | {copy_s:.3f} | plain copy {plain_s:.3f} | {copy_s / max(plain_s, 1e-6):.2f} | ≤ 1.5 |"
    )
    print(f"| savepoint verification by Spark's state reader (s) | {verify_s:.1f} | – | – | – |")
    print(
        f"| throughput during a savepoint (rows/s) | {busy:.0f} | without {quiet:.0f} | {busy / max(quiet, 1e-6):.2f} | ≥ 0.8 |"
    )
    print(f"\ncold starts {cold}\nrecoveries {recovery}\nsavepoints (copy, plain, verify, bytes) {savepoints}")
    print(f"rows/s without {quiet_rates}, during {busy_rates}")


if __name__ == "__main__":
    main()
