"""The weekly capacity review: per job, what grew, what it costs, how much headroom is left, and what to change.

Reads the roll-ups (hours for trends, minutes for peaks) so a week of a job committing every second costs a few
hundred rows, and the raw checkpoints of the week where they are still kept (percentiles, watermark drops)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db.models import Max, Sum
from django.utils import timezone

from dashboard.models import (
    Action,
    ActionKind,
    ActionStatus,
    Alert,
    AlertKind,
    Checkpoint,
    CheckpointRollup,
    Job,
    Recovery,
    Savepoint,
    SavepointStatus,
    StateBackend,
)
from dashboard.selectors.partitions import partition_view
from dashboard.selectors.savepoints import savepoint_newest_verified
from dashboard.stats import quantile

TARGET_UTILISATION = 0.7  # batch time / trigger interval that leaves room for bursts and catch-up
RAISE_ABOVE, LOWER_BELOW = 0.85, 0.3  # a band around the target: inside it, no recommendation (no flapping)
RESCALE_QUIET_HOURS = 24  # no parallelism recommendation within this long of the last rescale
MEMORY_WARN_SHARE = 0.7  # of the memory budget
FORECAST_WARN_DAYS = 30


@dataclass
class Fit:
    """A least-squares line through (day, value): the slope per day, its standard error, and R²."""

    slope: float
    intercept: float
    stderr: float
    r2: float
    points: int

    def at(self, day: float) -> float:
        return self.intercept + self.slope * day


def fit_line(xs: list[float], ys: list[float]) -> Fit | None:
    n = len(xs)
    if n < 3 or max(xs) - min(xs) <= 0:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    slope = sxy / sxx
    intercept = my - slope * mx
    residual = sum((y - (intercept + slope * x)) ** 2 for x, y in zip(xs, ys, strict=True))
    total = sum((y - my) ** 2 for y in ys)
    stderr = math.sqrt(residual / (n - 2) / sxx) if n > 2 else 0.0
    return Fit(slope, intercept, stderr, 1 - residual / total if total > 0 else 1.0, n)


@dataclass
class Forecast:
    budget: float
    unit: str  # "memory" or "disk"
    days: float | None  # at the fitted growth; None when not growing
    earliest: float | None  # at the fitted growth + 2 standard errors
    latest: float | None  # at the fitted growth - 2 standard errors; None when that is not growing


def forecast(fit: Fit | None, current: float, budget: float, unit: str) -> Forecast:
    if fit is None:
        return Forecast(budget, unit, None, None, None)
    if current >= budget:
        return Forecast(budget, unit, 0.0, 0.0, 0.0)

    def days_at(slope: float) -> float | None:
        return (budget - current) / slope if slope > 0 else None

    return Forecast(
        budget, unit, days_at(fit.slope), days_at(fit.slope + 2 * fit.stderr), days_at(fit.slope - 2 * fit.stderr)
    )


@dataclass
class Recommendation:
    kind: str  # parallelism | backend | partitions | leak
    text: str
    reason: str
    params: dict[str, int] = field(default_factory=dict)


@dataclass
class JobReview:
    job: Job
    start: datetime
    end: datetime
    batches: int = 0
    state_rows: tuple[int | None, int | None] = (None, None)  # start, end of the week
    state_bytes: tuple[int | None, int | None] = (None, None)  # memory (memory backend) or disk (RocksDB)
    rows_fit: Fit | None = None
    bytes_fit: Fit | None = None
    budget: Forecast | None = None
    duration_p50: float | None = None
    duration_p99: float | None = None
    utilisation: float | None = None  # p50 batch time / trigger interval
    peak_input_rate: float | None = None
    capacity_rate: float | None = None  # rows per second of batch time
    headroom: float | None = None  # capacity / peak input
    peak_lag: int | None = None
    warn_seconds: float = 0.0
    stop_seconds: float = 0.0
    restarts: int = 0
    rescales: int = 0
    failed_savepoints: int = 0
    dropped_by_watermark: int | None = None
    rows_removed: int | None = None
    checkpointed_bytes: int = 0
    full_size: tuple[int | None, int | None] = (None, None)
    series: dict[str, list[Any]] = field(default_factory=dict)
    drill: Savepoint | None = None  # the newest verified savepoint, with its last restore drill
    recommendations: list[Recommendation] = field(default_factory=list)


def _day(moment: datetime, origin: datetime) -> float:
    return (moment - origin).total_seconds() / 86400


def _overlap_seconds(alerts: list[Alert], start: datetime, end: datetime) -> float:
    total = 0.0
    for a in alerts:
        opened, closed = max(a.opened_at, start), min(a.resolved_at or end, end)
        total += max(0.0, (closed - opened).total_seconds())
    return total


def job_review(job: Job, start: datetime, end: datetime) -> JobReview:
    review = JobReview(job, start, end)
    hours = list(
        CheckpointRollup.objects.filter(
            job=job, resolution=CheckpointRollup.HOUR, bucket__gte=start, bucket__lt=end
        ).order_by("bucket")
    )
    minutes = CheckpointRollup.objects.filter(
        job=job, resolution=CheckpointRollup.MINUTE, bucket__gte=start, bucket__lt=end
    )
    memory = job.state_backend == StateBackend.MEMORY
    if hours:
        review.batches = sum(h.batches for h in hours)
        days = [_day(h.bucket, start) for h in hours]
        rows = [float(h.state_rows_last) for h in hours]
        sizes = [float(h.state_memory_bytes_last if memory else h.full_size_bytes_last) for h in hours]
        review.state_rows = (hours[0].state_rows_last, hours[-1].state_rows_last)
        review.state_bytes = (int(sizes[0]), int(sizes[-1]))
        review.full_size = (hours[0].full_size_bytes_last, hours[-1].full_size_bytes_last)
        review.rows_fit, review.bytes_fit = fit_line(days, rows), fit_line(days, sizes)
        budget = job.memory_budget_mb * 2**20 if memory else job.disk_budget_gb * 2**30
        review.budget = forecast(review.bytes_fit, sizes[-1], budget, "memory" if memory else "disk")
        review.checkpointed_bytes = sum(h.checkpointed_bytes_sum for h in hours)
        review.peak_lag = max((h.lag_records_max or 0 for h in hours), default=None)
        total_rows = sum(h.input_rows for h in hours)
        busy_seconds = sum(h.duration_ms_avg * h.batches for h in hours) / 1000
        review.capacity_rate = total_rows / busy_seconds if busy_seconds > 0 else None
        review.series = {
            "t": [h.bucket.isoformat() for h in hours],
            "rows": [h.state_rows_last for h in hours],
            "bytes": [int(v) for v in sizes],
            "full": [h.full_size_bytes_last for h in hours],
            "ckpt": [h.checkpointed_bytes_sum for h in hours],
            "dur_avg": [round(h.duration_ms_avg) for h in hours],
            "dur_max": [h.duration_ms_max for h in hours],
            "in_rate": [round(h.input_rate_avg, 1) for h in hours],
        }
    peak = minutes.aggregate(peak=Max("input_rate_avg"))["peak"]
    review.peak_input_rate = peak
    if review.capacity_rate and peak:
        review.headroom = review.capacity_rate / peak
    raw = Checkpoint.objects.filter(job=job, committed_at__gte=start, committed_at__lt=end)
    durations = [float(d) for d in raw.values_list("duration_ms", flat=True)]
    if not durations:  # the raw records aged out: the minutes' averages and maxima stand in
        durations = [float(m) for m in minutes.values_list("duration_ms_avg", flat=True)]
    if durations:
        review.duration_p50, review.duration_p99 = quantile(durations, 0.5), quantile(durations, 0.99)
    if review.duration_p50 is not None:
        review.utilisation = review.duration_p50 / (job.trigger_interval_seconds * 1000)
    if raw.exists():
        review.rows_removed = raw.aggregate(n=Sum("state_rows_removed"))["n"] or 0
        review.dropped_by_watermark = raw.aggregate(n=Sum("rows_dropped_by_watermark"))["n"] or 0
    lag_alerts = list(Alert.objects.filter(job=job, opened_at__lt=end).exclude(resolved_at__lt=start))
    review.warn_seconds = _overlap_seconds([a for a in lag_alerts if a.kind == AlertKind.LAG_WARN], start, end)
    review.stop_seconds = _overlap_seconds([a for a in lag_alerts if a.kind == AlertKind.LAG_STOP], start, end)
    review.restarts = Recovery.objects.filter(job=job, failed_at__gte=start, failed_at__lt=end).count()
    review.rescales = Action.objects.filter(
        job=job, kind=ActionKind.RESCALE, status=ActionStatus.SUCCEEDED, finished_at__gte=start, finished_at__lt=end
    ).count()
    review.failed_savepoints = Savepoint.objects.filter(
        job=job, status=SavepointStatus.FAILED, created_at__gte=start, created_at__lt=end
    ).count()
    review.drill = savepoint_newest_verified(job)
    review.recommendations = recommendations(review)
    return review


def parallelism_advice(job: Job, utilisation: float | None, now: datetime) -> Recommendation | None:
    """Raise or lower cores towards TARGET_UTILISATION, only outside the band and not soon after a rescale."""
    if utilisation is None:
        return None
    last = (
        Action.objects.filter(job=job, kind=ActionKind.RESCALE, status=ActionStatus.SUCCEEDED)
        .order_by("-finished_at")
        .values_list("finished_at", flat=True)
        .first()
    )
    if last and now - last < timedelta(hours=RESCALE_QUIET_HOURS):
        return None
    wanted = max(1, min(64, math.ceil(job.parallelism * utilisation / TARGET_UTILISATION)))
    why = (
        f"median batch time is {utilisation:.0%} of the {job.trigger_interval_seconds:g} s trigger "
        f"(target {TARGET_UTILISATION:.0%}, acting outside {LOWER_BELOW:.0%}–{RAISE_ABOVE:.0%})"
    )
    if utilisation > RAISE_ABOVE and wanted > job.parallelism:
        return Recommendation(
            "parallelism", f"Raise parallelism {job.parallelism} → {wanted}", why, {"parallelism": wanted}
        )
    if utilisation < LOWER_BELOW and wanted < job.parallelism:
        return Recommendation(
            "parallelism", f"Lower parallelism {job.parallelism} → {wanted}", why, {"parallelism": wanted}
        )
    return None


def recommendations(review: JobReview) -> list[Recommendation]:
    job, found = review.job, []
    if advice := parallelism_advice(job, review.utilisation, review.end):
        found.append(advice)
    budget = review.budget
    if job.state_backend == StateBackend.MEMORY and budget and review.state_bytes[1] is not None:
        share = review.state_bytes[1] / budget.budget
        soon = budget.earliest is not None and budget.earliest < FORECAST_WARN_DAYS
        if share >= MEMORY_WARN_SHARE or soon:
            when = (
                f"; at this growth it reaches the budget in {budget.earliest:.0f}–{budget.days:.0f} days"
                if soon and budget.days
                else ""
            )
            found.append(
                Recommendation(
                    "backend",
                    "Move to the RocksDB backend",
                    f"state uses {share:.0%} of its {job.memory_budget_mb} MB memory budget{when}",
                )
            )
    stragglers = partition_view(job)
    if stragglers.stragglers:
        slow = ", ".join(f"p{r.part}" for r in stragglers.rows if r.straggler)
        found.append(
            Recommendation(
                "partitions",
                f"Add state partitions ({job.state_partitions} → {job.state_partitions * 2})",
                f"{slow} commit slower than max(p95, 1.5 × median) = {stragglers.threshold_ms:.0f} ms"
                + ("" if job.state_backend != StateBackend.MEMORY else "; a memory-backend job needs RocksDB first"),
                {"state_partitions": job.state_partitions * 2},
            )
        )
    fit = review.rows_fit
    rows_start, rows_end = review.state_rows
    if (
        fit is not None
        and fit.slope > 0
        and fit.r2 >= 0.8
        and rows_start is not None
        and rows_end is not None
        and rows_end > 1.1 * max(rows_start, 1)
        and review.dropped_by_watermark == 0
        and review.rows_removed == 0
    ):
        found.append(
            Recommendation(
                "leak",
                "Likely state leak",
                f"state rows grew {rows_start:,} → {rows_end:,} ({fit.slope:,.0f} a day, R² {fit.r2:.2f}) while no row "
                "was dropped by the watermark or removed: keys that never expire (no watermark, no TTL, no timeout?)",
            )
        )
    return found


@dataclass
class Review:
    start: datetime
    end: datetime
    jobs: list[JobReview]

    @property
    def totals(self) -> dict[str, Any]:
        return {
            "jobs": len(self.jobs),
            "batches": sum(r.batches for r in self.jobs),
            "state_rows": sum(r.state_rows[1] or 0 for r in self.jobs),
            "full_size": sum(r.full_size[1] or 0 for r in self.jobs),
            "checkpointed_bytes": sum(r.checkpointed_bytes for r in self.jobs),
            "restarts": sum(r.restarts for r in self.jobs),
            "failed_savepoints": sum(r.failed_savepoints for r in self.jobs),
            "recommendations": sum(len(r.recommendations) for r in self.jobs),
        }


def week_review(end: datetime | None = None, days: int = 7) -> Review:
    end = end or timezone.now()
    start = end - timedelta(days=days)
    return Review(start, end, [job_review(job, start, end) for job in Job.objects.order_by("name")])


CSV_COLUMNS = (
    "job", "backend", "batches", "state_rows_start", "state_rows_end", "state_rows_per_day", "state_bytes_end",
    "state_bytes_per_day", "budget_bytes", "days_to_budget", "days_to_budget_earliest", "days_to_budget_latest",
    "duration_p50_ms", "duration_p99_ms", "trigger_ms", "utilisation", "peak_input_rate", "capacity_rate", "headroom",
    "peak_lag", "warn_seconds", "stop_seconds", "restarts", "rescales", "failed_savepoints", "recommendations",
)  # fmt: skip


def csv_rows(review: Review) -> list[list[Any]]:
    rows: list[list[Any]] = [list(CSV_COLUMNS)]
    for r in review.jobs:
        b = r.budget
        rows.append(
            [
                r.job.name,
                r.job.state_backend,
                r.batches,
                r.state_rows[0],
                r.state_rows[1],
                round(r.rows_fit.slope, 2) if r.rows_fit else "",
                r.state_bytes[1],
                round(r.bytes_fit.slope, 2) if r.bytes_fit else "",
                b.budget if b else "",
                _round(b.days if b else None),
                _round(b.earliest if b else None),
                _round(b.latest if b else None),
                _round(r.duration_p50),
                _round(r.duration_p99),
                r.job.trigger_interval_seconds * 1000,
                _round(r.utilisation, 3),
                _round(r.peak_input_rate),
                _round(r.capacity_rate),
                _round(r.headroom, 2),
                r.peak_lag,
                round(r.warn_seconds),
                round(r.stop_seconds),
                r.restarts,
                r.rescales,
                r.failed_savepoints,
                " | ".join(f"{rec.text} ({rec.reason})" for rec in r.recommendations),
            ]  # fmt: skip
        )
    return rows


def _round(value: float | None, digits: int = 1) -> Any:
    return "" if value is None else round(value, digits)


def summary_text(review: Review, url: str) -> str:
    """The e-mail: one paragraph per job, recommendations first."""
    lines = [f"Statekeeper capacity review, {review.start:%Y-%m-%d} to {review.end:%Y-%m-%d}", ""]
    t = review.totals
    lines.append(
        f"{t['jobs']} jobs, {t['batches']:,} batches, {t['restarts']} restarts, {t['failed_savepoints']} failed "
        f"savepoints, {t['recommendations']} recommendations."
    )
    for r in review.jobs:
        lines += ["", f"== {r.job.name} ({r.job.get_state_backend_display()})"]
        for rec in r.recommendations:
            lines.append(f"  * {rec.text}: {rec.reason}")
        if r.utilisation is not None:
            lines.append(
                f"  batch time p50 {r.duration_p50:.0f} ms / p99 {r.duration_p99:.0f} ms against a "
                f"{r.job.trigger_interval_seconds:g} s trigger ({r.utilisation:.0%})"
            )
        if r.headroom:
            lines.append(f"  headroom {r.headroom:.1f}× the peak input rate ({r.peak_input_rate:.0f} rows/s)")
        if r.budget and r.budget.days is not None:
            lines.append(f"  reaches its {r.budget.unit} budget in about {r.budget.days:.0f} days")
        lines.append(f"  restarts {r.restarts}, rescales {r.rescales}, failed savepoints {r.failed_savepoints}")
        if r.drill is not None:
            outcome = "not drilled yet" if r.drill.drill_ok is None else ("passed" if r.drill.drill_ok else "FAILED")
            lines.append(f"  restore drill of savepoint #{r.drill.id}: {outcome} {r.drill.drill_message}".rstrip())
    lines += ["", f"The full review: {url}"]
    return "\n".join(lines)
