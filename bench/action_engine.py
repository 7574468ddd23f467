"""Operator actions at interactive speed, on the real stack: upgrade previews of the demo jobs, the upgrade of a quiet
job, and two upgrades at once on a worker with two slots.

    .venv/bin/python -m bench.action_engine [--rounds 3] [--busy]

Starts its own Celery worker with beat (concurrency 2, as bin/dev; Redis database 13) and three jobs like the demo's
(url-counts on memory, order-state-machine-v2 on RocksDB with changelog checkpoints, user-sessions on RocksDB), each
fed 500 events and then quiet. ``--busy`` also runs two jobs like the demo's two running ones beside them, fed by a
producer at 200 events/s, as on an on-call engineer's machine. Prints a table against the issue's targets:

- preview: request → verdict, with the warm state reader up (≤ 5 s); the first one, which starts the reader, apart;
- quiet upgrade: the new run up → the upgrade returned, "running, not yet proven" (≤ 15 s), and request → returned;
- two upgrades at once: both succeed (a worker with two slots used to fail both), and how long the slower took.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

os.environ["REDIS_URL"] = "redis://127.0.0.1:6379/13"
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "statekeeper.settings")
os.environ.setdefault("STATEKEEPER_ENV", "development")  # a local measurement
ROOT = Path(tempfile.mkdtemp(prefix="sk-bench-engine-"))
os.environ["STATEKEEPER_CHECKPOINT_ROOT"] = str(ROOT / "checkpoints")

import django  # noqa: E402

from bench.database import migrated, own_database  # noqa: E402

own_database()  # not the console's: the benchmark ends every driver it finds there
django.setup()


migrated()

import redis  # noqa: E402

from bench.busy import BESIDE, RATE, feed, make_job, produce, start_worker  # noqa: E402
from dashboard.models import ENDED_ACTIONS, Action, ActionKind, Checkpoint, Job, RunStatus  # noqa: E402
from dashboard.services.actions import action_request  # noqa: E402
from dashboard.services.runs import job_request_start, job_request_stop, kill_group  # noqa: E402
from dashboard.services.state_reader_client import state_reader_stop  # noqa: E402
from statekeeper.polling import wait_for  # noqa: E402

# (job, its pipeline, its backend, the pipeline a preview moves it to)
MEASURED = [
    ("url-counts-memory", "url-counts", "memory", "minute-windows"),
    ("orders-rocksdb", "order-state-machine-v2", "rocksdb-incremental", "order-state-machine"),
    ("sessions-rocksdb", "user-sessions", "rocksdb", "user-sessions-v2"),
]


def finished(action: Action, timeout: float = 600) -> Action:
    done = wait_for(
        lambda: Action.objects.filter(id=action.id, status__in=ENDED_ACTIONS).first(), timeout, 0.1,
        f"{action.kind} #{action.id}",
    )  # fmt: skip
    if done.status != "succeeded":
        raise SystemExit(f"{done.kind} #{done.id} failed: {done.outcome}")
    return done


def seconds(action: Action) -> float:
    assert action.finished_at is not None
    return (action.finished_at - action.requested_at).total_seconds()


def quiet_upgrade(job: Job, target: str) -> tuple[float, float, Action]:
    """Upgrade a quiet job; (new run up → returned, request → returned), and the upgrade."""
    upgrade = finished(action_request(job=job, kind=ActionKind.UPGRADE, params={"pipeline": target}))
    run = job.runs.get(id=upgrade.params["run"])
    if upgrade.proof.get("state") != "unproven" or run.status != RunStatus.RUNNING or run.started_at is None:
        raise SystemExit(f"the upgrade of a quiet job should return unproven: {upgrade.outcome}")
    assert upgrade.finished_at is not None
    return (upgrade.finished_at - run.started_at).total_seconds(), seconds(upgrade), upgrade


def roll_back(job: Job, upgrade: Action) -> None:
    finished(action_request(job=job, kind=ActionKind.UPGRADE_ROLLBACK, params={"upgrade": upgrade.id}))
    wait_for(lambda: job.runs.filter(status=RunStatus.RUNNING).exists(), 180, 0.2, "the job to run after rollback")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--busy", action="store_true", help="two demo-like jobs and a 200 events/s producer beside")
    args = parser.parse_args()
    client = redis.Redis.from_url(os.environ["REDIS_URL"])
    client.flushdb()
    state_reader_stop()
    worker = start_worker(ROOT)
    halt = threading.Event()
    everything: list[Job] = []
    first_preview = 0.0
    up_to_return, request_to_return, pair = [], [], []
    try:
        jobs = [make_job(name, pipeline, backend) for name, pipeline, backend, _ in MEASURED]
        second = make_job("sessions-b", "user-sessions", "rocksdb")
        beside = [make_job(name, pipeline, backend) for name, pipeline, backend in BESIDE] if args.busy else []
        everything = [*jobs, second, *beside]
        previews: dict[str, list[float]] = {job.pipeline: [] for job in jobs}
        for job in everything:
            feed(client, job, 500, seed=1)
            job_request_start(job=job)
        if beside:
            threading.Thread(target=produce, args=(client, beside, halt, RATE), daemon=True).start()
        for job in everything:
            fed = Checkpoint.objects.filter(job=job, input_rows__gt=0)
            wait_for(fed.exists, 300, 1, f"{job.name} to read its first events")
        time.sleep(5)  # the measured jobs read their 500 events and go quiet

        for round_ in range(args.rounds):
            for job, (_, _, _, target) in zip(jobs, MEASURED, strict=True):
                preview = finished(
                    action_request(job=job, kind=ActionKind.UPGRADE_PREVIEW, params={"pipeline": target})
                )
                if round_ == 0 and not first_preview:
                    first_preview = seconds(preview)  # it started the warm reader
                    continue
                previews[job.pipeline].append(seconds(preview))
        sessions = jobs[2]
        for _ in range(args.rounds):
            up, total, upgrade = quiet_upgrade(sessions, "user-sessions-v2")
            up_to_return.append(up)
            request_to_return.append(total)
            roll_back(sessions, upgrade)
        # two upgrades at once, on a worker with two slots
        both = [
            action_request(job=job, kind=ActionKind.UPGRADE, params={"pipeline": "user-sessions-v2"})
            for job in (sessions, second)
        ]
        pair = [seconds(finished(action)) for action in both]
    finally:
        halt.set()
        for job in everything:
            if job.runs.filter(status__in=["running", "starting"]).exists():
                job_request_stop(job=job)
        time.sleep(3)
        worker.terminate()
        for pid in Job.objects.filter(id__in=[j.id for j in everything]).values_list("runs__pid", flat=True):
            kill_group(pid or 0)  # every driver the benchmark's jobs had, with its JVM
        state_reader_stop()
        client.flushdb()

    print(
        f"rounds: {args.rounds}; {'busy: two demo-like jobs and 200 events/s beside' if args.busy else 'idle'}; "
        "worker concurrency 2; each measured job fed 500 events, then quiet\n"
    )
    print("| measure | median | min | max | target |\n|---|---:|---:|---:|---|")
    for (name, pipeline, _, target), values in zip(MEASURED, previews.values(), strict=True):
        print(
            f"| preview {name}: {pipeline} → {target} (s) | {statistics.median(values):.2f} | {min(values):.2f} | "
            f"{max(values):.2f} | ≤ 5 |"
        )
    print(f"| first preview, starting the state reader (s) | {first_preview:.2f} | | | – |")
    print(
        f"| quiet upgrade: new run up → returned (s) | {statistics.median(up_to_return):.2f} | "
        f"{min(up_to_return):.2f} | {max(up_to_return):.2f} | ≤ 15 |"
    )
    print(
        f"| quiet upgrade: request → returned (s) | {statistics.median(request_to_return):.2f} | "
        f"{min(request_to_return):.2f} | {max(request_to_return):.2f} | – |"
    )
    print(
        f"| two upgrades at once: both succeeded, the slower (s) | {max(pair):.2f} | {min(pair):.2f} | | both succeed |"
    )


if __name__ == "__main__":
    main()
