"""The output gap of a change to a running job: blue/green against the savepoint upgrade, on a busy stack.

    .venv/bin/python -m bench.blue_green [--rounds 5] [--own-rounds 3] [--change parameters|rescale]

Starts its own Celery worker with beat (Redis database 13), the demo-like jobs beside (bench/busy.py: two jobs in the
shared driver fed 200 events/s), and a subject job (user-sessions-timed, RocksDB, trigger 2 s) fed 50 events/s. Each
round changes the subject's ``ttl_minutes`` (an operational parameter) back and forth, alternately by a blue/green
upgrade (handing over by itself once caught up) and by a savepoint upgrade, first in the shared driver, then with a
driver of its own. The output gap is the time from the last batch the old version committed to the first one the new
version committed (each batch's trigger time plus its duration). Also: the time from the request to the handover, and
what green costs while it runs beside the job (the shared driver's heap after GC, or green's own driver's resident
memory; the job's batch duration). ``--change rescale`` changes the subject's state partitions instead (4 ↔ 6),
alternately by a blue/green rescale and by the savepoint rescale.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ["REDIS_URL"] = "redis://127.0.0.1:6379/13"
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "statekeeper.settings")
os.environ.setdefault("STATEKEEPER_ENV", "development")  # a local measurement
ROOT = Path(tempfile.mkdtemp(prefix="sk-bench-blue-green-"))
os.environ["STATEKEEPER_CHECKPOINT_ROOT"] = str(ROOT / "checkpoints")
os.environ["STATEKEEPER_LOG_ROOT"] = str(ROOT / "logs")

import django  # noqa: E402

django.setup()

from bench.database import migrated  # noqa: E402

migrated()


from bench.busy import busy_stack, feed, make_job  # noqa: E402
from bench.figures import committed, pct  # noqa: E402
from bench.procs import process_tree, sizes  # noqa: E402
from dashboard.models import ENDED_ACTIONS, Action, ActionKind, ActionStatus, Checkpoint, Job, Run, RunStatus  # noqa: E402
from dashboard.services.actions import action_request  # noqa: E402
from dashboard.services.runs import job_request_start, job_request_stop  # noqa: E402
from statekeeper.polling import wait_for  # noqa: E402

SUBJECT_RATE = 50  # events/s into the subject job


def finished(action: Action, timeout: float = 600) -> Action:
    wait_for(lambda: Action.objects.filter(id=action.id, status__in=ENDED_ACTIONS)
             .exists(), timeout, 0.5, f"action #{action.id}")  # fmt: skip
    action.refresh_from_db()
    if action.status != ActionStatus.SUCCEEDED:
        raise RuntimeError(f"{action.kind} #{action.id} failed: {action.outcome}")
    return action


def gap_after(job: Job, old_run: int, timeout: float = 300) -> float:
    """Seconds from the old run's last committed batch to the first batch a newer run committed."""
    first = wait_for(
        lambda: Checkpoint.objects.filter(job=job, run_id__gt=old_run, input_rows__gt=0).order_by("batch_id").first(),
        timeout, 0.2, "the new version's first batch",
    )  # fmt: skip
    last = Checkpoint.objects.filter(job=job, run_id=old_run).order_by("-batch_id").first()
    assert first is not None and last is not None
    return committed(first) - committed(last)


def heap_mb(run_id: int) -> float | None:
    heap = Run.objects.filter(id=run_id).values_list("heap_after_gc_bytes", flat=True).first()
    return heap / 2**20 if heap else None


def green_rss_mb(action_id: int) -> float | None:
    """Green's own driver's resident memory (its Python process and JVM), while it runs; None in a shared driver."""
    green = Action.objects.get(id=action_id).params.get("green_run")
    run = Run.objects.filter(id=green, driver_host__isnull=True, status=RunStatus.GREEN).first() if green else None
    if run is None or not run.pid:
        return None
    resident = 0
    for pid in process_tree(run.pid):
        try:
            resident += sizes(pid)[1]
        except OSError:  # a Python worker that ended while read
            continue
    return resident / 1024 or None


def round_trip(job: Job, kind: str, change: dict[str, Any]) -> dict[str, Any]:
    """One change (``change``: the action's params), by ``kind``; its gap and the time to the handover (or the
    switch)."""
    old = job.runs.filter(status=RunStatus.RUNNING).get()
    before = list(Checkpoint.objects.filter(run=old).order_by("-id").values_list("duration_ms", flat=True)[:10])
    heap_before = heap_mb(old.id)
    began = time.monotonic()
    params: dict[str, Any] = dict(change)
    if kind == ActionKind.BLUE_GREEN:
        params |= {"auto": 1, "pipeline": job.pipeline}
    action = action_request(job=job, kind=kind, params=params)
    beside: list[int] = []
    heap_during: list[float] = []
    green_rss: list[float] = []
    while not Action.objects.filter(id=action.id, status__in=ENDED_ACTIONS).exists():
        if kind == ActionKind.BLUE_GREEN and (heap := heap_mb(old.id)) is not None:
            heap_during.append(heap)
        if kind == ActionKind.BLUE_GREEN and (rss := green_rss_mb(action.id)) is not None:
            green_rss.append(rss)
        time.sleep(0.5)
    action = finished(action)
    handover = time.monotonic() - began
    if kind == ActionKind.BLUE_GREEN:
        beside = list(
            Checkpoint.objects.filter(run=old, committed_at__gte=action.requested_at).values_list(
                "duration_ms", flat=True
            )
        )
    gap = gap_after(job, old.id)
    return {
        "kind": "blue/green" if kind == ActionKind.BLUE_GREEN else "savepoint",
        "gap": gap,
        "to_done": handover,
        "batch_ms_before": statistics.median(before) if before else None,
        "batch_ms_beside": statistics.median(beside) if beside else None,
        "heap_before": heap_before,
        "heap_during": max(heap_during) if heap_during else None,
        "green_rss": max(green_rss) if green_rss else None,
    }


def feed_subject(client: Any, job: Job, halt: threading.Event) -> None:
    seed = 0
    while not halt.wait(0.1):
        seed += 1
        feed(client, job, SUBJECT_RATE // 10, 1000 + seed)


def measure(job: Job, rounds: int, client: Any, halt: threading.Event, rescale: bool) -> list[dict[str, Any]]:
    threading.Thread(target=feed_subject, args=(client, job, halt), daemon=True).start()
    job_request_start(job=job)
    wait_for(lambda: Checkpoint.objects.filter(job=job, input_rows__gt=0).count() >= 5, 300, 1, "the subject to run")
    rows = []
    ttl = 30
    savepoint_kind = ActionKind.RESCALE if rescale else ActionKind.UPGRADE
    for n in range(rounds):
        for kind in (ActionKind.BLUE_GREEN, savepoint_kind):
            ttl += 1
            job.refresh_from_db()
            change: dict[str, Any] = (
                {"state_partitions": 6 if job.state_partitions == 4 else 4}
                if rescale
                else {"pipeline": job.pipeline, "parameters": {"ttl_minutes": ttl}}
            )
            row = round_trip(job, kind, change) | {"driver": job.driver, "round": n + 1}
            rows.append(row)
            print(f"  {row['driver']:6} {row['kind']:10} round {row['round']}: gap {row['gap']:.2f} s, done in "
                  f"{row['to_done']:.1f} s", flush=True)  # fmt: skip
            time.sleep(4)
    job_request_stop(job=job)
    return rows


def table(rows: list[dict[str, Any]]) -> None:
    print()
    print(
        "| driver | change | rounds | output gap p50 | gap p95 | gap max | request → done (median) | job's batch before → beside green (median ms) | shared heap after GC before → max beside (MB) | green's own driver, max RSS (MB) |"
    )  # noqa: E501
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for driver in ("shared", "own"):
        for kind in ("blue/green", "savepoint"):
            chosen = [r for r in rows if r["driver"] == driver and r["kind"] == kind]
            if not chosen:
                continue
            gaps = [r["gap"] for r in chosen]
            done = statistics.median(r["to_done"] for r in chosen)
            before = [r["batch_ms_before"] for r in chosen if r["batch_ms_before"] is not None]
            beside = [r["batch_ms_beside"] for r in chosen if r["batch_ms_beside"] is not None]
            heap = [(r["heap_before"], r["heap_during"]) for r in chosen if r["heap_before"] and r["heap_during"]]
            cost = f"{statistics.median(before):.0f} → {statistics.median(beside):.0f}" if before and beside else "–"
            mem = (
                f"{statistics.median(h[0] for h in heap):.0f} → {statistics.median(h[1] for h in heap):.0f}"
                if heap and driver == "shared"
                else "–"
            )  # noqa: E501
            rss = [r["green_rss"] for r in chosen if r["green_rss"]]
            own = f"{statistics.median(rss):.0f}" if rss else "–"
            print(f"| {driver} | {kind} | {len(chosen)} | {pct(gaps, 0.5):.2f} s | {pct(gaps, 0.95):.2f} s | "
                  f"{max(gaps):.2f} s | {done:.1f} s | {cost} | {mem} | {own} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="handovers (and savepoint upgrades) in the shared driver")
    parser.add_argument("--own-rounds", type=int, default=3, help="the same with a driver of its own")
    parser.add_argument("--change", choices=("parameters", "rescale"), default="parameters",
                        help="what each round changes: ttl_minutes, or the state partitions (4 ↔ 6)")  # fmt: skip
    args = parser.parse_args()
    rescale = args.change == "rescale"
    client, halt = busy_stack(ROOT)
    print(f"busy stack up (two jobs beside, 200 events/s); subject fed {SUBJECT_RATE} events/s", flush=True)
    rows: list[dict[str, Any]] = []
    common = {"trigger_interval_seconds": 2, "state_partitions": 4}
    shared = make_job("bg-shared", "user-sessions-timed", "rocksdb", driver="shared", **common)
    rows += measure(shared, args.rounds, client, halt, rescale)
    if args.own_rounds:
        own = make_job("bg-own", "user-sessions-timed", "rocksdb", driver="own", **common)
        rows += measure(own, args.own_rounds, client, halt, rescale)
    halt.set()
    table(rows)
    print(f"\n{os.cpu_count()} cores; logs and checkpoints under {ROOT}")


if __name__ == "__main__":
    main()
