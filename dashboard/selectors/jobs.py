"""Reads about jobs: the job list, its sparklines, dead letters and a job's result tables. Each a constant number of
queries, whatever the number of jobs or checkpoints."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db.models import Count, F, OuterRef, QuerySet, Subquery
from django.db.models.functions import Coalesce
from django.utils import timezone
from django.utils.text import Truncator

from dashboard import pipelines
from dashboard.connections import redis_client
from dashboard.models import (
    ACTIVE_RUN_STATUSES,
    BESIDE_THE_JOB,
    Alert,
    Checkpoint,
    CheckpointRollup,
    DriverHost,
    HostStatus,
    Job,
    ResultRow,
    Run,
)
from dashboard.selectors import charts, lag


def job_list() -> QuerySet[Job]:
    latest_run = Run.objects.filter(job=OuterRef("pk")).exclude(BESIDE_THE_JOB).order_by("-id")
    open_alerts = (
        Alert.objects.filter(job=OuterRef("pk"), resolved_at__isnull=True)
        .order_by()
        .values("job")
        .annotate(n=Count("id"))
        .values("n")
    )
    return (
        Job.objects.filter(archived_at__isnull=True)
        .select_related("latest_checkpoint")
        .annotate(
            run_status=Subquery(latest_run.values("status")[:1]),
            run_id=Subquery(latest_run.values("id")[:1]),
            open_alerts=Coalesce(Subquery(open_alerts[:1]), 0),
        )
    )


TREND_SPAN = timedelta(hours=1)


def job_trends(jobs: list[Job]) -> dict[int, dict[str, list[Any]]]:
    """The last hour of lag and state size per job, for the job list's sparklines: minute roll-ups, then the raw
    checkpoints after the newest of them. Two queries whatever the number of jobs."""
    now = timezone.now()
    trends: dict[int, dict[str, list[Any]]] = {job.id: {"t": [], "lag": [], "state": []} for job in jobs}
    newest: dict[int, datetime] = {}
    minutes = CheckpointRollup.objects.filter(
        job__in=trends, resolution=CheckpointRollup.MINUTE, bucket__gte=now - TREND_SPAN
    ).order_by("job", "bucket")
    for r in minutes.values_list("job_id", "bucket", "lag_records_last", "state_memory_bytes_last"):
        trend = trends[r[0]]
        trend["t"].append(r[1].isoformat())
        trend["lag"].append(r[2])
        trend["state"].append(r[3])
        newest[r[0]] = r[1] + timedelta(seconds=CheckpointRollup.MINUTE)
    tail_from = min(newest.values(), default=now - TREND_SPAN) if len(newest) == len(trends) else now - TREND_SPAN
    raw = Checkpoint.objects.filter(job__in=trends, committed_at__gte=tail_from).order_by("job", "committed_at")
    for job_id, committed, lag_records, state in raw.values_list(
        "job_id", "committed_at", "lag_records", "state_memory_bytes"
    ):
        if committed < newest.get(job_id, tail_from):
            continue
        trend = trends[job_id]
        trend["t"].append(committed.isoformat())
        trend["lag"].append(lag_records)
        trend["state"].append(state)
    return trends


def dead_letter_counts(jobs: list[Job]) -> dict[int, int | None]:
    """Dead-lettered entries per job, in one Redis round trip; None where Redis cannot be reached."""
    try:
        pipe = redis_client(timeout=2).pipeline(transaction=False)
        for job in jobs:
            pipe.xlen(job.dead_letter_stream)
        return {job.id: int(n) for job, n in zip(jobs, pipe.execute(), strict=True)}
    except Exception:
        return {job.id: None for job in jobs}


@dataclass
class ResultTable:
    title: str
    headings: list[str]
    rows: list[list[Any]]
    total: int
    kept: str  # what the table keeps of the view: its bound


def job_results(*, job: Job, limit: int = 15) -> list[ResultTable]:
    tables = []
    pipeline = pipelines.find(job.pipeline)
    for view in pipeline.views if pipeline else ():
        queryset = ResultRow.objects.filter(job=job, kind=view.kind)
        if view.order_by:
            queryset = queryset.order_by(F(f"value__{view.order_by}").desc(nulls_last=True), "key")
        rows = [
            [row.key if key == "key" else row.value.get(key) for _, key in view.columns] for row in queryset[:limit]
        ]
        bound = str(pipelines.result_bound(pipeline, view.kind))
        tables.append(ResultTable(view.title, [h for h, _ in view.columns], rows, queryset.count(), bound))
    return tables


def job_lag_status(job: Job, now: datetime | None = None, recent: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A job's lag status: Burrow's rules over its last checkpoints (``recent``, when the caller has read them)
    while it runs; while it is down, its source's backlog says STOP as soon as records wait (no progress event can
    say it then). With it, the job's latest run (its status and message), which the page's header shows live."""
    now = now or timezone.now()
    latest = job.own_runs.order_by("-id").values("status", "message").first()
    # the message cut as the header's template cuts it, so the page shows the same text before and after a push
    run = {"status": latest["status"], "message": Truncator(latest["message"]).chars(140)} if latest else None
    if not job.runs.filter(status__in=ACTIVE_RUN_STATUSES).exists():
        sample = lag.latest_source_lag([job], now).get(job.id)
        if sample is not None and sample.lag_records > 0:
            oldest = f", the oldest waiting {sample.lag_seconds:.0f} s" if sample.lag_seconds else ""
            down = lag.LagStatus("STOP", f"not running: {job.lag_count(sample.lag_records)} waiting{oldest}", None)
            return asdict(down) | {"run": run}
    points = charts.recent_points(job) if recent is None else recent
    judged = lag.status_json(points, job.trigger_interval_seconds, now)
    if job.reads_kafka and judged["status"] == "OK" and lag.source_unreachable(job):
        judged["reason"] = f"{judged['reason']} as of the last batch; the broker does not answer the console now"
    return judged | {"run": run}


def spare_driver() -> DriverHost | None:
    """This host's spare shared driver, the standby of the jobs in the shared driver."""
    return DriverHost.objects.filter(host=settings.HOST_ID, status=HostStatus.SPARE).first()


def shared_with(run: Run | None) -> str:
    """The other jobs whose queries run in the same shared driver as ``run``, by name (empty for a driver of its own)."""
    if run is None or run.driver_host_id is None:
        return ""
    others = Run.objects.filter(driver_host_id=run.driver_host_id, status__in=ACTIVE_RUN_STATUSES).exclude(id=run.id)
    names = sorted(others.values_list("job__name", flat=True))
    return ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
