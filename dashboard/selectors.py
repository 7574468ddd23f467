"""Reads for the pages: each a constant number of queries, whatever the number of jobs or checkpoints."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.core.paginator import Page, Paginator
from django.db import connection
from django.db.models import F, OuterRef, QuerySet, Subquery

from dashboard.models import Checkpoint, Job, ResultRow, Run
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
    return Job.objects.select_related("latest_checkpoint").annotate(
        run_status=Subquery(latest_run.values("status")[:1]),
        run_id=Subquery(latest_run.values("id")[:1]),
    )


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


def checkpoint_history(*, job: Job, page: int | str | None, per_page: int = 25) -> Page[Checkpoint]:
    # forks restart their batch ids: newest commit first keeps the history in the order things happened
    queryset = Checkpoint.objects.filter(job=job).order_by("-committed_at", "-id")
    return Paginator(queryset, per_page).get_page(page)


@dataclass
class SummaryRow:
    label: str
    unit: str
    values: dict[str, float | None]


def _percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks, as PostgreSQL's percentile_cont."""
    pos = (len(values) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def checkpoint_summary(*, job: Job) -> tuple[int, list[SummaryRow]]:
    """Min / avg / p50 / p90 / p99 / max of each checkpoint measure, like Flink's checkpoint summary."""
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
            cursor.execute(f"SELECT count(*), {', '.join(parts)} FROM dashboard_checkpoint WHERE job_id = %s", [job.id])
            result = cursor.fetchone()
        count = int(result[0])
        for i, (_, label, unit) in enumerate(SUMMARY_FIELDS):
            low, avg, pct, high = result[1 + 4 * i : 5 + 4 * i]
            pct = pct or [None, None, None]
            rows.append(SummaryRow(label, unit, dict(zip(STATS, [low, avg, *pct, high], strict=True))))
        return count, rows
    names = [name for name, _, _ in SUMMARY_FIELDS]
    data = list(Checkpoint.objects.filter(job=job).values_list(*names))
    for i, (_, label, unit) in enumerate(SUMMARY_FIELDS):
        column = sorted(float(r[i]) for r in data)
        if not column:
            rows.append(SummaryRow(label, unit, dict.fromkeys(STATS)))
            continue
        values = (
            [column[0], sum(column) / len(column)] + [_percentile(column, q) for q in (0.5, 0.9, 0.99)] + [column[-1]]
        )
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
