"""Failover: kill -9 of the running driver → first batch committed by its successor, with a warm standby against the
cold restart path, paired round by round on the real stack.

    .venv/bin/python -m bench.failover [--rounds 5] [--part both|failover|throughput] [--ready-for 75] [--busy] [--shared]
        [--arms both|standby|cold] [--backend rocksdb|rocksdb-incremental|memory]

Starts its own Celery worker with beat (Redis database 13), one url-counts job (``--backend``: rocksdb unless given;
local[1], trigger 1 s, restart delay 0), a producer at 300 events/s. Each round kills the running driver once with
the standby on and once with it off, and splits the time: detection (kill → the successor's run recorded), query start (→ the query running),
first batch (→ its first batch committed), and → the batch's point on the live stream the browser reads; beside it,
the successor's next five batches (a first batch should be no slower than a steady one). ``--arms standby`` measures
only the kills with the standby (a quicker look at a change to the takeover path). Prints a
table against the targets (≤ 3 s median with a standby; Flink 2.3 restarts the same keyed job in 7.3 s here) and the
standby's memory. ``--busy`` runs jobs like the demo's two running ones beside, in the shared driver, fed 200
events/s between them (bench/busy.py): the on-call engineer's machine is not idle. ``--shared`` runs the job in the
shared driver: its standby is then the spare shared driver, and the kill is the shared driver's. Then (rounds / 2 pairs) the job's throughput on a standing backlog with a ready standby beside it
against alone (target ≥ 0.95×), with the batch limit raised so that the job sets the rate.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ["REDIS_URL"] = "redis://127.0.0.1:6379/13"
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "statekeeper.settings")
os.environ.setdefault("STATEKEEPER_ENV", "development")  # a local measurement
ROOT = Path(tempfile.mkdtemp(prefix="sk-bench-failover-"))
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

from bench import busy  # noqa: E402
from bench.busy import start_worker  # noqa: E402
from bench.figures import first_commit_after, warm_spare  # noqa: E402
from bench.operator_actions import backlog, bench_job, kill_processes, produce, tear_down  # noqa: E402
from dashboard.models import Checkpoint, DriverHost, Job, RunStatus, StandbyStatus  # noqa: E402
from dashboard.services.runs import job_request_start, job_request_stop  # noqa: E402
from dashboard.services.standby import LIVE  # noqa: E402
from statekeeper.polling import wait_for  # noqa: E402
from workers.spark import cluster  # noqa: E402
from workers.standby import process_rss  # noqa: E402


def live_point_at(client: Any, run_id: int, since_ms: int) -> float:
    """When the first record of ``run_id`` reached the live stream (its entry id's milliseconds), in seconds."""

    def found() -> float | None:
        for entry_id, fields in client.xrange(settings.LIVE_STREAM, min=f"{since_ms}-0"):
            if json.loads(fields[b"data"]).get("run") == run_id:
                return int(entry_id.split(b"-")[0]) / 1000
        return None

    return wait_for(found, 60, 0.05, "the live point")


# the parts of the first batch's duration, as Spark's progress event reports them
STAGES = ("latest_offset", "query_planning", "add_batch", "wal_commit", "commit_offsets")


def batches_after_first(run: Any, count: int) -> list[Checkpoint] | None:
    """The ``count`` batches the run committed after its first, once it has: the steady batches a first one is
    compared with."""
    batches = list(Checkpoint.objects.filter(run=run).order_by("batch_id")[1 : count + 1])
    return batches if len(batches) == count else None


def one_failover(job: Job, client: Any, ready_for: float, beside: Sequence[Job] = ()) -> dict[str, float]:
    """``beside``: the other jobs in the same shared driver, which its kill takes down too; the result's ``others`` is
    the slowest of them to commit again (their restart strategy's path, no standby)."""
    run = wait_for(lambda: job.runs.filter(status=RunStatus.RUNNING).first(), 180, 0.2, "a running driver")
    wait_for(lambda: Checkpoint.objects.filter(run=run).exists(), 180, 0.2, "its first batch")
    time.sleep(3)
    spare = None
    if job.standby and job.driver == "shared":  # the spare shared driver is its standby: ready once its Spark is up
        spare = warm_spare()
        time.sleep(max(0.0, spare.started_at.timestamp() + ready_for - time.time()))
    elif job.standby:  # a standby waits for hours in real life: kill once it has been ready for ``ready_for`` seconds
        ready = wait_for(lambda: job.standbys.filter(status=StandbyStatus.READY).first(), 300, 0.2, "a warm standby")
        time.sleep(max(0.0, ready.ready_at.timestamp() + ready_for - time.time()))
    crashed = [
        (other, last.id) for other in beside
        if (last := other.runs.order_by("-id").first()) is not None and last.status == RunStatus.RUNNING
        and run.driver_host_id is not None and last.driver_host_id == run.driver_host_id
    ]  # fmt: skip
    killed = time.time()
    os.killpg(int(run.pid or 0), signal.SIGKILL)
    successor = wait_for(lambda: job.runs.filter(id__gt=run.id).first(), 180, 0.02, "the successor's run")
    first = wait_for(
        lambda: Checkpoint.objects.filter(run=successor).order_by("batch_id").first(), 180, 0.05, "its first batch"
    )
    successor.refresh_from_db()
    live = live_point_at(client, successor.id, int(killed * 1000))
    steady = wait_for(lambda: batches_after_first(successor, 5), 120, 0.2, "five batches after its first")
    # a record's committed_at is its trigger's start (Spark's progress timestamp); the commit is its duration later
    began = first.committed_at.timestamp()
    committed = began + first.duration_ms / 1000
    started = (successor.started_at or first.committed_at).timestamp()
    return {
        "detection": successor.requested_at.timestamp() - killed,
        "start": started - successor.requested_at.timestamp(),
        "trigger": began - started,
        "batch": first.duration_ms / 1000,
        "steady": statistics.median(c.duration_ms for c in steady) / 1000,
        "total": committed - killed,
        "live": live - killed,
        "replayed": first.input_rows,
        **{f"stage:{name}": getattr(first, f"{name}_ms") / 1000 for name in STAGES},
        "standby": successor.message.startswith("Standby")
        or (spare is not None and successor.driver_host_id == spare.id),
        **({"others": max(first_commit_after(other, last) for other, last in crashed) - killed} if crashed else {}),
    }


FULL_BATCH = 200_000
# --arms: which kills a round makes (with the standby on or off), and how the table's heading says it
ARMS = {
    "both": ((True, False), "one kill with the standby, one without"),
    "standby": ((True,), "one kill with the standby"),
    "cold": ((False,), "one kill without a standby"),
}


def batch_rate(job: Job, since: Any, until: Any) -> float:
    """Rows/s of the full batches committed in the window, over their own durations: a window's count of whole
    batches moves in steps of a batch, a batch's duration does not; a batch cut short by the end of the backlog is
    left out (its fixed costs weigh on fewer rows)."""
    batches = Checkpoint.objects.filter(
        job=job, committed_at__gt=since, committed_at__lte=until, input_rows__gte=FULL_BATCH
    )
    rows, seconds = sum(c.input_rows for c in batches), sum(c.duration_ms for c in batches) / 1000
    if len(batches) < 2:
        raise SystemExit(f"{len(batches)} full batch(es) in the window: raise the backlog")
    return rows / seconds


def saturated_rates(job: Job, client: Any, rounds: int) -> list[tuple[float, float]]:
    """Rows/s of the job on a standing backlog, with a ready standby beside it and without, paired round by round.
    The batch limit is raised so that the job, not the limit, sets the rate."""
    Job.objects.filter(id=job.id).update(max_records_per_batch=FULL_BATCH, standby=False)
    job_request_stop(job=job)
    wait_for(lambda: not job.runs.filter(status__in=["running", "stopping"]).exists(), 120, what="stop")
    job_request_start(job=job)
    wait_for(lambda: Checkpoint.objects.filter(run=job.runs.order_by("-id").first()).exists(), 180, what="restart")
    pairs = []
    for _ in range(rounds):
        rates: dict[bool, float] = {}
        for standby in (False, True):
            Job.objects.filter(id=job.id).update(standby=standby)
            if standby:
                wait_for(lambda: job.standbys.filter(status=StandbyStatus.READY).exists(), 300, 0.5, "a standby")
            else:
                wait_for(lambda: not job.standbys.filter(status__in=LIVE).exists(), 60, 0.5, "no standby")
            # the backlog is written while the job is stopped (it reads faster than one client writes), then the
            # job restarts on it; a ready standby stays beside a stopped job for its idle time
            job_request_stop(job=job)
            wait_for(lambda: not job.runs.filter(status__in=["running", "stopping"]).exists(), 120, what="stop")
            backlog(client, job.source_stream, 2_000_000)
            run = job_request_start(job=job)
            wait_for(Checkpoint.objects.filter(run=run).exists, 180, 0.5, "the restart on the backlog")
            time.sleep(3)
            since = timezone.now()
            time.sleep(15)
            rates[standby] = batch_rate(job, since, timezone.now())
            client.xtrim(job.source_stream, maxlen=0)  # the next measurement starts from a fresh backlog
            time.sleep(5)
        pairs.append((rates[True], rates[False]))
    return pairs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--part", choices=("both", "failover", "throughput"), default="both")
    parser.add_argument(
        "--cluster", action="store_true", help="the job (and its standby) on a 1-worker standalone cluster"
    )
    parser.add_argument(
        "--ready-for", type=float, default=75.0,
        help="seconds a standby has been ready when its driver is killed (Spark ends Python workers idle for 60 s)",
    )  # fmt: skip
    parser.add_argument(
        "--arms", choices=tuple(ARMS), default="both",
        help="which kills each round measures: with the standby, cold, or both (paired)",
    )  # fmt: skip
    parser.add_argument("--busy", action="store_true", help="the demo's two running jobs and their producer beside")
    parser.add_argument(
        "--shared", action="store_true",
        help="the job in the shared driver: its standby is the spare shared driver, and the kill is the shared driver's",
    )  # fmt: skip
    parser.add_argument(
        "--backend", choices=("rocksdb", "rocksdb-incremental", "memory"), default="rocksdb",
        help="the job's state backend: an incremental or memory job's successor replays the change files written "
        "since the checkpoint's newest snapshot",
    )  # fmt: skip
    args = parser.parse_args()
    standalone = cluster.start(ROOT / "spark", workers=1, cores=2) if args.cluster else None
    if standalone:  # read by the worker this benchmark starts, and by the drivers and standbys it spawns
        os.environ["STATEKEEPER_SPARK_MASTER"] = standalone.master_url
    client = redis.Redis.from_url(os.environ["REDIS_URL"])
    client.flushdb()
    job = bench_job(
        "bench-failover", state_backend=args.backend, failure_rate_max=1000, standby=True,
        driver="shared" if args.shared else "own",
    )  # fmt: skip
    worker = start_worker(ROOT)
    halt = threading.Event()
    threading.Thread(target=produce, args=(client, job.source_stream, halt, 300), daemon=True).start()
    rows: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    memory: list[int] = []
    beside: list[Job] = []
    try:
        if args.busy:
            beside = busy.start_beside(client, halt)
        job_request_start(job=job)
        for _ in range(args.rounds if args.part != "throughput" else 0):
            for standby in ARMS[args.arms][0]:
                Job.objects.filter(id=job.id).update(standby=standby)
                job.refresh_from_db()
                if standby and args.shared:
                    memory.append(process_rss(warm_spare().pid or 0))
                elif standby:
                    ready = wait_for(
                        lambda: job.standbys.filter(status=StandbyStatus.READY).first(), 300, 0.2, "a standby"
                    )
                    memory.append(int(ready.rss_bytes or 0))
                result = one_failover(job, client, args.ready_for, beside if args.shared else [])
                if result["standby"] != standby:
                    raise SystemExit(f"expected a {'standby' if standby else 'cold'} takeover, got {result}")
                rows[standby].append(result)
        throughput = []
        if args.part != "failover":
            try:
                throughput = saturated_rates(job, client, max(1, args.rounds // 2))
            except SystemExit as exc:  # the failover figures above are still worth printing
                print(f"throughput not measured: {exc}")
        job_request_stop(job=job)
        try:
            wait_for(lambda: not job.runs.filter(status__in=["running", "stopping"]).exists(), 120, what="stop")
        except TimeoutError as exc:  # the figures above still stand; the processes are killed below
            print(f"the job did not stop: {exc}")
    finally:
        halt.set()
        if standalone:
            cluster.stop(standalone)
        for other in beside:
            kill_processes(other)
            other.delete()
        for host in DriverHost.objects.exclude(pid=None).values_list("pid", flat=True):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(host or 0, signal.SIGKILL)
        tear_down(job, worker, client, ROOT)

    if throughput:
        ratios = [with_standby / alone for with_standby, alone in throughput]
        print(
            "| saturated throughput (rows/s over 15 s, 2,000,000-event backlog) | ready standby beside | alone | ratio |"
        )
        print("|---|---:|---:|---:|")
        for i, (with_standby, alone) in enumerate(throughput, 1):
            print(f"| round {i} | {with_standby:,.0f} | {alone:,.0f} | {with_standby / alone:.2f} |")
        print(f"| median ratio (target ≥ 0.95) | | | **{statistics.median(ratios):.2f}** |\n")
    if not rows[True] and not rows[False]:
        return

    def med(standby: bool, key: str) -> float:
        return statistics.median(r[key] for r in rows[standby]) if rows[standby] else float("nan")

    print(
        f"rounds: {args.rounds} (each: {ARMS[args.arms][1]}); job: url-counts, {args.backend}, "
        f"{standalone.master_url + ' (1 worker, 1-core executor)' if standalone else 'local[1]'}"
        f"{' in the shared driver (the standby: the spare shared driver)' if args.shared else ''},"
        f" trigger 1 s, restart delay 0, producer 300 ev/s, the standby ready for {args.ready_for:.0f} s at the kill;"
        f"{' beside it the demo-like jobs (shared driver) at 200 ev/s;' if args.busy else ' nothing beside it;'}"
        f" {timezone.now():%Y-%m-%d}\n"
    )
    print("| kill -9 → (median s) | warm standby | cold restart | ratio | target |\n|---|---:|---:|---:|---|")
    for key, label in (
        ("detection", "successor's run recorded (detection)"),
        ("start", "… its query running (query start)"),
        ("trigger", "… its first trigger (Spark planning the batch)"),
        ("batch", "… the batch's own duration (first batch)"),
        ("steady", "(the successor's next five batches: median duration)"),
        ("total", "**first batch committed by the successor**"),
        ("live", "that batch's point on the browser's live stream"),
    ):
        target = "≤ 3 s with a standby (Flink 2.3: 7.3 s)" if key in ("total", "live") else ""
        print(
            f"| {label} | {med(True, key):.2f} | {med(False, key):.2f} | {med(True, key) / med(False, key):.2f} | {target} |"
        )
    for name in STAGES:
        key = f"stage:{name}"
        print(f"| first batch: {name.replace('_', ' ')} | {med(True, key):.2f} | {med(False, key):.2f} | – | |")
    others = [(standby, r["others"]) for standby in (True, False) for r in rows[standby] if "others" in r]
    if others:
        print(
            "| **the other jobs in the crashed shared driver: the slowest's first batch committed again** | "
            + " | ".join(
                f"{statistics.median(t for s, t in others if s == arm):.2f}" if any(s == arm for s, _ in others)
                else "nan" for arm in (True, False)
            )
            + " | – | ≤ 5 s (no standby of their own) |"
        )  # fmt: skip
    rows_in = statistics.median(r["replayed"] for r in rows[True] + rows[False])
    print(f"\nrows in the successor's first batch (the replayed batch and what arrived since): median {rows_in:.0f}")
    for standby, label in ((True, "with a standby"), (False, "cold")):
        totals = ", ".join(f"{r['total']:.2f}" for r in rows[standby])
        print(f"per round, {label} (total s): {totals}")
        if later := ", ".join(f"{r['others']:.2f}" for r in rows[standby] if "others" in r):
            print(f"per round, {label}: the other jobs in the crash, the slowest committing again (s): {later}")
    if memory:
        print(
            f"standby memory (RSS of its Python, JVM and Python workers): median {statistics.median(memory) / 2**20:.0f} MB"
        )


if __name__ == "__main__":
    main()
