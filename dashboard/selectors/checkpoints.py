"""Reads of a job's checkpoint history: keyset pages and the summary over the last checkpoints."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from django.db import connection
from django.db.models import Q

from dashboard.checkpoint_dir.files import CheckpointError, batch_offsets, checkpoint_format, committed_batches
from dashboard.models import Checkpoint, Job
from dashboard.records import SUMMARY_MEASURES
from dashboard.stats import quantile

STATS = ("min", "avg", "p50", "p90", "p99", "max")


@dataclass
class HistoryPage:
    rows: list[Checkpoint]
    older: int | None  # the id to pass as ?before= for the next page, None on the last
    newest: bool  # this is the first page


def checkpoint_history(*, job: Job, before: int | str | None, per_page: int = 25) -> HistoryPage:
    """One page of checkpoints, newest commit first (forks restart their batch ids: commit order keeps the history
    in the order things happened). Keyset pages, ?before=<id>: as fast on page 40,000 as on page 1, no count(*)."""
    queryset = Checkpoint.objects.filter(job=job).select_related("run").order_by("-committed_at", "-id")
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
        for name in (m.column for m in SUMMARY_MEASURES):
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
        for i, m in enumerate(SUMMARY_MEASURES):
            low, avg, pct, high = result[1 + 4 * i : 5 + 4 * i]
            pct = pct or [None, None, None]
            rows.append(SummaryRow(m.label, m.unit, dict(zip(STATS, [low, avg, *pct, high], strict=True))))
        return count, rows
    names = [m.column for m in SUMMARY_MEASURES]
    data = list(
        Checkpoint.objects.filter(job=job).order_by("-committed_at", "-id").values_list(*names)[:SUMMARY_WINDOW]
    )
    for i, m in enumerate(SUMMARY_MEASURES):
        column = sorted(float(r[i]) for r in data)
        if not column:
            rows.append(SummaryRow(m.label, m.unit, dict.fromkeys(STATS)))
            continue
        values = [column[0], sum(column) / len(column)] + [quantile(column, q) for q in (0.5, 0.9, 0.99)] + [column[-1]]
        rows.append(SummaryRow(m.label, m.unit, dict(zip(STATS, values, strict=True))))
    return len(data), rows


@dataclass
class FrozenConfiguration:
    batch: int | None  # the committed batch whose offsets file was read; None before the first commit
    conf: dict[str, str]
    problem: str = ""
    state_format: int = 0  # the state store checkpoint format of the newest commit; 0 before the first


def frozen_configuration(job: Job) -> FrozenConfiguration:
    """The Spark settings recorded in the checkpoint (offsets/<batch>'s metadata): the ones that win on a restart,
    whatever the session says (partitions, state store provider, …)."""
    root = job.checkpoint_location
    batches = committed_batches(root)
    if not batches:
        return FrozenConfiguration(None, {})
    try:
        conf = batch_offsets(root, batches[-1])["metadata"].get("conf", {})
    except CheckpointError as exc:
        return FrozenConfiguration(batches[-1], {}, str(exc))
    return FrozenConfiguration(batches[-1], dict(sorted(conf.items())), state_format=checkpoint_format(root))
