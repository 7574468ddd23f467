"""History at scale and live latency, against the issue's targets.

    .venv/bin/python -m bench.console_history [--rows 1000000] [--latency-seconds 60]

1. The job page (first history page and summary), a deep history page, and the 4-week chart (series.json), for a job
   with --rows checkpoint records against one with 1,000 (target: ≤ 2×). The rows are spread over four weeks, one
   every 4 weeks / rows, rolled up as the console does. Requests go through Django's test client in this process,
   on the configured database (jobs named bench-*, deleted at the end).
2. Commit to browser: a real job (Celery worker with beat, driver process, uvicorn) watched by Chromium; for each
   batch, the time from its commit (trigger time + duration) to the point arriving in the page (target: p95 ≤ 1 s).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

os.environ["REDIS_URL"] = "redis://127.0.0.1:6379/12"
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "statekeeper.settings")
os.environ.setdefault("STATEKEEPER_ENV", "development")  # a local measurement
ROOT = Path(tempfile.mkdtemp(prefix="sk-bench-history-"))
os.environ["STATEKEEPER_CHECKPOINT_ROOT"] = str(ROOT / "checkpoints")
os.environ["STATEKEEPER_LOG_ROOT"] = str(ROOT / "logs")

import django  # noqa: E402

django.setup()

from bench.database import migrated  # noqa: E402

migrated()

import redis  # noqa: E402
from django.conf import settings  # noqa: E402
from django.contrib.auth import get_user_model  # noqa: E402
from django.test import Client  # noqa: E402
from django.test.utils import setup_test_environment  # noqa: E402
from django.utils import timezone  # noqa: E402

from dashboard.models import Checkpoint, Job  # noqa: E402
from dashboard.pipelines import get as get_pipeline  # noqa: E402
from dashboard.services.rollups import job_rollup  # noqa: E402
from dashboard.services.runs import job_request_start, job_request_stop  # noqa: E402
from statekeeper.chromium import CHROMIUM_ARGS, CHROMIUM_PATH  # noqa: E402
from statekeeper.polling import wait_for  # noqa: E402
from statekeeper.processes import celery_worker_command, web_command  # noqa: E402


def fill(job: Job, rows: int) -> float:
    """Checkpoint records spread over the last four weeks, as a job committing steadily leaves them."""
    started = time.perf_counter()
    now = timezone.now()
    every = timedelta(weeks=4) / rows
    chunk = 20_000
    for first in range(0, rows, chunk):
        Checkpoint.objects.bulk_create(
            [
                Checkpoint(
                    job=job,
                    batch_id=b,
                    committed_at=now - timedelta(weeks=4) + every * b,
                    duration_ms=200 + b % 50,
                    input_rows=40,
                    input_rate=20.0,
                    processed_rate=40.0,
                    lag_records=b % 30,
                    state_rows_total=b % 5000,
                    state_memory_bytes=100_000 + b % 5000,
                    checkpointed_bytes=3000,
                    full_size_bytes=1_000_000 + b,
                    end_offset={"id": f"{b}-0", "n": b * 40},
                )
                for b in range(first, min(rows, first + chunk))
            ],
            batch_size=5000,
        )
    job.latest_checkpoint = Checkpoint.objects.filter(job=job).order_by("-batch_id").first()
    job.save(update_fields=["latest_checkpoint"])
    return time.perf_counter() - started


def timed(client: Client, url: str, repeat: int) -> float:
    """Median milliseconds of `repeat` requests, after one warm-up."""
    assert client.get(url).status_code == 200, url
    samples = []
    for _ in range(repeat):
        started = time.perf_counter()
        response = client.get(url)
        samples.append((time.perf_counter() - started) * 1000)
        assert response.status_code == 200, url
    return statistics.median(samples)


def history_scale(rows: int, repeat: int, keep: bool) -> list[tuple[str, float, float]]:
    setup_test_environment()
    big = Job.objects.filter(name="bench-big").first()
    reuse = keep and big is not None and Checkpoint.objects.filter(job=big).count() == rows
    if not reuse:
        Job.objects.filter(name__startswith="bench-").delete()
        small = Job.objects.create(name="bench-small", pipeline="url-counts", source_stream="bench:small")
        big = Job.objects.create(name="bench-big", pipeline="url-counts", source_stream="bench:big")
        print(f"filling {rows:,} rows …", flush=True)
        fill(small, 1000)
        took = fill(big, rows)
        print(f"  inserted in {took:.0f} s; rolling up …", flush=True)
        started = time.perf_counter()
        later = timezone.now() + timedelta(seconds=10)
        job_rollup(small, later)
        job_rollup(big, later)
        print(f"  rolled up in {time.perf_counter() - started:.0f} s", flush=True)
    else:
        print("reusing the bench-* jobs kept by --keep", flush=True)
    small = Job.objects.get(name="bench-small")
    assert big is not None
    try:
        user, _ = get_user_model().objects.get_or_create(username="bench-viewer")
        client = Client()
        client.force_login(user)
        results = []
        for label, path in [
            ("job page (history page 1, summary)", "/jobs/{name}/"),
            ("history page in the middle", "/jobs/{name}/?before={middle}"),
            ("4-week chart (series.json)", "/jobs/{name}/series.json?range=4w"),
            ("1-day chart (series.json)", "/jobs/{name}/series.json?range=1d"),
        ]:
            times = []
            for job in (small, big):
                ids = Checkpoint.objects.filter(job=job).order_by("committed_at").values_list("id", flat=True)
                middle = ids[ids.count() // 2]
                times.append(timed(client, path.format(name=job.name, middle=middle), repeat))
            results.append((label, times[0], times[1]))
        return results
    finally:
        if not keep:
            Job.objects.filter(name__startswith="bench-").delete()


def spawn(args: list[str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def latency(seconds: int) -> list[float]:
    from playwright.sync_api import sync_playwright

    client = redis.Redis.from_url(settings.REDIS_URL)
    client.flushdb()
    Job.objects.filter(name="bench-live").delete()
    job = Job.objects.create(
        name="bench-live", pipeline="url-counts", source_stream="bench:live", trigger_interval_seconds=1
    )
    port = free_port()
    web = spawn(web_command(port), ROOT / "web.log")
    worker = spawn(celery_worker_command(ROOT / "beat", loglevel="WARNING"), ROOT / "worker.log")
    halt = threading.Event()
    make = get_pipeline("url-counts").generator(random.Random(5))

    def produce() -> None:
        while not halt.wait(0.1):
            for _ in range(5):
                client.xadd(job.source_stream, {"v": make(int(time.time() * 1000))})

    user = get_user_model().objects.filter(username="bench-viewer").first() or get_user_model().objects.create_user(
        "bench-viewer", password="bench-pw"
    )
    user.set_password("bench-pw")
    user.save()
    try:
        threading.Thread(target=produce, daemon=True).start()
        job_request_start(job=job)
        wait_for(lambda: job.checkpoints.exists(), 180, 0.5, "the first batch")
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM_PATH, args=CHROMIUM_ARGS)
            page = browser.new_page()
            base = f"http://127.0.0.1:{port}"
            page.goto(f"{base}/login/?next=/jobs/bench-live/")
            page.fill("#id_username", "bench-viewer")
            page.fill("#id_password", "bench-pw")
            page.click("button[type=submit]")
            page.wait_for_url(f"{base}/jobs/bench-live/")
            time.sleep(seconds)
            measured = page.evaluate("window.statekeeperLive.latencies()")
            browser.close()
        return [float(v) for v in measured]
    finally:
        halt.set()
        with contextlib.suppress(Exception):
            job_request_stop(job=job)
            wait_for(lambda: not job.runs.filter(status__in=["running", "stopping"]).exists(), 120, 1, "the stop")
        for proc in (worker, web):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 15)
            proc.wait(30)
        Job.objects.filter(name="bench-live").delete()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--latency-seconds", type=int, default=60)
    parser.add_argument("--only", choices=["scale", "latency"], help="run one of the two parts")
    parser.add_argument("--keep", action="store_true", help="keep the bench-* jobs and their rows for the next run")
    args = parser.parse_args()
    try:
        if args.only != "latency":
            scale = history_scale(args.rows, args.repeat, args.keep)
            print()
            print(f"| measure (median of {args.repeat}) | 1,000 rows | {args.rows:,} rows | ratio | target |")
            print("|---|---:|---:|---:|---|")
            for label, small, big in scale:
                print(f"| {label} | {small:.1f} ms | {big:.1f} ms | {big / small:.2f}× | ≤ 2× |", flush=True)
        if args.only != "scale":
            subprocess.run([sys.executable, "manage.py", "collectstatic", "--noinput", "-v0"], check=True)
            measured = sorted(latency(args.latency_seconds))
            if not measured:
                raise SystemExit("no batch reached the browser")
            p95 = measured[min(len(measured) - 1, int(0.95 * len(measured)))]
            print()
            print("| commit to browser | batches | p50 | p95 | max | target |")
            print("|---|---:|---:|---:|---:|---|")
            print(
                f"| url-counts, 1 s trigger, 50 ev/s | {len(measured)} | {statistics.median(measured):.0f} ms "
                f"| {p95:.0f} ms | {measured[-1]:.0f} ms | p95 ≤ 1000 ms |"
            )
    finally:
        shutil.rmtree(ROOT, ignore_errors=True)


if __name__ == "__main__":
    main()
