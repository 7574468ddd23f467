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

from dashboard import live
from dashboard.models import Checkpoint, CheckpointRollup, Job

SETTLE_SECONDS = 5
RAW_FIELDS = tuple(f for f in live.FIELDS if f != "state_operators")  # what a chart point is made of
AVERAGED = (
    "duration_ms_avg",
    "wal_commit_ms_avg",
    "add_batch_ms_avg",
    "commit_offsets_ms_avg",
    "planning_ms_avg",
    "state_commit_ms_avg",
    "input_rate_avg",
    "processed_rate_avg",
)


def bucket_of(moment: datetime, resolution: int) -> datetime:
    seconds = int(moment.timestamp()) // resolution * resolution
    return datetime.fromtimestamp(seconds, tz=UTC)


def _from_checkpoints(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One minute bucket from its raw checkpoints (oldest first)."""
    n, last = len(rows), rows[-1]
    end = last["end_offset"] if isinstance(last["end_offset"], dict) else {}
    lags = [r["lag_records"] for r in rows if r["lag_records"] is not None]

    def avg(key: str) -> float:
        return sum(r[key] or 0 for r in rows) / n

    return {
        "location": last["location"],
        "batches": n,
        "batch_first": rows[0]["batch_id"],
        "batch_last": last["batch_id"],
        "last_committed_at": last["committed_at"],
        "input_rows": sum(r["input_rows"] for r in rows),
        "duration_ms_avg": avg("duration_ms"),
        "duration_ms_max": max(r["duration_ms"] for r in rows),
        "wal_commit_ms_avg": avg("wal_commit_ms"),
        "add_batch_ms_avg": avg("add_batch_ms"),
        "commit_offsets_ms_avg": avg("commit_offsets_ms"),
        "planning_ms_avg": sum(r["query_planning_ms"] + r["latest_offset_ms"] for r in rows) / n,
        "state_commit_ms_avg": avg("state_commit_ms"),
        "input_rate_avg": avg("input_rate"),
        "processed_rate_avg": avg("processed_rate"),
        "lag_records_max": max(lags) if lags else None,
        "lag_records_last": last["lag_records"],
        "end_n_last": end.get("n"),
        "state_rows_last": last["state_rows_total"],
        "state_memory_bytes_last": last["state_memory_bytes"],
        "checkpointed_bytes_sum": sum(r["checkpointed_bytes"] for r in rows),
        "full_size_bytes_last": last["full_size_bytes"],
    }


def _from_rollups(rows: list[CheckpointRollup]) -> dict[str, Any]:
    """One hour bucket from its minute buckets: averages weighted by batches, sums summed, the last value kept."""
    n, last = sum(r.batches for r in rows), rows[-1]
    lags = [r.lag_records_max for r in rows if r.lag_records_max is not None]
    merged = {key: sum(getattr(r, key) * r.batches for r in rows) / n for key in AVERAGED}
    return merged | {
        "location": last.location,
        "batches": n,
        "batch_first": rows[0].batch_first,
        "batch_last": last.batch_last,
        "last_committed_at": last.last_committed_at,
        "input_rows": sum(r.input_rows for r in rows),
        "duration_ms_max": max(r.duration_ms_max for r in rows),
        "lag_records_max": max(lags) if lags else None,
        "lag_records_last": last.lag_records_last,
        "end_n_last": last.end_n_last,
        "state_rows_last": last.state_rows_last,
        "state_memory_bytes_last": last.state_memory_bytes_last,
        "checkpointed_bytes_sum": sum(r.checkpointed_bytes_sum for r in rows),
        "full_size_bytes_last": last.full_size_bytes_last,
    }


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
        for row in rows.order_by("committed_at", "id").values(*RAW_FIELDS):
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
    """The periodic pass: roll up every job, then expire raw records beyond retention."""
    read = expired = 0
    for job in Job.objects.all():
        read += job_rollup(job, now)
        expired += raw_expire(job, now)
    return {"read": read, "expired": expired}
