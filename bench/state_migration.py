"""A state migration's cost on a busy stack: the preview and the apply per 100k state rows, and the output gap against
a savepoint upgrade's.

    .venv/bin/python -m bench.state_migration [--rows 100000] [--rounds 2] [--previews N]

Starts its own Celery worker with beat (Redis database 13) and the demo-like jobs beside (bench/busy.py: two jobs in
the shared driver fed 200 events/s). The subject is the team's ``customer-spend`` (RocksDB, trigger 2 s, a driver of
its own) holding ``--rows`` hourly windows in its state (one order per customer, each a window of its own), then fed
50 orders/s. Each round: the preview of the migration to ``customer-spend-daily`` (request to answer), the upgrade
with the migration (request to done, and the output gap: the old version's last committed batch to the new one's
first), its rollback, and a savepoint upgrade to ``customer-spend-v2`` and back for the gap it stops the output for.
With ``--previews N``: only N previews, each timed (a preview's first batch runs on a part of a large state:
``STATEKEEPER_MIGRATION_PREVIEW_KEYS``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import threading
import time
from datetime import UTC, datetime
from typing import Any

from bench.blue_green import ROOT, finished, gap_after, pct  # the same busy stack's settings (Redis database 13)
from bench.busy import busy_stack, make_job  # noqa: E402
from dashboard.models import ActionKind, Checkpoint, Job, RunStatus  # noqa: E402
from dashboard.services.actions import action_request  # noqa: E402
from dashboard.services.runs import job_request_start, job_request_stop  # noqa: E402
from statekeeper.polling import wait_for  # noqa: E402

RATE = 50  # orders/s into the subject while it is changed


def order(n: int, customer: str) -> str:
    return json.dumps({"order_id": f"o-{n}", "customer": {"id": customer, "region": "eu"},
                       "placed_at": datetime.now(UTC).isoformat(), "items": [{"sku": "A", "qty": 1, "price": "9.99"}]})  # fmt: skip


def fill(client: Any, job: Job, rows: int) -> None:
    """``rows`` orders, each of a customer of its own: as many windows in the state."""
    for start in range(0, rows, 5000):
        pipe = client.pipeline(transaction=False)
        for n in range(start, min(rows, start + 5000)):
            pipe.xadd(job.source_stream, {"v": order(n, f"c-{n}")})
        pipe.execute()


def keep_feeding(client: Any, job: Job, halt: threading.Event) -> None:
    rng, n = random.Random(7), 0
    while not halt.wait(0.1):
        pipe = client.pipeline(transaction=False)
        for _ in range(RATE // 10):
            n += 1
            pipe.xadd(job.source_stream, {"v": order(10**9 + n, f"c-{rng.randrange(1000)}")})
        pipe.execute()


def timed(job: Job, kind: str, params: dict[str, Any]) -> tuple[float, Any]:
    began = time.monotonic()
    action = finished(action_request(job=job, kind=kind, params=params), timeout=1800)
    return time.monotonic() - began, action


def change(job: Job, kind: str, params: dict[str, Any]) -> tuple[float, float]:
    """A change of the running job: its request-to-done time and its output gap."""
    job.refresh_from_db()
    old = job.runs.filter(status=RunStatus.RUNNING).get()
    took, _ = timed(job, kind, params)
    return took, gap_after(job, old.id, timeout=600)


def previews(job: Job, daily: dict[str, Any], count: int) -> None:
    """``count`` previews of the migration, one after another while the subject runs and is fed: request to answer."""
    took: list[float] = []
    for n in range(count):
        seconds, action = timed(job, ActionKind.UPGRADE_PREVIEW, daily)
        done = action.params.get("migration") or {}
        first = done.get("first_batch") or {}
        part = first.get("seeded") or {}
        took.append(seconds)
        print(f"  preview {n + 1}: {seconds:.1f} s, {action.status}; {done.get('rows_in')} state rows, "
              f"{done.get('keys_out')} keys; first batch {'ran' if first.get('ran') else 'not run'}, "
              f"{first.get('rows')} output rows, on {part.get('keys', done.get('keys_out'))} keys "
              f"({part.get('read')} read by the batch); in the state tool, from its start: {done.get('seconds')}",
              flush=True)  # fmt: skip
    print()
    print("| state rows | previews | p50 | p95 | max |")
    print("|---:|---:|---:|---:|---:|")
    print(f"| {done.get('rows_in')} | {len(took)} | {pct(took, 0.5):.1f} s | {pct(took, 0.95):.1f} s | "
          f"{max(took):.1f} s |")  # fmt: skip
    print(f"\n{os.cpu_count()} cores; logs and checkpoints under {ROOT}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=100_000, help="hourly windows in the subject's state")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--previews", type=int, default=0,
                        help="only this many previews (no upgrade), each timed, with the part of the state they ran on")  # fmt: skip
    args = parser.parse_args()
    client, halt = busy_stack(ROOT)
    job = make_job("migrate", "customer-spend", "rocksdb", driver="own", max_records_per_batch=20_000)
    fill(client, job, args.rows)
    job_request_start(job=job)
    wait_for(lambda: sum(Checkpoint.objects.filter(job=job).values_list("input_rows", flat=True)) >= args.rows,
             1800, 2, "the subject to read its orders")  # fmt: skip
    threading.Thread(target=keep_feeding, args=(client, job, halt), daemon=True).start()
    print(f"busy stack up; subject {job.name} holds {args.rows} windows, fed {RATE} orders/s", flush=True)
    rows: list[dict[str, Any]] = []
    daily = {"pipeline": "customer-spend-daily", "migrate": 1}
    if args.previews:
        previews(job, daily, args.previews)
        halt.set()
        job_request_stop(job=job)
        return
    for n in range(args.rounds):
        preview, action = timed(job, ActionKind.UPGRADE_PREVIEW, daily)
        state_rows = action.params["migration"]["rows_in"]
        migrate, migrate_gap = change(job, ActionKind.UPGRADE, daily)
        upgrade = job.actions.filter(kind=ActionKind.UPGRADE).latest("id")
        back, back_gap = change(job, ActionKind.UPGRADE_ROLLBACK, {"upgrade": upgrade.id})
        plain, plain_gap = change(job, ActionKind.UPGRADE, {"pipeline": "customer-spend-v2"})
        upgrade = job.actions.filter(kind=ActionKind.UPGRADE).latest("id")
        change(job, ActionKind.UPGRADE_ROLLBACK, {"upgrade": upgrade.id})
        row = {"round": n + 1, "state_rows": state_rows, "preview": preview, "migrate": migrate,
               "migrate_gap": migrate_gap, "back_gap": back_gap, "plain": plain, "plain_gap": plain_gap}  # fmt: skip
        rows.append(row)
        print(f"  round {n + 1}: {state_rows} state rows; preview {preview:.1f} s; migrate {migrate:.1f} s (gap "
              f"{migrate_gap:.1f} s); rollback gap {back_gap:.1f} s; savepoint upgrade {plain:.1f} s (gap "
              f"{plain_gap:.1f} s)", flush=True)  # fmt: skip
    halt.set()
    job_request_stop(job=job)
    print()
    print(
        "| state rows | rounds | preview | preview per 100k rows | migrate (request → done) | per 100k rows | "
        "output gap, migrate | output gap, its rollback | output gap, savepoint upgrade |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    state = statistics.median(r["state_rows"] for r in rows)
    med = {k: statistics.median(r[k] for r in rows) for k in ("preview", "migrate")}
    print(f"| {state:.0f} | {len(rows)} | {med['preview']:.1f} s | {med['preview'] * 100_000 / state:.1f} s | "
          f"{med['migrate']:.1f} s | {med['migrate'] * 100_000 / state:.1f} s | "
          f"p50 {pct([r['migrate_gap'] for r in rows], 0.5):.1f} s | p50 {pct([r['back_gap'] for r in rows], 0.5):.1f} s | "
          f"p50 {pct([r['plain_gap'] for r in rows], 0.5):.1f} s |")  # fmt: skip
    print(f"\n{os.cpu_count()} cores; logs and checkpoints under {ROOT}")


if __name__ == "__main__":
    main()
