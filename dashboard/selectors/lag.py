"""Consumer-lag status by Burrow's rules, judged once, on the server: the pages, the live push and the alerts all
take it from here."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from typing import Any

import redis
from django.utils import timezone

from dashboard.connections import redis_client
from dashboard.models import Job, SourceLag
from dashboard.records import parse_time

# Burrow judges a consumer over a window of offsets; here a window of checkpoints
STATUS_WINDOW = 10


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
    if not lags or lags[-1] == 0:
        return LagStatus("OK", "keeping up", drain)
    # Burrow's OK: the lag fell somewhere in the window; at the current rates it may still not be draining
    return LagStatus("OK", "catching up" if drain else "behind, not draining at the current rates", drain)


def _drain_seconds(last: dict[str, Any]) -> float | None:
    """Time to drain the lag at the current rates; None when it is not draining."""
    lag, gain = last.get("lag") or 0, (last.get("proc_rate") or 0) - (last.get("in_rate") or 0)
    if lag == 0:
        return 0.0
    return round(lag / gain, 1) if gain > 0 else None


def status_json(points: list[dict[str, Any]], trigger_seconds: float, now: datetime | None = None) -> dict[str, Any]:
    """The lag status as the browser gets it, with each point and on every keep-alive of the live push."""
    return asdict(lag_status(points, trigger_seconds, now))


class LagWindow:
    """The last checkpoints of one job as a live push sees them: seeded from the database, extended by each point
    pushed (a replayed point is counted once), judged on every point and on every keep-alive."""

    def __init__(self, points: list[dict[str, Any]], trigger_seconds: float) -> None:
        self.points = list(points)[-STATUS_WINDOW:]
        self.trigger_seconds = trigger_seconds

    def add(self, point: dict[str, Any]) -> None:
        key = (point["location"], point["batch"])
        if any((p["location"], p["batch"]) == key for p in self.points):
            return
        self.points = sorted([*self.points, point], key=lambda p: p["t"])[-STATUS_WINDOW:]

    def status(self, now: datetime | None = None) -> dict[str, Any]:
        return status_json(self.points, self.trigger_seconds, now)


def stream_head(stream: str) -> tuple[int, int] | None:
    """(entries ever added, entries trimmed away) of a Redis stream source, from XINFO STREAM's entries-added (the
    ``n`` of the source's offsets); None when Redis cannot be reached."""
    try:
        try:
            info = redis_client().xinfo_stream(stream)
        except redis.ResponseError as exc:  # a stream that does not exist yet has no entries
            if "no such key" in str(exc).lower():
                return 0, 0
            raise
        added = int(info["entries-added"])
        return added, added - int(info["length"])
    except redis.RedisError:
        return None


SOURCE_FRESH = timedelta(minutes=2)  # an older sample says nothing about now


def latest_source_lag(jobs: list[Job], now: datetime | None = None) -> dict[int, SourceLag]:
    """Each job's newest lag sample from the source, when one is fresh: one query, bounded by the last two minutes."""
    since = (now or timezone.now()) - SOURCE_FRESH
    latest: dict[int, SourceLag] = {}
    for sample in SourceLag.objects.filter(job__in=jobs, sampled_at__gte=since).order_by("job", "-sampled_at"):
        latest.setdefault(sample.job_id, sample)
    return latest


def source_error_key(job_id: int) -> str:
    """Where the lag sampler keeps why a job's source did not answer (``services.source_lag``)."""
    return f"statekeeper:source-error:{job_id}"


def source_unreachable(job: Job) -> dict[str, Any] | None:
    """Why the job's source could not be sampled lately ({"error", "since"}), None when it answers (or Redis, which
    keeps the reason, does not)."""
    try:
        raw = redis_client(timeout=2).get(source_error_key(job.id))
    except redis.RedisError:
        return None
    if not raw:
        return None
    found = json.loads(raw)
    return {"error": str(found.get("error", "")), "since": datetime.fromisoformat(found["since"])}


def source_series(job: Job, since: datetime, limit: int = 3000) -> list[dict[str, Any]]:
    """The source's lag samples since a time, oldest first, thinned evenly to ``limit``."""
    rows = list(
        SourceLag.objects.filter(job=job, sampled_at__gte=since)
        .order_by("sampled_at")
        .values_list("sampled_at", "lag_records", "lag_seconds")
    )
    if len(rows) > limit:
        step = len(rows) / limit
        rows = [rows[int(i * step)] for i in range(limit - 1)] + [rows[-1]]
    return [{"t": t.isoformat(), "lag": lag, "age": age} for t, lag, age in rows]


def source_lag_growing(samples: list[SourceLag]) -> bool:
    """Lag rose across the samples (oldest first) and is still there: the source moves on, the job does not."""
    lags = [s.lag_records for s in samples]
    return len(lags) >= 3 and lags[-1] > lags[0] and all(b >= a for a, b in zip(lags, lags[1:], strict=False))


def sources_unreachable(jobs: list[Job]) -> set[int]:
    """The ids of those Kafka jobs whose source could not be sampled lately, in one look at Redis (empty when Redis,
    which keeps the reasons, does not answer)."""
    kafka = [job.id for job in jobs if job.reads_kafka]
    if not kafka:
        return set()
    try:
        found = redis_client(timeout=2).mget([source_error_key(job_id) for job_id in kafka])
    except redis.RedisError:
        return set()
    return {job_id for job_id, raw in zip(kafka, found, strict=True) if raw}
