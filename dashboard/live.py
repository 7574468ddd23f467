"""Chart points and consumer-lag status, from checkpoint records, for the pages and the live push."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.utils import timezone

from dashboard.models import (
    Action,
    ActionKind,
    ActionStatus,
    Alert,
    Checkpoint,
    CheckpointRollup,
    Job,
    Recovery,
    Run,
    RunStatus,
)
from dashboard.stats import quantile
from workers.progress import parse_time

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
# Burrow judges a consumer over a window of offsets; here a window of checkpoints
STATUS_WINDOW = 10


def point(record: dict[str, Any]) -> dict[str, Any]:
    """One chart point from a checkpoint record (the driver's record or a stored Checkpoint's fields)."""
    committed = record["committed_at"]
    if isinstance(committed, str):
        committed = parse_time(committed)
    end = record.get("end_offset") or {}
    lag = record.get("lag_records")
    rate = record.get("processed_rate") or 0
    return {
        "t": committed.isoformat(),
        "batch": record["batch_id"],
        "location": record.get("location", "checkpoint"),
        "lag": lag,
        "lag_s": round(lag / rate, 2) if lag is not None and rate > 0 else None,
        "end_n": end.get("n") if isinstance(end, dict) else None,
        "in_rate": round(record.get("input_rate") or 0, 1),
        "proc_rate": round(rate, 1),
        "rows": record.get("input_rows", 0),
        "dur": record.get("duration_ms", 0),
        "wal": record.get("wal_commit_ms", 0),
        "add": record.get("add_batch_ms", 0),
        "commit": record.get("commit_offsets_ms", 0),
        "plan": record.get("query_planning_ms", 0) + record.get("latest_offset_ms", 0),
        "state_commit": record.get("state_commit_ms", 0),
        "state_rows": record.get("state_rows_total", 0),
        "state_mem": record.get("state_memory_bytes", 0),
        "ckpt": record.get("checkpointed_bytes", 0),
        "full": record.get("full_size_bytes", 0),
        # per stateful operator: [rows, bytes in memory]
        "ops": [
            [op.get("numRowsTotal", 0), op.get("memoryUsedBytes", 0)] for op in record.get("state_operators") or []
        ],
    }


FIELDS = (
    "batch_id",
    "committed_at",
    "location",
    "lag_records",
    "end_offset",
    "processed_rate",
    "input_rate",
    "input_rows",
    "duration_ms",
    "wal_commit_ms",
    "add_batch_ms",
    "commit_offsets_ms",
    "query_planning_ms",
    "latest_offset_ms",
    "state_commit_ms",
    "state_rows_total",
    "state_memory_bytes",
    "checkpointed_bytes",
    "full_size_bytes",
    "state_operators",
)


def job_series(job: Job, since: datetime) -> list[dict[str, Any]]:
    """Chart points since a time, oldest first; thinned evenly to at most MAX_POINTS."""
    rows = list(Checkpoint.objects.filter(job=job, committed_at__gte=since).order_by("committed_at").values(*FIELDS))
    if len(rows) > MAX_POINTS:
        step = len(rows) / MAX_POINTS
        rows = [rows[int(i * step)] for i in range(MAX_POINTS - 1)] + [rows[-1]]
    return [point(row) for row in rows]


def rollup_point(r: CheckpointRollup) -> dict[str, Any]:
    """A chart point from a roll-up bucket: the same keys as point(), plus how many batches it holds."""
    rate = r.processed_rate_avg
    lag = r.lag_records_max
    return {
        "t": r.bucket.isoformat(),
        "batch": r.batch_last,
        "batches": r.batches,
        "location": r.location,
        "lag": lag,
        "lag_s": round(lag / rate, 2) if lag is not None and rate > 0 else None,
        "end_n": r.end_n_last,
        "in_rate": round(r.input_rate_avg, 1),
        "proc_rate": round(rate, 1),
        "rows": r.input_rows,
        "dur": round(r.duration_ms_avg),
        "dur_max": r.duration_ms_max,
        "wal": round(r.wal_commit_ms_avg),
        "add": round(r.add_batch_ms_avg),
        "commit": round(r.commit_offsets_ms_avg),
        "plan": round(r.planning_ms_avg),
        "state_commit": round(r.state_commit_ms_avg),
        "state_rows": r.state_rows_last,
        "state_mem": r.state_memory_bytes_last,
        "ckpt": r.checkpointed_bytes_sum,
        "full": r.full_size_bytes_last,
    }


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
    recent_rows = Checkpoint.objects.filter(job=job).order_by("-committed_at", "-id").values(*FIELDS)[:STATUS_WINDOW]
    recent = [point(row) for row in reversed(recent_rows)]
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


def incidents(job: Job, since: datetime) -> list[dict[str, Any]]:
    """The incident timeline: runs starting and ending, failures and restarts, operator actions, alerts."""
    events = []
    for run in Run.objects.filter(job=job, requested_at__gte=since - timedelta(days=1)):
        events += run_incidents(run)
    for action in Action.objects.filter(job=job, requested_at__gte=since - timedelta(days=1)):
        events += action_incidents(action)
    for recovery in Recovery.objects.filter(job=job, failed_at__gte=since):
        events += recovery_incidents(recovery)
    for alert in Alert.objects.filter(job=job, opened_at__gte=since - timedelta(days=1)):
        events += alert_incidents(alert)
    return sorted((e for e in events if e["t"] >= since.isoformat()), key=lambda e: e["t"])


def _incident(at: datetime, kind: str, text: str, key: str) -> dict[str, Any]:
    return {"t": at.isoformat(), "kind": kind, "text": text, "key": key}


def run_incidents(run: Run) -> list[dict[str, Any]]:
    events = []
    if run.started_at:
        events.append(_incident(run.started_at, "start", f"run #{run.id} started", f"run-{run.id}-start"))
    if run.ended_at:
        kind = {RunStatus.STOPPED: "stop", RunStatus.FAILED: "failure", RunStatus.LOST: "failure"}.get(
            RunStatus(run.status), "stop"
        )
        text = f"run #{run.id} {run.status}" + (f": {run.message[:120]}" if run.message else "")
        events.append(_incident(run.ended_at, kind, text, f"run-{run.id}-end"))
    return events


# reads, not changes to the job: no marker on its timeline
READ_ONLY_ACTIONS = (ActionKind.INSPECT_STATE, ActionKind.COUNT_PARTITION_ROWS)


def action_incidents(action: Action) -> list[dict[str, Any]]:
    if action.status not in (ActionStatus.SUCCEEDED, ActionStatus.FAILED) or not action.finished_at:
        return []
    if action.kind in READ_ONLY_ACTIONS:
        return []
    ok = action.status == ActionStatus.SUCCEEDED
    text = f"{action.get_kind_display()} #{action.id} {action.status}" + (
        "" if ok else f": {(action.error or action.outcome)[:120]}"
    )
    return [_incident(action.finished_at, action.kind if ok else "failure", text, f"action-{action.id}")]


def recovery_incidents(recovery: Recovery) -> list[dict[str, Any]]:
    text = f"restart #{recovery.attempt}" + (" (gave up)" if recovery.gave_up else "") + f": {recovery.cause[:120]}"
    return [_incident(recovery.failed_at, "restart", text, f"recovery-{recovery.id}")]


def alert_incidents(alert: Alert) -> list[dict[str, Any]]:
    events = [_incident(alert.opened_at, "alert", f"alert: {alert.message[:140]}", f"alert-{alert.id}-open")]
    if alert.resolved_at:
        events.append(
            _incident(alert.resolved_at, "all-clear", f"all clear: {alert.get_kind_display()}", f"alert-{alert.id}-end")
        )
    return events


@dataclass
class LagStatus:
    status: str  # OK | WARN | STALL | STOP | REWIND | "" (not enough data)
    reason: str
    drain_seconds: float | None


def lag_status(points: list[dict[str, Any]], trigger_seconds: float, now: datetime | None = None) -> LagStatus:
    """Burrow's rules over the last checkpoints: STOP (no commit for longer than the window), REWIND (offsets went
    back), STALL (commits, offsets still, lag left), WARN (offsets advance but lag never falls), else OK."""
    now = now or timezone.now()
    window = points[-STATUS_WINDOW:]
    if not window:
        return LagStatus("", "no checkpoint yet", None)
    last = window[-1]
    quiet = (now - parse_time(last["t"])).total_seconds()
    allowed = max(60.0, 10 * trigger_seconds)
    drain = _drain_seconds(last)
    if quiet > allowed:
        return LagStatus("STOP", f"no commit for {quiet:.0f} s (window {allowed:.0f} s)", None)
    ends = [p["end_n"] for p in window if p["end_n"] is not None and p["location"] == last["location"]]
    if any(b < a for a, b in zip(ends, ends[1:], strict=False)):
        return LagStatus("REWIND", "source offsets went back", drain)
    lags = [p["lag"] for p in window if p["lag"] is not None]
    if len(window) >= 3 and len(set(ends)) == 1 and lags and lags[-1] > 0:
        return LagStatus(
            "STALL", f"batches commit but offsets stay at {ends[-1]} with {lags[-1]} records waiting", None
        )
    if len(lags) >= 3 and lags[-1] > 0 and all(b >= a for a, b in zip(lags, lags[1:], strict=False)):
        return LagStatus("WARN", f"offsets advance but lag never falls ({lags[0]} → {lags[-1]} records)", drain)
    return LagStatus("OK", "keeping up" if not lags or lags[-1] == 0 else "catching up", drain)


def _drain_seconds(last: dict[str, Any]) -> float | None:
    """Time to drain the lag at the current rates; None when it is not draining."""
    lag, gain = last.get("lag") or 0, (last.get("proc_rate") or 0) - (last.get("in_rate") or 0)
    if lag == 0:
        return 0.0
    return round(lag / gain, 1) if gain > 0 else None


PARTITION_WINDOW = 20  # batches a partition's commit time is judged over


@dataclass
class PartitionRow:
    op: int
    part: int
    bytes: int
    added_avg: float
    commit_p50: float | None
    commit_max: int | None
    straggler: bool
    rows: int | None = None  # state rows, when counted on request (Spark reports rows per operator only)


@dataclass
class PartitionView:
    rows: list[PartitionRow]
    batches: int  # how many checkpoints the commit times are taken from
    threshold_ms: float | None  # slower than this is a straggler: max(p95, 1.5 x median) of the partitions' medians
    bytes_skew: float | None  # largest partition against the median partition, by bytes on disk
    stragglers: int
    counted: Action | None = None  # the row count shown, if any
    rows_skew: float | None = None


def partition_view(job: Job) -> PartitionView:
    """Per state partition: bytes on disk, bytes added per batch, and commit time (when the partition's state version
    file was written, after the batch started) over the last batches; stragglers are partitions whose median commit
    time is above max(p95, 1.5 x median) of all partitions' medians."""
    # the newest checkpoints by the (job, committed_at) index, then those of this fork that measured partitions:
    # filtering in SQL first would scan the whole history of a job whose pipeline has no state
    newest = Checkpoint.objects.filter(job=job).order_by("-committed_at", "-id")
    recent = [
        parts
        for location, parts in newest.values_list("location", "partitions")[: PARTITION_WINDOW * 2]
        if parts and location == job.checkpoint_dir
    ][:PARTITION_WINDOW]
    if not recent:
        return PartitionView([], 0, None, None, 0)
    commits: dict[tuple[int, int], list[int]] = {}
    added: dict[tuple[int, int], list[int]] = {}
    for partitions in recent:
        for p in partitions:
            key = (p["op"], p["part"])
            added.setdefault(key, []).append(p.get("added") or 0)
            if p.get("commit_ms") is not None:
                commits.setdefault(key, []).append(p["commit_ms"])
    latest = {(p["op"], p["part"]): p for p in recent[0]}
    medians = {key: quantile([float(v) for v in values], 0.5) for key, values in commits.items()}
    threshold = None
    if len(medians) >= 2:
        values = list(medians.values())
        threshold = max(quantile(values, 0.95), 1.5 * quantile(values, 0.5))
    rows = [
        PartitionRow(
            op=key[0],
            part=key[1],
            bytes=int(p.get("bytes") or 0),
            added_avg=sum(added.get(key, [0])) / max(1, len(added.get(key, []))),
            commit_p50=medians.get(key),
            commit_max=max(commits[key]) if key in commits else None,
            straggler=threshold is not None and key in medians and medians[key] > threshold,
        )
        for key, p in sorted(latest.items())
    ]
    counted = (
        Action.objects.filter(
            job=job,
            kind=ActionKind.COUNT_PARTITION_ROWS,
            status=ActionStatus.SUCCEEDED,
            params__location=job.checkpoint_dir,
        )
        .order_by("-finished_at")
        .first()
    )
    if counted:
        for r in rows:
            r.rows = counted.params.get("rows", {}).get(f"{r.op}:{r.part}")
    view = PartitionView(rows, len(recent), threshold, _skew([r.bytes for r in rows]), sum(r.straggler for r in rows))
    view.counted = counted
    view.rows_skew = _skew([r.rows for r in rows if r.rows is not None])
    return view


def _skew(values: list[int]) -> float | None:
    """The largest against the median; None when there is nothing to compare."""
    sizes = [float(v) for v in values if v]
    median = quantile(sizes, 0.5) if sizes else 0
    return round(max(sizes) / median, 2) if median > 0 else None
