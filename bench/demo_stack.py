"""Operator actions on the stack a user runs: ``./bin/dev`` with its four demo jobs running and its producer on.

    ./bin/dev &                                      # then, once it says it is running:
    STATEKEEPER_ENV=development .venv/bin/python -m bench.demo_stack [--rounds 3] [--previews 5] [--skip-own]
        [--changes savepoint|blue-green|both] [--only-own]

Attaches to the running console (its database, Redis and Celery worker; nothing of its own but one job), starts the
demo jobs that wait to be started, and adds one job with a driver of its own (``demo-bench-own``: user-sessions-timed
on RocksDB, reading the producer's ``events:sessions``), removed at the end. Then, on the real stack:

- upgrade previews of each demo job, the first one apart (it may start the state reader): request → verdict (shown
  once Spark has planned the new version on the copy), and request → done (the batch's run that proves it);
- savepoint upgrades (a parameter change, back and forth), of ``spend-rocksdb`` in the shared driver and of the job
  with a driver of its own: request → the new run's first committed batch, and the output gap (the old run's last
  committed batch to the new run's first, each its trigger time plus its duration);
- savepoint rescales of ``orders-rocksdb`` (state partitions 4 ↔ 6): the same two figures;
- five actions at once on five jobs (the two upgrades, two rescales, a savepoint), each against its time alone;
- ``--preview-first``: each upgrade follows a preview of the same change, as on the Deploys tab, whose plan it takes;
- ``--changes blue-green`` (or ``both``): the same upgrades and rescales made blue/green, handing over by themselves
  once green is caught up (``auto``): request → the new version's first batch in the sinks, and the output gap;
- each action's phases (the steps the action engine timed), as medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
from collections import defaultdict
from typing import Any

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "statekeeper.settings")
os.environ.setdefault("STATEKEEPER_ENV", "development")  # a local measurement

import django  # noqa: E402

django.setup()

from bench.figures import committed, pct  # noqa: E402
from dashboard.models import (  # noqa: E402
    ACTIVE_RUN_STATUSES,
    ENDED_ACTIONS,
    Action,
    ActionKind,
    ActionStatus,
    Checkpoint,
    Job,
    Run,
    RunStatus,
)
from dashboard.services.actions import action_request  # noqa: E402
from dashboard.services.runs import job_request_start, job_request_stop  # noqa: E402
from statekeeper.polling import wait_for  # noqa: E402

DEMO = ("url-counts-memory", "orders-rocksdb", "sessions-rocksdb", "spend-rocksdb")
OWN = "demo-bench-own"
# the pipeline each demo job's preview moves it to
PREVIEW_TO = {
    "url-counts-memory": "minute-windows",
    "orders-rocksdb": "order-state-machine",
    "sessions-rocksdb": "user-sessions-v2",
    "spend-rocksdb": "customer-spend-v2",
}
DONE = ENDED_ACTIONS


def running(job: Job) -> Run | None:
    return job.runs.filter(status=RunStatus.RUNNING).order_by("-id").first()


def flowing(job: Job, timeout: float = 300) -> None:
    """Wait until the job's running run has committed two batches that read events."""
    wait_for(
        lambda: (run := running(job)) is not None
        and Checkpoint.objects.filter(run=run, input_rows__gt=0).count() >= 2,
        timeout, 0.5, f"{job.name} to run and read events",
    )  # fmt: skip


def finished(action: Action, timeout: float = 600) -> Action:
    wait_for(lambda: Action.objects.filter(id=action.id, status__in=DONE).exists(), timeout, 0.1, f"#{action.id}")
    action.refresh_from_db()
    if action.status != ActionStatus.SUCCEEDED:
        raise RuntimeError(f"{action.kind} #{action.id} on {action.job.name} failed: {action.outcome}")
    return action


def took(action: Action) -> float:
    """Seconds from the request to the end of a finished action."""
    assert action.finished_at is not None
    return (action.finished_at - action.requested_at).total_seconds()


def request(job: Job, kind: str, params: dict[str, Any]) -> Action:
    """Ask for an action as the API does, once the job has no other action in flight."""
    wait_for(lambda: not job.actions.filter(status__in=(ActionStatus.PENDING, ActionStatus.RUNNING)).exists(),
             600, 0.5, f"{job.name}'s actions to finish")  # fmt: skip
    return action_request(job=job, kind=kind, params=params, origin="api")


def outcome(job: Job, action: Action, old_run: int | None) -> dict[str, Any]:
    """What an action cost: request → done, and for a change that restarts the job, request → the new run's first
    committed batch that read events and the output gap."""
    row: dict[str, Any] = {
        "job": job.name, "kind": action.kind, "id": action.id,
        "done": took(action),
        "phases": {p["label"]: p["seconds"] for p in action.phase_rows if p["seconds"] is not None},
    }  # fmt: skip
    if old_run is not None and action.kind != ActionKind.SAVEPOINT:
        first = wait_for(
            lambda: Checkpoint.objects.filter(job=job, run_id__gt=old_run, input_rows__gt=0).order_by("batch_id")
            .first(), 300, 0.2, f"{job.name}'s new run's first batch",
        )  # fmt: skip
        last = Checkpoint.objects.filter(job=job, run_id=old_run).order_by("-batch_id").first()
        assert first is not None and last is not None
        row["first_batch"] = committed(first) - action.requested_at.timestamp()
        row["gap"] = committed(first) - committed(last)
        row["gap_batches"] = gap_batches(job, old_run, last, first)
    return row


def gap_batches(job: Job, old_run: int, last: Checkpoint, first: Checkpoint) -> str:
    """Where the output gap went, batch by batch: the old run's last batch, then each of the new runs' batches up to
    its first that read events, each as its trigger's start (seconds after the old run's last commit), its duration
    and Spark's phases of it in seconds (planning, the source's latestOffset, addBatch, the state commit), and its
    input rows."""
    end = committed(last)
    rows = [last, *Checkpoint.objects.filter(job=job, run_id__gt=old_run, batch_id__lte=first.batch_id)
            .order_by("run_id", "batch_id")]  # fmt: skip

    def one(c: Checkpoint) -> str:
        start = c.committed_at.timestamp() - end
        return (f"#{c.batch_id} {start:+.1f} {c.duration_ms / 1000:.1f} (plan {c.query_planning_ms / 1000:.1f}, "
                f"offset {c.latest_offset_ms / 1000:.1f}, add {c.add_batch_ms / 1000:.1f}, "
                f"state {c.state_commit_ms / 1000:.1f}) {c.input_rows} rows")  # fmt: skip

    return "; ".join(one(c) for c in rows)


def change(job: Job, kind: str) -> dict[str, Any]:
    """The next change of this kind to the job: a parameter toggled, or the state partitions 4 ↔ 6."""
    job.refresh_from_db()
    if kind == ActionKind.RESCALE:
        return {"state_partitions": 6 if job.state_partitions == 4 else 4}
    if kind == ActionKind.UPGRADE:
        name, low, high = ("threshold", 1_000_000, 999_999) if job.pipeline.startswith("customer") else (
            "ttl_minutes", 60, 61)  # fmt: skip
        value = high if job.parameters.get(name) == low else low
        return {"pipeline": job.pipeline, "parameters": {**job.parameters, name: value}}
    return {}


def one(job: Job, kind: str, preview_first: bool = False, blue_green: bool = False) -> dict[str, Any]:
    """One action on the job and what it cost; ``preview_first``: an upgrade follows a preview of the same change,
    as on the Deploys tab (its row also holds the preview's time, ``preview``); ``blue_green``: the upgrade or
    rescale is made blue/green, handing over by itself once green is caught up (its row's ``first_batch`` is then
    the request → the new version's first batch in the sinks)."""
    old = running(job)
    asked = change(job, kind)
    previewed = None
    if preview_first and kind == ActionKind.UPGRADE:
        previewed = finished(request(job, ActionKind.UPGRADE_PREVIEW, asked))
    if blue_green:
        action = finished(request(job, ActionKind.BLUE_GREEN, {"pipeline": job.pipeline, **asked, "auto": 1}))
    else:
        action = finished(request(job, kind, asked))
    row = outcome(job, action, old.id if old else None)
    if previewed is not None:
        row["preview"] = took(previewed)
    flowing(job)
    return row


def previews(jobs: list[Job], rounds: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    rows = []
    first: dict[str, Any] = {}
    for n in range(rounds):
        for job in jobs:
            action = finished(request(job, ActionKind.UPGRADE_PREVIEW, {"pipeline": PREVIEW_TO[job.name]}))
            row = outcome(job, action, None)
            # the verdict shows once Spark has planned the batch (or, refused, once it failed); done after its run
            row["verdict"] = float(action.params["plan"].get("verdict_seconds", row["done"]))
            if not first:
                first = row
                print(f"  the first preview ({job.name}): verdict {row['verdict']:.2f} s, done {row['done']:.2f} s",
                      flush=True)  # fmt: skip
                continue
            rows.append(row)
        print(f"  preview round {n + 1} (verdict/done): "
              + ", ".join(f"{r['verdict']:.2f}/{r['done']:.2f}" for r in rows[-len(jobs) :]), flush=True)  # fmt: skip
    return first, rows


def at_once(plan: list[tuple[Job, str]], preview_first: bool) -> list[dict[str, Any]]:
    """The actions requested together, each from its own thread; their rows. ``preview_first``: the upgrades' previews
    are made first, one by one, as each alone."""
    olds = {job.name: running(job) for job, _ in plan}
    asked = [change(job, kind) for job, kind in plan]
    for (job, kind), params in zip(plan, asked, strict=True):
        if preview_first and kind == ActionKind.UPGRADE:
            finished(request(job, ActionKind.UPGRADE_PREVIEW, params))
    actions = [request(job, kind, params) for (job, kind), params in zip(plan, asked, strict=True)]
    rows: list[dict[str, Any]] = []
    lock = threading.Lock()

    def watch(job: Job, action: Action) -> None:
        old = olds[job.name]
        row = outcome(job, finished(action), old.id if old else None)
        with lock:
            rows.append(row)

    threads = [threading.Thread(target=watch, args=(job, a)) for (job, _), a in zip(plan, actions, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for job, _ in plan:
        flowing(job)
    return rows


def own_job() -> Job:
    job, _ = Job.objects.update_or_create(
        name=OWN,
        defaults={
            "pipeline": "user-sessions-timed", "source_stream": "events:sessions", "state_backend": "rocksdb",
            "parallelism": 1, "trigger_interval_seconds": 2, "driver": "own", "state_partitions": 4,
            "parameters": {"ttl_minutes": 60},
        },
    )  # fmt: skip
    return job


def summary(label: str, rows: list[dict[str, Any]], key: str, target: str) -> str:
    values = [r[key] for r in rows if key in r]
    if not values:
        return f"| {label} | – | – | – | – | {target} |"
    return (f"| {label} | {len(values)} | {', '.join(f'{v:.2f}' for v in values)} | {statistics.median(values):.2f} s "
            f"| {pct(values, 0.95):.2f} s | {target} |")  # fmt: skip


def phases_table(groups: dict[str, list[dict[str, Any]]]) -> None:
    print("\n| action | phase | median s | max s |\n|---|---|---:|---:|")
    for name, rows in groups.items():
        seen: dict[str, list[float]] = defaultdict(list)
        for row in rows:
            for label, seconds in row["phases"].items():
                seen[label].append(seconds)
        for label, values in seen.items():
            print(f"| {name} | {label} | {statistics.median(values):.2f} | {max(values):.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="upgrades and rescales of each kind")
    parser.add_argument("--previews", type=int, default=5, help="preview rounds over the four demo jobs")
    parser.add_argument("--skip-own", action="store_true", help="no job with a driver of its own")
    parser.add_argument("--skip-at-once", action="store_true", help="no five actions at once")
    parser.add_argument("--at-once", type=int, default=1, help="how many times the five actions are asked at once")
    parser.add_argument("--only-own", action="store_true", help="the rounds change only the job with its own driver")
    parser.add_argument(
        "--changes",
        choices=("savepoint", "blue-green", "both"),
        default="savepoint",
        help="how the rounds' upgrades and rescales are made",
    )
    parser.add_argument(
        "--preview-first",
        action="store_true",
        help="each upgrade follows a preview of the same change (the Deploys tab's flow)",
    )
    args = parser.parse_args()
    missing = [name for name in DEMO if not Job.objects.filter(name=name).exists()]
    if missing:
        raise SystemExit(f"the demo stack is not up here (no {', '.join(missing)}): start ./bin/dev first")
    jobs = {name: Job.objects.get(name=name) for name in DEMO}
    own = None if args.skip_own else own_job()
    for job in [*jobs.values(), *([own] if own else [])]:
        if not job.runs.filter(status__in=ACTIVE_RUN_STATUSES).exists():  # the stack may be starting it already
            job_request_start(job=job)
    for job in [*jobs.values(), *([own] if own else [])]:
        flowing(job)
    print(f"the four demo jobs{' and ' + OWN if own else ''} run; load average {os.getloadavg()[0]:.1f}", flush=True)

    first, preview_rows = previews(list(jobs.values()), args.previews)
    upgrades, own_upgrades, rescales = [], [], []
    green: dict[str, list[dict[str, Any]]] = {"upgrades": [], "own": [], "rescales": []}
    shared = not (args.only_own and own is not None)  # the shared jobs' rounds too
    for n in range(args.rounds):
        last = []
        if args.changes != "blue-green":
            if shared:
                upgrades.append(one(jobs["spend-rocksdb"], ActionKind.UPGRADE, args.preview_first))
            if own is not None:
                own_upgrades.append(one(own, ActionKind.UPGRADE, args.preview_first))
            if shared:
                rescales.append(one(jobs["orders-rocksdb"], ActionKind.RESCALE))
            last += [*upgrades[-1:], *own_upgrades[-1:], *rescales[-1:]]
        if args.changes != "savepoint":
            if shared:
                green["upgrades"].append(one(jobs["spend-rocksdb"], ActionKind.UPGRADE, args.preview_first, True))
            if own is not None:
                green["own"].append(one(own, ActionKind.UPGRADE, args.preview_first, True))
            if shared:
                green["rescales"].append(one(jobs["orders-rocksdb"], ActionKind.RESCALE, blue_green=True))
            last += [*green["upgrades"][-1:], *green["own"][-1:], *green["rescales"][-1:]]
        print(f"  round {n + 1}: " + "; ".join(f"{r['job']} {r['kind']} first batch {r['first_batch']:.1f} s, gap "
                                               f"{r['gap']:.1f} s" for r in last), flush=True)  # fmt: skip
        for r in last:
            print(f"    {r['job']} {r['kind']}, its gap's batches: {r.get('gap_batches', '')}", flush=True)
    together: list[dict[str, Any]] = []
    alone: dict[str, dict[str, Any]] = {}
    if not args.skip_at_once and args.changes != "blue-green" and upgrades and rescales:
        plan: list[tuple[Job, str]] = [
            (jobs["spend-rocksdb"], ActionKind.UPGRADE),
            (jobs["orders-rocksdb"], ActionKind.RESCALE),
            (jobs["sessions-rocksdb"], ActionKind.RESCALE),
            (jobs["url-counts-memory"], ActionKind.SAVEPOINT),
        ]
        if own is not None:
            plan.append((own, ActionKind.UPGRADE))
        for job, kind in plan[2:4]:  # the two not measured alone above
            alone[job.name] = one(job, kind)
        alone |= {"spend-rocksdb": upgrades[-1], "orders-rocksdb": rescales[-1]}
        if own_upgrades:
            alone[OWN] = own_upgrades[-1]
        for n in range(args.at_once):
            print(f"  {len(plan)} actions at once; load average {os.getloadavg()[0]:.1f}", flush=True)
            rows = at_once(plan, args.preview_first)
            print(
                "    " + "; ".join(f"{r['job']} {r.get('first_batch', r.get('done')):.2f} s" for r in rows), flush=True
            )
            together += [r | {"round": n + 1} for r in rows]
    if own is not None:
        job_request_stop(job=own)
        wait_for(lambda: running(own) is None, 120, 1, f"{OWN} to stop")

    print(f"\n{os.cpu_count()} cores; load average at the end {os.getloadavg()[0]:.1f}\n")
    print("| measure | n | each | median | p95 | target |\n|---|---:|---|---:|---:|---|")
    if first:
        print(
            f"| the first preview ({first['job']}): request → verdict | 1 | {first['verdict']:.2f} | – | – | ≤ 10 s |"
        )
    print(summary("upgrade preview: request → verdict", preview_rows, "verdict", "≤ 3 s p95"))
    print(summary("… request → its batch's proof (the preview done)", preview_rows, "done", "–"))
    print(summary("savepoint upgrade, shared driver: request → first batch", upgrades, "first_batch", "≤ 8 s"))
    print(summary("… its output gap", upgrades, "gap", "≤ 3 s"))
    print(summary("savepoint upgrade, own driver: request → first batch", own_upgrades, "first_batch", "≤ 8 s"))
    print(summary("… its output gap", own_upgrades, "gap", "≤ 3 s"))
    if args.preview_first:
        print(summary("… the preview before each upgrade (shared, own)", upgrades + own_upgrades, "preview", "–"))
    print(summary("savepoint rescale: request → first batch", rescales, "first_batch", "–"))
    print(summary("… its output gap", rescales, "gap", "≤ 5 s"))
    print(
        summary(
            "blue/green upgrade, shared driver: request → first batch in the sinks",
            green["upgrades"],
            "first_batch",
            "–",
        )
    )
    print(summary("… its output gap", green["upgrades"], "gap", "≤ 3 s"))
    print(
        summary("blue/green upgrade, own driver: request → first batch in the sinks", green["own"], "first_batch", "–")
    )
    print(summary("… its output gap", green["own"], "gap", "≤ 3 s"))
    print(summary("blue/green rescale: request → first batch in the sinks", green["rescales"], "first_batch", "–"))
    print(summary("… its output gap", green["rescales"], "gap", "≤ 5 s"))
    if together:
        print("\n| five at once: job | action | alone | together, each | median | ratio (≤ 2×) |")
        print("|---|---|---:|---|---:|---:|")
        for name in sorted({r["job"] for r in together}):
            rows = [r for r in together if r["job"] == name]
            key = "first_batch" if "first_batch" in rows[0] else "done"
            solo, each = alone[name][key], [r[key] for r in rows]
            print(f"| {name} | {rows[0]['kind']} ({key.replace('_', ' ')}) | {solo:.2f} s | "
                  f"{', '.join(f'{v:.2f}' for v in each)} s | {statistics.median(each):.2f} s | "
                  f"{statistics.median(each) / solo:.2f}× |")  # fmt: skip
    phases_table({"preview": preview_rows, "upgrade (shared)": upgrades, "upgrade (own)": own_upgrades,
                  "rescale": rescales, "blue/green upgrade (shared)": green["upgrades"],
                  "blue/green upgrade (own)": green["own"], "blue/green rescale": green["rescales"],
                  "five at once": together})  # fmt: skip


if __name__ == "__main__":
    main()
