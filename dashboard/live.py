"""Chart points and consumer-lag status, from checkpoint records, for the pages and the live push."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.utils import timezone

from dashboard.models import Checkpoint, Job
from workers.progress import parse_time

RANGES = {"15m": timedelta(minutes=15), "1h": timedelta(hours=1), "6h": timedelta(hours=6), "1d": timedelta(days=1)}
MAX_POINTS = 3000
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
)


def job_series(job: Job, since: datetime) -> list[dict[str, Any]]:
    """Chart points since a time, oldest first; thinned evenly to at most MAX_POINTS."""
    rows = list(Checkpoint.objects.filter(job=job, committed_at__gte=since).order_by("committed_at").values(*FIELDS))
    if len(rows) > MAX_POINTS:
        step = len(rows) / MAX_POINTS
        rows = [rows[int(i * step)] for i in range(MAX_POINTS - 1)] + [rows[-1]]
    return [point(row) for row in rows]


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
