"""Reads for the pages: each a constant number of queries, whatever the number of jobs or checkpoints."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import connection
from django.db.models import Count, F, OuterRef, Q, QuerySet, Subquery
from django.db.models.functions import Coalesce
from django.utils import timezone

from dashboard.models import Alert, Checkpoint, CheckpointRollup, Job, ResultRow, Run
from dashboard.stats import quantile
from workers.pipelines import get as get_pipeline

SUMMARY_FIELDS = (
    ("duration_ms", "End to end duration", "ms"),
    ("checkpointed_bytes", "Checkpointed data size", "bytes"),
    ("full_size_bytes", "Full checkpoint size", "bytes"),
    ("state_commit_ms", "State commit time", "ms"),
    ("input_rows", "Input rows", "rows"),
)
STATS = ("min", "avg", "p50", "p90", "p99", "max")


def job_list() -> QuerySet[Job]:
    latest_run = Run.objects.filter(job=OuterRef("pk")).order_by("-id")
    open_alerts = (
        Alert.objects.filter(job=OuterRef("pk"), resolved_at__isnull=True)
        .order_by()
        .values("job")
        .annotate(n=Count("id"))
        .values("n")
    )
    return Job.objects.select_related("latest_checkpoint").annotate(
        run_status=Subquery(latest_run.values("status")[:1]),
        run_id=Subquery(latest_run.values("id")[:1]),
        open_alerts=Coalesce(Subquery(open_alerts[:1]), 0),
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
    for job_id, committed, lag, state in raw.values_list("job_id", "committed_at", "lag_records", "state_memory_bytes"):
        if committed < newest.get(job_id, tail_from):
            continue
        trend = trends[job_id]
        trend["t"].append(committed.isoformat())
        trend["lag"].append(lag)
        trend["state"].append(state)
    return trends


def dead_letter_counts(jobs: list[Job]) -> dict[int, int | None]:
    """Dead-lettered entries per job, in one Redis round trip; None where Redis cannot be reached."""
    import redis

    try:
        client = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=2, socket_connect_timeout=2)
        pipe = client.pipeline(transaction=False)
        for job in jobs:
            pipe.xlen(job.dead_letter_stream)
        return {job.id: int(n) for job, n in zip(jobs, pipe.execute(), strict=True)}
    except Exception:
        return {job.id: None for job in jobs}


@dataclass
class HistoryPage:
    rows: list[Checkpoint]
    older: int | None  # the id to pass as ?before= for the next page, None on the last
    newest: bool  # this is the first page


def checkpoint_history(*, job: Job, before: int | str | None, per_page: int = 25) -> HistoryPage:
    """One page of checkpoints, newest commit first (forks restart their batch ids: commit order keeps the history
    in the order things happened). Keyset pages, ?before=<id>: as fast on page 40,000 as on page 1, no count(*)."""
    queryset = Checkpoint.objects.filter(job=job).order_by("-committed_at", "-id")
    anchor = None
    if before:
        with contextlib.suppress(ValueError, TypeError):
            anchor = Checkpoint.objects.filter(job=job, id=int(before)).values("committed_at", "id").first()
    if anchor:
        # (committed_at, id) < anchor, written so the (job, committed_at, id) index bounds the scan
        queryset = queryset.filter(committed_at__lte=anchor["committed_at"]).filter(
            Q(committed_at__lt=anchor["committed_at"]) | Q(id__lt=anchor["id"])
        )
    rows = list(queryset[: per_page + 1])
    older = rows[per_page - 1].id if len(rows) > per_page else None
    return HistoryPage(rows[:per_page], older, anchor is None)


@dataclass
class SummaryRow:
    label: str
    unit: str
    values: dict[str, float | None]


SUMMARY_WINDOW = 1000


def checkpoint_summary(*, job: Job) -> tuple[int, list[SummaryRow]]:
    """Min / avg / p50 / p90 / p99 / max of each checkpoint measure over the last SUMMARY_WINDOW checkpoints, like
    Flink's checkpoint summary over its retained history."""
    rows: list[SummaryRow] = []
    if connection.vendor == "postgresql":
        parts = []
        for name, _, _ in SUMMARY_FIELDS:
            parts += [
                f"min({name})",
                f"avg({name})",
                f"percentile_cont(ARRAY[0.5, 0.9, 0.99]) WITHIN GROUP (ORDER BY {name})",
                f"max({name})",
            ]
        with connection.cursor() as cursor:
            cursor.execute(
                f"SELECT count(*), {', '.join(parts)} FROM (SELECT * FROM dashboard_checkpoint WHERE job_id = %s "
                "ORDER BY committed_at DESC, id DESC LIMIT %s) AS recent",
                [job.id, SUMMARY_WINDOW],
            )
            result = cursor.fetchone()
        count = int(result[0])
        for i, (_, label, unit) in enumerate(SUMMARY_FIELDS):
            low, avg, pct, high = result[1 + 4 * i : 5 + 4 * i]
            pct = pct or [None, None, None]
            rows.append(SummaryRow(label, unit, dict(zip(STATS, [low, avg, *pct, high], strict=True))))
        return count, rows
    names = [name for name, _, _ in SUMMARY_FIELDS]
    data = list(
        Checkpoint.objects.filter(job=job).order_by("-committed_at", "-id").values_list(*names)[:SUMMARY_WINDOW]
    )
    for i, (_, label, unit) in enumerate(SUMMARY_FIELDS):
        column = sorted(float(r[i]) for r in data)
        if not column:
            rows.append(SummaryRow(label, unit, dict.fromkeys(STATS)))
            continue
        values = [column[0], sum(column) / len(column)] + [quantile(column, q) for q in (0.5, 0.9, 0.99)] + [column[-1]]
        rows.append(SummaryRow(label, unit, dict(zip(STATS, values, strict=True))))
    return len(data), rows


@dataclass
class ResultTable:
    title: str
    headings: list[str]
    rows: list[list[Any]]
    total: int


def job_results(*, job: Job, limit: int = 15) -> list[ResultTable]:
    tables = []
    for view in get_pipeline(job.pipeline).views:
        queryset = ResultRow.objects.filter(job=job, kind=view.kind)
        if view.order_by:
            queryset = queryset.order_by(F(f"value__{view.order_by}").desc(nulls_last=True), "key")
        rows = [
            [row.key if key == "key" else row.value.get(key) for _, key in view.columns] for row in queryset[:limit]
        ]
        tables.append(ResultTable(view.title, [h for h, _ in view.columns], rows, queryset.count()))
    return tables
