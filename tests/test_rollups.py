"""History at scale: roll-ups per minute and per hour that add up to the raw checkpoints, raw records that age out
without leaving a hole in the long charts, and the chart resolution each range reads."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta

import pytest
from django.utils import timezone

from dashboard.models import Checkpoint, CheckpointRollup
from dashboard.selectors import charts
from dashboard.services.logs import logs_rotate
from dashboard.services.rollups import job_rollup, raw_expire, rollups_run

pytestmark = pytest.mark.django_db


def history(job, start: datetime, count: int, every: float = 10.0, first_batch: int = 0) -> list[Checkpoint]:
    rows = Checkpoint.objects.bulk_create(
        Checkpoint(
            job=job,
            batch_id=first_batch + i,
            committed_at=start + timedelta(seconds=every * i),
            duration_ms=100 + i % 7,
            input_rows=5,
            input_rate=2.0,
            processed_rate=4.0,
            lag_records=(i * 13) % 50,
            state_rows_total=i,
            state_memory_bytes=1000 + i,
            checkpointed_bytes=300,
            full_size_bytes=10_000 + i,
            end_offset={"id": f"{i}-0", "n": i},
        )
        for i in range(count)
    )
    job.latest_checkpoint = rows[-1]
    job.save()
    return rows


def settled() -> datetime:
    return timezone.now() + timedelta(seconds=10)


def test_minute_and_hour_rollups_add_up_to_the_raw_checkpoints(make_job):
    job = make_job()
    start = datetime(2026, 11, 20, 9, 0, tzinfo=UTC)
    history(job, start, 3 * 360)  # three hours, a batch every 10 s

    assert job_rollup(job, settled()) == 1080
    minutes = CheckpointRollup.objects.filter(job=job, resolution=60)
    hours = CheckpointRollup.objects.filter(job=job, resolution=3600).order_by("bucket")
    assert minutes.count() == 180 and [h.bucket.hour for h in hours] == [9, 10, 11]
    assert {m.batches for m in minutes} == {6}
    assert sum(h.batches for h in hours) == 1080
    assert sum(h.input_rows for h in hours) == 1080 * 5
    assert sum(h.checkpointed_bytes_sum for h in hours) == 1080 * 300
    first_hour = hours[0]
    assert (first_hour.batch_first, first_hour.batch_last) == (0, 359)
    assert first_hour.lag_records_max == 49 and first_hour.state_rows_last == 359
    assert first_hour.duration_ms_avg == pytest.approx(sum(100 + i % 7 for i in range(360)) / 360)
    assert job_rollup(job, settled()) == 0, "a second pass reads nothing new"


def test_a_late_record_recomputes_its_bucket(make_job):
    job = make_job()
    start = datetime(2026, 11, 20, 9, 0, tzinfo=UTC)
    history(job, start, 6)  # 09:00:00 .. 09:00:50
    job_rollup(job, settled())
    # a checkpoint recovered later from a driver's journal, committed in the same minute
    Checkpoint.objects.create(
        job=job, location="checkpoint-rollback-9", batch_id=0, committed_at=start + timedelta(seconds=55),
        duration_ms=1, input_rows=100, lag_records=999,
    )  # fmt: skip
    job_rollup(job, settled())
    minute = CheckpointRollup.objects.get(job=job, resolution=60, bucket=start)
    hour = CheckpointRollup.objects.get(job=job, resolution=3600, bucket=start)
    assert minute.batches == 7 and minute.input_rows == 130 and minute.lag_records_max == 999
    assert hour.batches == 7 and hour.input_rows == 130


def test_raw_records_age_out_but_the_four_week_chart_keeps_them(make_job, settings):
    settings.CHECKPOINT_RAW_RETENTION_HOURS = 24
    job = make_job()
    now = timezone.now()
    old = history(job, now - timedelta(days=10), 360)  # an hour, ten days ago
    recent = history(job, now - timedelta(minutes=30), 60, every=30, first_batch=360)
    assert raw_expire(job, now) == 0, "nothing is deleted before it is rolled up"
    outcome = rollups_run(settled())
    assert outcome == {"read": 420, "expired": 360, "journals": 0, "rotated": 0, "removed": 0}, "no journal or log here"
    assert not Checkpoint.objects.filter(id__in=[c.id for c in old]).exists()
    assert Checkpoint.objects.filter(job=job).count() == 60
    job.refresh_from_db()
    assert job.latest_checkpoint_id == recent[-1].id

    month = charts.chart_series(job, charts.RANGES["4w"], now)
    assert month.resolution == "hour"
    batches = sum(p.get("batches", 1) for p in month.points if p["location"] == "checkpoint")
    assert batches == 420, "every batch of the last four weeks is in the chart, raw or rolled up"
    assert len(month.points) <= 4 * 7 * 24 + 60
    assert [p["batch"] for p in month.recent][-1] == 419


def test_the_latest_checkpoint_survives_retention(make_job, settings):
    settings.CHECKPOINT_RAW_RETENTION_HOURS = 1
    job = make_job()
    rows = history(job, timezone.now() - timedelta(days=3), 30)
    rollups_run(settled())
    assert list(Checkpoint.objects.filter(job=job).values_list("id", flat=True)) == [rows[-1].id]
    assert job.latest_checkpoint_id == rows[-1].id


@pytest.mark.parametrize(
    ("range_", "resolution"), [("15m", "batch"), ("6h", "batch"), ("1d", "minute"), ("1w", "hour")]
)
def test_each_range_reads_the_resolution_that_fits_it(make_job, range_, resolution):
    job = make_job()
    history(job, timezone.now() - timedelta(minutes=20), 120)
    job_rollup(job, settled())
    series = charts.chart_series(job, charts.RANGES[range_])
    assert series.resolution == resolution
    assert series.points[-1]["batch"] == 119, "the right edge is the newest batch whatever the resolution"


def test_a_log_past_its_size_is_rotated_under_a_writing_process_and_a_stale_log_goes(settings, tmp_path):
    """The writer keeps its descriptor: the log is copied to .1 and cut in place, and the process writes on at the new
    start of the file (not at its old offset, which would leave a hole of zeros as large as what was cut)."""
    settings.LOG_ROOT, settings.LOG_MAX_MB, settings.LOG_KEEP, settings.LOG_RETENTION_DAYS = tmp_path, 1, 2, 14
    log = tmp_path / "orders-run-7.log"
    writer = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\n"
         "for i in range(100000):\n    print(f'line {i:06d} ' + 'x' * 100, flush=True)\n    if i > 12000: time.sleep(0.002)"],
        stdout=log.open("ab"),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while log.stat().st_size <= 1024 * 1024 and time.monotonic() < deadline:
            time.sleep(0.05)
        stale = tmp_path / "gone-run-1.log"
        stale.write_text("an ended run's log\n")
        os.utime(stale, (time.time() - 15 * 86400,) * 2)
        assert logs_rotate() == {"rotated": 1, "removed": 1}
        time.sleep(0.3)
    finally:
        writer.kill()
        writer.wait()
    part = (tmp_path / "orders-run-7.log.1").read_bytes()
    assert part.startswith(b"line 000000 ") and len(part) > 1024 * 1024
    live = log.read_bytes()
    assert live and not live.startswith(b"\0"), "written on at the start of the cut file"
    last_copied = int(part.rstrip(b"\n").rsplit(b"\n", 1)[-1].split()[1])
    assert int(live.split()[1]) >= last_copied, "the writer went on after what was copied"
    assert not stale.exists()
    assert logs_rotate() == {"rotated": 0, "removed": 0}, "under its size: left alone"
