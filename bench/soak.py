"""Soak: the demo stack run for an hour or more at 2 s triggers, sampled every minute, to show what grows.

    .venv/bin/python -m bench.soak [--minutes 60] [--every 60] [--warmup 10] [--port 8300] [--out var/soak]
    .venv/bin/python -m bench.soak --report var/soak     # the table and chart again, from the samples

Starts ``./bin/dev`` (the console's database, Redis and this checkout's var/), then the two demo jobs it leaves
stopped, so that four jobs run: the memory and RocksDB backends, a shared driver, and the team job's own table and
Parquet lake. The RocksDB jobs take a savepoint every 10 minutes and keep 3. Every ``--every`` seconds it records:

- PSS and RSS of every process kind: the shared driver, the spare, an own driver, a standby, the state reader, the
  web server, the Celery worker, beat and the producer (each process tree, summed);
- the console database's size per table, and the team database's;
- each job's directory (the live checkpoint, savepoints, the rest) and each sink's bookkeeping (results rows, undo
  records, the team table's commit rows, the lake's log files);
- Redis' memory.

At the end ``bin/dev`` is stopped (on any exit), and ``<out>/samples.jsonl``, ``<out>/soak.html`` and the table
(Markdown, on standard output and in ``<out>/table.md``) are written: each figure after the warm-up against its last
value, flat when within ±10 %. ``<out>/soak.png`` is the chart drawn by Debian's chromium.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from bench.procs import command, parents, sizes

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "statekeeper.settings")
os.environ.setdefault("STATEKEEPER_ENV", "development")
DEV_DATABASE = "postgres://postgres@127.0.0.1:5432/statekeeper"  # the one bin/dev's set-up makes
os.environ.setdefault("DATABASE_URL", DEV_DATABASE)

PROCESS_KINDS = {  # a process tree's kind, by what its root runs
    "workers.host_process": "shared driver",
    "workers.driver_process": "own driver",
    "workers.standby_process": "standby",
    "workers.spark.state_reader": "state reader",
    "uvicorn": "web",
    "celery -A statekeeper worker": "Celery worker",
    "celery -A statekeeper beat": "Celery beat",
    "produce_events": "producer",
}
FLAT = 0.10


def process_memory(spares: set[int], root: int | None = None) -> dict[str, dict[str, int]]:
    """PSS and RSS in MiB per process kind: every process counted with the nearest ancestor whose command names a
    kind (a driver's JVM and Python workers with the driver). ``spares``: the spare shared drivers' pids. ``root``:
    only processes under it (the soak's bin/dev), not another console's or a test's on the same machine."""
    parent, commands = parents(), {}
    for pid in parent:
        try:
            commands[pid] = command(pid)
        except OSError:
            continue

    def under_root(pid: int) -> bool:
        seen = 0
        while pid and seen < 100:
            if pid == root:
                return True
            pid, seen = parent.get(pid, 0), seen + 1
        return False

    def kind_of(pid: int) -> str | None:
        if root is not None and not under_root(pid):
            return None
        seen = 0
        while pid in commands and seen < 50:
            for needle, kind in PROCESS_KINDS.items():
                if needle in commands[pid]:
                    return "spare shared driver" if kind == "shared driver" and pid in spares else kind
            pid, seen = parent.get(pid, 0), seen + 1
        return None

    totals: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0])
    for pid in commands:
        if (kind := kind_of(pid)) is None:
            continue
        try:
            pss, rss = sizes(pid)
        except OSError:
            continue
        totals[kind][0] += pss
        totals[kind][1] += rss
        totals[kind][2] += 1
    return {k: {"pss_mib": v[0] // 1024, "rss_mib": v[1] // 1024, "processes": v[2]} for k, v in totals.items()}


def table_sizes(dsn: str) -> dict[str, int]:
    import psycopg

    with psycopg.connect(dsn, connect_timeout=5) as conn:
        # the public schema's: a session's temporary table (a sink's scratch table) may go while it is read
        rows = conn.execute(
            "SELECT relname, pg_total_relation_size(relid) FROM pg_stat_user_tables WHERE schemaname = 'public'"
        ).fetchall()
    return {name: int(size) for name, size in rows if size is not None}


def tree_bytes(path: Path) -> int:
    total = 0
    for dirpath, _, names in os.walk(path):
        for name in names:
            try:
                total += (Path(dirpath) / name).stat().st_size
            except OSError:
                continue
    return total


def sample(team_dsn: str, root: int | None = None) -> dict[str, Any]:
    import redis
    from django.conf import settings

    from dashboard.models import DriverHost, HostStatus, Job, ResultRow, ResultUndo

    spares = {
        int(pid) for pid in DriverHost.objects.filter(status=HostStatus.SPARE).values_list("pid", flat=True) if pid
    }
    jobs: dict[str, Any] = {}
    for job in Job.objects.all():
        live = job.checkpoint_location
        whole = tree_bytes(job.directory)
        jobs[job.name] = {
            "checkpoint_bytes": tree_bytes(live),
            "savepoint_bytes": tree_bytes(job.savepoint_root),
            "other_bytes": whole - tree_bytes(live) - tree_bytes(job.savepoint_root),
            "results_rows": ResultRow.objects.filter(job=job).count(),
            "undo_records": ResultUndo.objects.filter(job=job).count(),
            "checkpoint_records": job.checkpoints.count(),
        }
    lake = settings.BASE_DIR / "var" / "lake" / "customer_spend"
    sinks = {
        "lake_log_files": len(list((lake / "_spark_metadata").glob("*"))) if lake.is_dir() else 0,
        "lake_batch_records": len(list((lake / "_statekeeper" / "batches").glob("*"))) if lake.is_dir() else 0,
    }
    team = table_sizes(team_dsn) if team_dsn else {}
    if team_dsn:
        import psycopg

        with psycopg.connect(team_dsn, connect_timeout=5) as conn:
            found = conn.execute("SELECT to_regclass('statekeeper_sink_commits')").fetchone()
            counted = (
                conn.execute("SELECT count(*) FROM statekeeper_sink_commits").fetchone() if found and found[0] else None
            )
            sinks["team_commit_rows"] = int(counted[0]) if counted else 0
    db = settings.DATABASES["default"]
    console_dsn = f"host={db['HOST']} port={db['PORT'] or 5432} user={db['USER']} dbname={db['NAME']}"
    return {
        "t": time.time(),
        "processes": process_memory(spares, root),
        "console_tables": table_sizes(console_dsn),
        "team_tables": team,
        "jobs": jobs,
        "sinks": sinks,
        "redis_bytes": int(redis.Redis.from_url(settings.REDIS_URL).info("memory")["used_memory"]),
    }


def series(samples: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Every figure of the samples as a named series (missing points as NaN)."""
    named: dict[str, list[float]] = collections.defaultdict(lambda: [float("nan")] * len(samples))
    for i, s in enumerate(samples):
        for kind, m in s["processes"].items():
            named[f"PSS MiB: {kind}"][i] = m["pss_mib"]
        named["console database MiB"][i] = sum(s["console_tables"].values()) / 2**20
        for table, size in s["console_tables"].items():
            if table.startswith("dashboard_"):
                named[f"table MiB: {table}"][i] = size / 2**20
        named["team database MiB"][i] = sum(s["team_tables"].values()) / 2**20
        for job, figures in s["jobs"].items():
            for figure, value in figures.items():
                unit = "MiB" if figure.endswith("_bytes") else ""
                named[f"{job}: {figure.removesuffix('_bytes')} {unit}".strip()][i] = value / 2**20 if unit else value
        for figure, value in s["sinks"].items():
            named[f"sink: {figure}"][i] = value
        named["Redis MiB"][i] = s["redis_bytes"] / 2**20
    return dict(named)


def report(out: Path, warmup_minutes: float) -> str:
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines() if line.strip()]
    if len(samples) < 2:
        sys.exit(f"{out / 'samples.jsonl'} holds {len(samples)} sample(s): at least two are needed")
    start = samples[0]["t"]
    minutes = [(s["t"] - start) / 60 for s in samples]
    after = next((i for i, m in enumerate(minutes) if m >= warmup_minutes), 0)
    named = series(samples)
    lines = [
        f"{len(samples)} samples over {minutes[-1]:.0f} min; warm-up {warmup_minutes:g} min (sample {after}).",
        "",
        "| figure | after warm-up | last | max | change | verdict |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for name in sorted(named):
        values = named[name]
        first, last = values[after], values[-1]
        peak = max((v for v in values[after:] if v == v), default=float("nan"))
        if first != first or last != last:
            continue
        change = (last - first) / first if first else (0.0 if last == 0 else float("inf"))
        verdict = "flat" if abs(change) <= FLAT or abs(last - first) < 1 else "grows" if change > 0 else "falls"
        lines.append(f"| {name} | {first:,.1f} | {last:,.1f} | {peak:,.1f} | {change:+.0%} | {verdict} |")
    table = "\n".join(lines)
    (out / "table.md").write_text(table + "\n")
    chart(out, minutes, named)
    return table


def chart(out: Path, minutes: list[float], named: dict[str, list[float]]) -> None:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    panels = [
        ("Memory by process kind (PSS, MiB)", lambda n: n.startswith("PSS MiB: ")),
        ("Console database and Redis (MiB)", lambda n: n in ("console database MiB", "team database MiB", "Redis MiB")),
        ("Job directories (MiB)", lambda n: n.endswith(" MiB") and ": " in n and not n.startswith(("PSS", "table"))),
        ("Rows and records", lambda n: n.endswith(("results_rows", "undo_records", "checkpoint_records"))
         or n.startswith("sink: ")),
    ]  # fmt: skip
    figure = make_subplots(rows=len(panels), cols=1, subplot_titles=[t for t, _ in panels], vertical_spacing=0.06)
    for row, (_, wanted) in enumerate(panels, start=1):
        for name in sorted(n for n in named if wanted(n)):
            label = name.removeprefix("PSS MiB: ").removeprefix("sink: ")
            figure.add_trace(go.Scatter(x=minutes, y=named[name], name=label, mode="lines"), row=row, col=1)
    figure.update_xaxes(title_text="minutes")
    figure.update_layout(height=1500, width=1100, title="Soak: the demo stack at 2 s triggers", showlegend=True)
    html = out / "soak.html"
    figure.write_html(html, include_plotlyjs=True)
    try:
        from playwright.sync_api import sync_playwright

        with sync_playwright() as p:
            browser = p.chromium.launch(
                executable_path="/usr/bin/chromium",
                args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                      "--disable-component-update", "--disable-sync"],
            )  # fmt: skip
            page = browser.new_page(viewport={"width": 1100, "height": 1500})
            page.goto(html.as_uri())
            page.wait_for_timeout(1500)
            page.screenshot(path=str(out / "soak.png"), full_page=True)
            browser.close()
    except Exception as exc:  # the HTML stands; the picture is a convenience
        print(f"the chart's picture was not drawn ({type(exc).__name__}: {exc}); open {html}", file=sys.stderr)


def soak(args: argparse.Namespace) -> None:
    import django

    django.setup()
    from django.conf import settings
    from django.db import connection
    from django.db.utils import Error as DatabaseError

    from dashboard.models import ACTIVE_RUN_STATUSES, Job
    from dashboard.services.runs import job_request_start
    from statekeeper.polling import wait_for

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    samples = out / "samples.jsonl"
    samples.write_text("")
    env = dict(os.environ, PORT=str(args.port))
    if env.get("DATABASE_URL") == DEV_DATABASE:  # bin/dev creates its database only when it is given none
        del env["DATABASE_URL"]
    dev = subprocess.Popen(["./bin/dev"], cwd=ROOT, env=env, stdout=(out / "dev.log").open("ab"),
                           stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip

    def stop(*_: Any) -> None:
        if dev.poll() is None:
            os.killpg(dev.pid, signal.SIGINT)  # bin/dev stops its jobs, then everything it started
            try:
                dev.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(dev.pid, signal.SIGKILL)
        if _:
            sys.exit(1)

    signal.signal(signal.SIGTERM, stop)
    try:

        def seeded() -> bool:  # bin/dev makes and migrates the database first: until then it may not exist
            try:
                return Job.objects.filter(name="orders-rocksdb").exists()
            except DatabaseError:
                connection.close()
                return False

        wait_for(lambda: seeded() or dev.poll() is not None, 600, 2, "bin/dev seeded its demo jobs")
        if dev.poll() is not None:
            sys.exit(f"bin/dev ended ({dev.returncode}); see {out / 'dev.log'}")
        for job in Job.objects.all():
            if job.state_backend != "memory":
                Job.objects.filter(id=job.id).update(savepoint_interval_minutes=10, savepoints_max_count=3)
            if not job.runs.filter(status__in=ACTIVE_RUN_STATUSES).exists():
                job_request_start(job=job)
        team = os.environ.get("STATEKEEPER_DEMO_TEAM_DSN") or (
            f"host={settings.DATABASES['default']['HOST']} port={settings.DATABASES['default']['PORT'] or 5432} "
            f"user=postgres dbname=team_orders"
        )
        deadline = time.monotonic() + timedelta(minutes=args.minutes).total_seconds()
        while time.monotonic() < deadline:
            if dev.poll() is not None:
                sys.exit(f"bin/dev ended ({dev.returncode}) during the soak; see {out / 'dev.log'}")
            taken = time.monotonic()
            try:
                taken_sample = sample(team, dev.pid)
            except Exception as exc:  # one sample lost, said, and the soak goes on
                print(f"a sample failed at {time.strftime('%H:%M:%S')}: {type(exc).__name__}: {exc}", flush=True)
                connection.close()
            else:
                with samples.open("a") as writer:
                    writer.write(json.dumps(taken_sample) + "\n")
                print(f"sample {sum(1 for _ in samples.open())} at {time.strftime('%H:%M:%S')}", flush=True)
            time.sleep(max(0.0, args.every - (time.monotonic() - taken)))
    finally:
        stop()
    print(report(out, args.warmup))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=60)
    parser.add_argument("--every", type=float, default=60, help="seconds between samples")
    parser.add_argument("--warmup", type=float, default=10, help="minutes before the figures are compared")
    parser.add_argument("--port", type=int, default=8300)
    parser.add_argument("--out", type=Path, default=ROOT / "var" / "soak")
    parser.add_argument("--report", type=Path, help="only the table and chart again, from this directory's samples")
    args = parser.parse_args()
    if args.report:
        print(report(args.report, args.warmup))
    else:
        soak(args)


if __name__ == "__main__":
    main()
