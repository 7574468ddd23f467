"""History at scale: roll-ups per minute and per hour that add up to the raw checkpoints, raw records that age out
without leaving a hole in the long charts, and the chart resolution each range reads."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.utils import timezone

from dashboard.models import Checkpoint, CheckpointRollup
from dashboard.selectors import charts
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
    assert outcome == {"read": 420, "expired": 360, "journals": 0}, "no journal to expire here"
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
