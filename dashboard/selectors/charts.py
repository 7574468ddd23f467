"""Chart points of a job, from checkpoint records and roll-ups, for the job page and the live push. Every figure in a
point is a measure of ``dashboard.records``."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.utils import timezone

from dashboard.models import Checkpoint, CheckpointRollup, Job, Run
from dashboard.records import CHART_COLUMNS, MEASURES, parse_time
from dashboard.selectors.lag import STATUS_WINDOW

RANGES = {
    "15m": timedelta(minutes=15),
    "1h": timedelta(hours=1),
    "6h": timedelta(hours=6),
    "1d": timedelta(days=1),
    "1w": timedelta(weeks=1),
    "4w": timedelta(weeks=4),
}
MAX_POINTS = 3000
# Up to 6 hours the charts show every checkpoint (thinned); a day shows minutes; a week or four show hours.
RAW_UP_TO = timedelta(hours=6)
MINUTES_UP_TO = timedelta(days=1)
# What the page calls each figure of a point, for the chart legends
LABELS = {m.point: {"label": m.label, "unit": m.unit} for m in MEASURES}


def _shown(unit: str, value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 1) if unit == "rows/s" else round(value)
    return value


def _with_lag_seconds(p: dict[str, Any]) -> dict[str, Any]:
    lag, rate = p.get("lag"), p.get("proc_rate") or 0
    p["lag_s"] = round(lag / rate, 2) if lag is not None and rate > 0 else None
    return p


def point(record: dict[str, Any]) -> dict[str, Any]:
    """One chart point from a checkpoint record (the driver's record or a stored Checkpoint's fields)."""
    committed = record["committed_at"]
    if isinstance(committed, str):
        committed = parse_time(committed)
    p: dict[str, Any] = {
        "t": committed.isoformat(),
        "batch": record["batch_id"],
        "location": record.get("location", "checkpoint"),
    }
    p.update({m.point: _shown(m.unit, m.value(record)) for m in MEASURES})
    # per stateful operator: [rows, bytes in memory, RocksDB's SST files' bytes (None for the memory backend)]
    p["ops"] = [
        [
            op.get("numRowsTotal", 0),
            op.get("memoryUsedBytes", 0),
            (op.get("customMetrics") or {}).get("rocksdbSstFileSize"),
        ]
        for op in record.get("state_operators") or []
    ]
    return _with_lag_seconds(p)


def rollup_point(r: CheckpointRollup) -> dict[str, Any]:
    """A chart point from a roll-up bucket: the same keys as point() (each measure's first roll-up column), plus how
    many batches it holds and the longest batch."""
    p: dict[str, Any] = {"t": r.bucket.isoformat(), "batch": r.batch_last, "batches": r.batches, "location": r.location}
    p.update({m.point: _shown(m.unit, getattr(r, m.rollups[0][0])) for m in MEASURES if m.rollups})
    p["dur_max"] = r.duration_ms_max
    return _with_lag_seconds(p)


def job_series(job: Job, since: datetime) -> list[dict[str, Any]]:
    """Chart points since a time, oldest first; thinned evenly to at most MAX_POINTS."""
    rows = list(
        Checkpoint.objects.filter(job=job, committed_at__gte=since).order_by("committed_at").values(*CHART_COLUMNS)
    )
    if len(rows) > MAX_POINTS:
        step = len(rows) / MAX_POINTS
        rows = [rows[int(i * step)] for i in range(MAX_POINTS - 1)] + [rows[-1]]
    return [point(row) for row in rows]


def recent_points(job: Job, run: Run | None = None) -> list[dict[str, Any]]:
    """The last STATUS_WINDOW checkpoints (of one run, when given), oldest first: what the lag status is judged on."""
    rows = Checkpoint.objects.filter(job=job)
    if run is not None:
        rows = rows.filter(run=run)
    newest = rows.order_by("-committed_at", "-id").values(*CHART_COLUMNS)[:STATUS_WINDOW]
    return [point(row) for row in reversed(newest)]


@dataclass
class Series:
    points: list[dict[str, Any]]
    resolution: str  # "batch", "minute" or "hour"
    recent: list[dict[str, Any]]  # the last raw checkpoints: what the lag status is judged on


def chart_series(job: Job, span: timedelta, now: datetime | None = None) -> Series:
    """The points for a chart range: raw checkpoints up to 6 hours, minute roll-ups up to a day, hours beyond.
    After the newest complete roll-up, the raw checkpoints follow, so the right edge is never behind."""
    now = now or timezone.now()
    since = now - span
    recent = recent_points(job)
    if span <= RAW_UP_TO:
        return Series(job_series(job, since), "batch", recent)
    resolution = CheckpointRollup.MINUTE if span <= MINUTES_UP_TO else CheckpointRollup.HOUR
    buckets = list(
        CheckpointRollup.objects.filter(job=job, resolution=resolution, bucket__gte=since).order_by("bucket")
    )
    points = [rollup_point(b) for b in buckets]
    # roll-ups trail the commits by up to a pass: the time after the last complete bucket comes from raw records
    tail_from = buckets[-1].bucket + timedelta(seconds=resolution) if buckets else since
    tail = job_series(job, max(tail_from, since))
    return Series(points + tail, "minute" if resolution == CheckpointRollup.MINUTE else "hour", recent)
