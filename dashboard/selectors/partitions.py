"""Per state partition: bytes on disk, bytes added and commit time over the last batches, stragglers and skew."""

from __future__ import annotations

from dataclasses import dataclass

from dashboard.models import Action, ActionKind, ActionStatus, Checkpoint, Job
from dashboard.stats import quantile

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
