"""Roll-ups: checkpoints summarised per minute and per hour, so a 4-week chart reads at most 672 rows whatever the
commit rate, and raw records can age out after CHECKPOINT_RAW_RETENTION_HOURS.

Incremental: each pass re-aggregates only the buckets touched by checkpoints recorded since the last pass (a record
recovered late from a journal lands in an old bucket, and that bucket is recomputed whole)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from dashboard.checkpoint_dir.journal import journals_expire
from dashboard.models import ACTIVE_RUN_STATUSES, Checkpoint, CheckpointRollup, Job
from dashboard.records import CHART_COLUMNS, MEASURES
from dashboard.services.logs import logs_rotate

SETTLE_SECONDS = 5
# (measure, roll-up column, how) for every column a bucket keeps of the checkpoints in it
KEPT = [(m, column, how) for m in MEASURES for column, how in m.rollups]


def bucket_of(moment: datetime, resolution: int) -> datetime:
    seconds = int(moment.timestamp()) // resolution * resolution
    return datetime.fromtimestamp(seconds, tz=UTC)


def _combine(how: str, values: list[Any], weights: list[int]) -> Any:
    """avg (weighted by batches), max, sum or last of a bucket's values; None values are left out of max and avg."""
    if how == "last":
        return values[-1]
    if how == "sum":
        return sum(v or 0 for v in values)
    if how == "max":
        present = [v for v in values if v is not None]
        return max(present) if present else None
    total = sum(weights)
    return sum((v or 0) * w for v, w in zip(values, weights, strict=True)) / total


def _bucket(identity: dict[str, Any], weights: list[int], value: Any) -> dict[str, Any]:
    return identity | {column: _combine(how, value(m, column), weights) for m, column, how in KEPT}


def _from_checkpoints(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One minute bucket from its raw checkpoints (oldest first)."""
    identity = {
        "location": rows[-1]["location"],
        "batches": len(rows),
        "batch_first": rows[0]["batch_id"],
        "batch_last": rows[-1]["batch_id"],
        "last_committed_at": rows[-1]["committed_at"],
    }
    return _bucket(identity, [1] * len(rows), lambda m, _: [m.value(r) for r in rows])


def _from_rollups(rows: list[CheckpointRollup]) -> dict[str, Any]:
    """One hour bucket from its minute buckets: averages weighted by batches, sums summed, the last value kept."""
    identity = {
        "location": rows[-1].location,
        "batches": sum(r.batches for r in rows),
        "batch_first": rows[0].batch_first,
        "batch_last": rows[-1].batch_last,
        "last_committed_at": rows[-1].last_committed_at,
    }
    return _bucket(identity, [r.batches for r in rows], lambda _, column: [getattr(r, column) for r in rows])


VALUE_FIELDS = [
    f.name for f in CheckpointRollup._meta.concrete_fields if f.name not in ("id", "job", "resolution", "bucket")
]


def _store(job: Job, resolution: int, buckets: dict[datetime, dict[str, Any]]) -> None:
    """Insert or replace the buckets, in one statement per thousand."""
    CheckpointRollup.objects.bulk_create(
        [CheckpointRollup(job=job, resolution=resolution, bucket=b, **values) for b, values in buckets.items()],
        batch_size=1000,
        update_conflicts=True,
        unique_fields=["job", "resolution", "bucket"],
        update_fields=VALUE_FIELDS,
    )


def _minutes(job: Job, touched: Iterable[datetime]) -> dict[datetime, dict[str, Any]]:
    """Recompute the touched minutes whole, reading their checkpoints in runs of adjacent minutes."""
    result = {}
    wanted = sorted(set(touched))
    step = timedelta(seconds=CheckpointRollup.MINUTE)
    runs: list[list[datetime]] = []
    for minute in wanted:
        if runs and minute - runs[-1][-1] == step and len(runs[-1]) < 1440:
            runs[-1].append(minute)
        else:
            runs.append([minute])
    for run in runs:
        grouped: dict[datetime, list[dict[str, Any]]] = defaultdict(list)
        rows = Checkpoint.objects.filter(job=job, committed_at__gte=run[0], committed_at__lt=run[-1] + step)
        for row in rows.order_by("committed_at", "id").values(*CHART_COLUMNS):
            grouped[bucket_of(row["committed_at"], CheckpointRollup.MINUTE)].append(row)
        result.update({minute: _from_checkpoints(grouped[minute]) for minute in run if grouped[minute]})
    return result


def job_rollup(job: Job, now: datetime | None = None, chunk: int = 50_000) -> int:
    """Roll up what was recorded for this job since the last pass; the number of checkpoints read."""
    # rows recorded in the last few seconds may belong to transactions not yet committed: take them next pass
    upper = (now or timezone.now()) - timedelta(seconds=SETTLE_SECONDS)
    since = job.rolled_up_to or datetime.min.replace(tzinfo=UTC)
    read = 0
    while True:
        fresh = list(
            Checkpoint.objects.filter(job=job, recorded_at__gt=since, recorded_at__lte=upper)
            .order_by("recorded_at")
            .values_list("recorded_at", "committed_at")[:chunk]
        )
        if not fresh:
            break
        read += len(fresh)
        minutes = {bucket_of(committed, CheckpointRollup.MINUTE) for _, committed in fresh}
        with transaction.atomic():
            _store(job, CheckpointRollup.MINUTE, _minutes(job, minutes))
            touched = {bucket_of(m, CheckpointRollup.HOUR) for m in minutes}
            hours: dict[datetime, list[CheckpointRollup]] = defaultdict(list)
            in_range = CheckpointRollup.objects.filter(
                job=job,
                resolution=CheckpointRollup.MINUTE,
                bucket__gte=min(touched),
                bucket__lt=max(touched) + timedelta(seconds=CheckpointRollup.HOUR),
            ).order_by("bucket")
            for minute_rollup in in_range.iterator(chunk_size=5000):
                hour = bucket_of(minute_rollup.bucket, CheckpointRollup.HOUR)
                if hour in touched:
                    hours[hour].append(minute_rollup)
            _store(job, CheckpointRollup.HOUR, {h: _from_rollups(rows) for h, rows in hours.items() if rows})
            since = fresh[-1][0]
            Job.objects.filter(id=job.id).update(rolled_up_to=since)
        job.rolled_up_to = since
        if len(fresh) < chunk:
            break
    return read


def raw_expire(job: Job, now: datetime | None = None) -> int:
    """Delete raw checkpoints older than the retention window that the roll-ups already hold; the job's latest
    checkpoint stays whatever its age."""
    now = now or timezone.now()
    horizon = now - timedelta(hours=settings.CHECKPOINT_RAW_RETENTION_HOURS)
    if job.rolled_up_to is None:
        return 0
    old = Checkpoint.objects.filter(job=job, committed_at__lt=horizon, recorded_at__lte=job.rolled_up_to)
    if job.latest_checkpoint_id:
        old = old.exclude(id=job.latest_checkpoint_id)
    deleted, _ = old.delete()
    return deleted


def rollups_run(now: datetime | None = None) -> dict[str, int]:
    """The periodic pass: roll up every job, then expire raw records beyond retention, and the journals (rotated
    parts, and ended runs') as old."""
    read = expired = journals = 0
    for job in Job.objects.all():
        read += job_rollup(job, now)
        expired += raw_expire(job, now)
        active = set(job.runs.filter(status__in=ACTIVE_RUN_STATUSES).values_list("id", flat=True))
        journals += journals_expire(job.directory / "journal", settings.CHECKPOINT_RAW_RETENTION_HOURS * 3600, active)
    logs = logs_rotate()
    return {"read": read, "expired": expired, "journals": journals, **logs}
